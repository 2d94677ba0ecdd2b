"""Backbone features and exemplar embeddings of labeled images (``models.features``): what the trainers, the
metrics and the guard compute prototypes and feature maps with, against the ``Localizer`` that serves them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.bundle import load_bundle
from models.data.types import LabeledImages, exemplar_crops
from models.experiments.cmnist import cmnist
from models.features import crop_embeddings, features_of, prototype_of, prototypes_for, with_features
from models.inference import Localizer, normalize

BUNDLE = Path(__file__).resolve().parents[2] / "bundles" / "mnist-digit4.pt"


@pytest.fixture(scope="module")
def bundle():
    return load_bundle(BUNDLE, "cpu")


@pytest.fixture(scope="module")
def data():
    return cmnist(4, "val", 9, "patch", 0)


def test_features_of_is_the_backbone_on_normalized_images_in_any_batch(bundle, data):
    with torch.no_grad():
        direct = bundle.embedder.features(normalize(data.images, bundle.config.input))
    assert torch.allclose(features_of(bundle, data.images), direct, atol=1e-5)
    assert torch.allclose(features_of(bundle, data.images, batch=4), direct, atol=1e-5)  # 4 + 4 + 1
    assert not features_of(bundle, data.images).requires_grad


def test_with_features_carries_the_images_and_crops_features_through_a_cache(bundle, data):
    asked = []

    def cache(kind, make):  # noqa: ANN001, ANN202
        asked.append(kind)
        return make()

    out = with_features(bundle, data, batch=4, cache=cache)
    assert asked == ["images"] and out.crop_feats is None and out.images is data.images
    assert torch.allclose(out.feats, features_of(bundle, data.images), atol=1e-5)
    asked.clear()
    both = with_features(bundle, data, crops=True, cache=cache)
    assert asked == ["images", "crops"]
    assert both.crop_feats.shape[0] == len(data) and both.crop_boxes.shape == (len(data), 4)
    served = with_features(bundle, data, crops=True, cache=lambda kind, make: torch.full((1,), float(len(kind))))
    assert served.feats.tolist() == [6.0] and served.crop_feats.tolist() == [5.0]  # what the cache gives is used


def test_crop_embeddings_are_the_localizers_exemplar_embeddings(bundle, data):
    loc = Localizer(bundle, "cpu")
    crops = exemplar_crops(data)
    with torch.no_grad():
        served = loc.embed_crops(crops)
        mine = crop_embeddings(bundle, data)
    assert mine.shape == served.shape and torch.allclose(mine, served.to(mine), atol=1e-4)
    carried = with_features(bundle, data, crops=True)
    assert torch.allclose(crop_embeddings(bundle, carried), mine, atol=1e-4)  # from the carried crop features
    idx = torch.tensor([7, 2])
    assert torch.allclose(crop_embeddings(bundle, data, idx), mine[idx], atol=1e-4)
    assert torch.allclose(crop_embeddings(bundle, carried, idx), mine[idx], atol=1e-4)
    assert not crop_embeddings(bundle, data).requires_grad
    bundle.embedder.requires_grad_(True)
    try:
        assert crop_embeddings(bundle, data, grad=True).requires_grad
        assert crop_embeddings(bundle, carried, grad=True).requires_grad
        assert not crop_embeddings(bundle, data).requires_grad
    finally:
        bundle.embedder.requires_grad_(False)
    # carried crop features are what is embedded (these are not the backbone's)
    odd = with_features(bundle, data, crops=True)
    odd.crop_feats = odd.crop_feats + 0.5
    with torch.no_grad():
        expect = bundle.embedder.embed(odd.crop_feats, odd.crop_boxes[:, None])[:, 0]
    assert torch.allclose(crop_embeddings(bundle, odd), expect, atol=1e-5)
    assert not torch.allclose(expect, mine, atol=1e-3)
    # carried features without their boxes are not used: the crops are embedded again
    half = with_features(bundle, data, crops=True)
    half.crop_feats = torch.zeros_like(half.crop_feats)
    half.crop_boxes = None
    assert torch.allclose(crop_embeddings(bundle, half), mine, atol=1e-4)


def test_the_prototype_is_the_localizers(bundle, data):
    with torch.no_grad():
        served = Localizer(bundle, "cpu").prototype(exemplar_crops(data))
    assert torch.allclose(prototype_of(bundle, data), served, atol=1e-4)
    assert torch.allclose(prototypes_for(bundle, data, cmnist(4, "val", 3, "patch", 1)), served, atol=1e-4)


def test_prototypes_of_several_kinds_each_images_own_and_the_missing_named(bundle):
    ex = LabeledImages.concat([cmnist(4, "train", 2, "patch", 1), cmnist(7, "train", 3, "patch", 1),
                               cmnist(1, "train", 1, "patch", 1)])  # kinds 0, 1, 2: two, three, one exemplars
    emb = crop_embeddings(bundle, ex)
    data = LabeledImages.concat([cmnist(4, "val", 1, "patch", 0), cmnist(7, "val", 1, "patch", 0),
                                 cmnist(1, "val", 2, "patch", 0)])
    data.classes = torch.tensor([2, 0, 1, 2])  # in any order
    protos = prototypes_for(bundle, ex, data)
    means = [emb[:2].mean(0), emb[2:5].mean(0), emb[5:].mean(0)]  # unequal counts: a mean each
    assert protos.shape == (4, emb.shape[1])
    for row, kind in enumerate([2, 0, 1, 2]):
        assert torch.allclose(protos[row], means[kind], atol=1e-5)
    only_01 = LabeledImages.concat([cmnist(4, "train", 2, "patch", 1), cmnist(7, "train", 3, "patch", 1)])
    data.classes = torch.tensor([0, 1, 1, 0])
    assert torch.allclose(prototypes_for(bundle, ex, data)[1], means[1], atol=1e-5)  # more kinds than asked for: fine
    data.classes = torch.tensor([0, 2, 3, 1])
    with pytest.raises(ValueError, match=r"no exemplars of kinds \[2, 3\]"):
        prototypes_for(bundle, only_01, data)
    only_01.classes = None
    with pytest.raises(ValueError, match="needs exemplars labeled with the same kinds"):
        prototypes_for(bundle, only_01, data)
