"""Data of several kinds (a general bundle): batches of one kind, each image anchored on its own kind's
exemplars, and the trainers running on such data."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from models.bundle import load_bundle
from models.data.types import LabeledImages
from models.evaluate import localize_boxes, ranking_metrics
from models.experiments.cmnist import cmnist
from models.experiments.photos import class_names
from models.features import prototype_of, prototypes_for
from models.train.agent import AgentTrainConfig, train_agent
from models.train.embedding import EmbeddingTrainConfig, train_embedding

BUNDLE = Path(__file__).resolve().parents[2] / "bundles" / "mnist-digit4.pt"


@pytest.fixture(scope="module")
def bundle():
    return load_bundle(BUNDLE, "cpu")


def test_concat_labels_each_part_and_subset_keeps_the_labels():
    a, b = cmnist(4, "train", 3, "patch", 0), cmnist(7, "train", 2, "patch", 0)
    both = LabeledImages.concat([a, b])
    assert both.classes.tolist() == [0, 0, 0, 1, 1] and torch.equal(both.images[3:], b.images)
    assert both.subset(torch.tensor([4, 0])).classes.tolist() == [1, 0]
    assert class_names("mammals, birds") == ["mammals", "birds"] and class_names("fish") == ["fish"]
    with pytest.raises(ValueError):
        class_names(" , ")


def test_each_image_gets_its_own_kinds_prototype(bundle):
    ex4, ex7 = cmnist(4, "train", 5, "patch", 1), cmnist(7, "train", 5, "patch", 1)
    data = LabeledImages.concat([cmnist(4, "val", 3, "patch", 0), cmnist(7, "val", 2, "patch", 0)])
    with torch.no_grad():
        protos = prototypes_for(bundle, LabeledImages.concat([ex4, ex7]), data)
        p4, p7 = prototype_of(bundle, ex4), prototype_of(bundle, ex7)
    assert protos.shape == (5, p4.shape[0])
    assert torch.allclose(protos[:3], p4.expand(3, -1), atol=1e-5) and torch.allclose(protos[3:], p7.expand(2, -1),
                                                                                    atol=1e-5)
    one_kind = cmnist(4, "val", 3, "patch", 0)
    with torch.no_grad():
        assert torch.allclose(prototypes_for(bundle, ex4, one_kind), p4, atol=1e-6)  # one kind: [D], as before
    with pytest.raises(ValueError, match="exemplars labeled"):
        prototypes_for(bundle, ex4, data)


def test_per_image_prototypes_give_the_shared_prototypes_result(bundle):
    data = cmnist(4, "val", 6, "patch", 0)
    with torch.no_grad():
        p = prototype_of(bundle, cmnist(4, "train", 5, "patch", 1))
        shared = ranking_metrics(bundle, data, p, seed=0)
        each = ranking_metrics(bundle, data, p.expand(len(data), -1), seed=0)
        agent = bundle.new_agent()
        paths = localize_boxes(bundle, agent, data, p)
        paths_each = localize_boxes(bundle, agent, data, p.expand(len(data), -1), batch=4)  # chunked with the data
    assert shared == pytest.approx(each, abs=1e-4)
    assert torch.allclose(paths, paths_each, atol=1e-3)


def test_the_trainers_run_on_several_kinds(bundle):
    b = copy.deepcopy(bundle)
    train = LabeledImages.concat([cmnist(4, "train", 10, "patch", 2), cmnist(7, "train", 10, "patch", 2)])
    val = LabeledImages.concat([cmnist(4, "val", 4, "patch", 2), cmnist(7, "val", 4, "patch", 2)])
    val_ex = LabeledImages.concat([cmnist(4, "val", 5, "patch", 3, offset=10), cmnist(7, "val", 5, "patch", 3,
                                                                                         offset=10)])
    s1 = train_embedding(b, train, val, EmbeddingTrainConfig(epochs=1, batch_size=10, drop_last=True,
                                                             anchor="shuffle_exemplar", recon_weight=0.0,
                                                             head_only=True, eval_every=1), val_exemplars=val_ex)
    assert 0.0 <= s1["val/ordacc"] <= 100.0
    s2 = train_agent(b, train, val, val_ex, AgentTrainConfig(iterations=2, eval_every=1, batch_size=10))
    assert 0.0 <= s2["val/corloc"] <= 100.0 and b.agent_state is not None


def test_the_cross_kind_term_uses_another_kinds_prototype_and_only_on_several_kinds(bundle):
    from models.features import crop_embeddings
    from models.train.embedding import _other_kind_prototype

    data = LabeledImages.concat([cmnist(4, "train", 10, "patch", 2), cmnist(7, "train", 10, "patch", 2)])
    with torch.no_grad():
        other = _other_kind_prototype(bundle, data, 0, 10, torch.Generator().manual_seed(0))
        assert torch.allclose(other, crop_embeddings(bundle, data, torch.arange(10, 20)).mean(0), atol=1e-4)

    def trained(train: LabeledImages, weight: float) -> dict:
        b = copy.deepcopy(bundle)
        cfg = EmbeddingTrainConfig(epochs=1, batch_size=10, drop_last=True, anchor="shuffle_exemplar",
                                   recon_weight=0.0, head_only=True, eval_every=1, class_weight=weight)
        train_embedding(b, train, train, cfg)
        return b.embedder.head.state_dict()

    one_kind = cmnist(4, "train", 20, "patch", 2)
    assert all(torch.equal(a, b) for a, b in zip(trained(one_kind, 0.0).values(), trained(one_kind, 5.0).values(),
                                                   strict=True))  # one kind: nothing to tell apart, term off
    assert not all(torch.equal(a, b) for a, b in zip(trained(data, 0.0).values(), trained(data, 5.0).values(),
                                                       strict=True))
