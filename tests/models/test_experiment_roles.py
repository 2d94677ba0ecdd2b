"""Which images each role of an experiment draws (``models.experiments.datasets``), by value, for every kind: the data
discipline every benchmark number rests on. Exemplars and unlabeled images are disjoint slices of one train draw
(seed + 1000), validation exemplars follow the validation images in their draw, and test images come from the test
split alone, with the run's seed; no role reads another's split. The draws themselves are spied (the generators are
pinned by their own tests), so a role wired to the wrong split, seed or slice shows here by name."""

from __future__ import annotations

import pytest
import torch

from models.bundle import new_bundle
from models.data.types import LabeledImages
from models.experiments import datasets
from models.experiments.datasets import ROLES, CMnistDigitsKind, CMnistKind, GlyphKind, PhotoKind
from models.presets import mnist_config

# role -> (split, seed offset, whether ``after`` is the slice's start)
CANVAS_ROLES = {"train": ("train", 0, False), "val": ("val", 0, False), "val_exemplars": ("val", 0, True),
                "exemplars": ("train", 1000, False), "unlabeled": ("train", 1000, True), "test": ("test", 0, False)}


@pytest.fixture(scope="module")
def bundle():  # type: ignore[no-untyped-def]
    return new_bundle("roles", mnist_config(), 0)


def tiny(n: int) -> LabeledImages:
    return LabeledImages(torch.zeros(n, 1, 84, 84), torch.zeros(n, 4))


@pytest.mark.parametrize("kind", [CMnistKind(7, "clutter"), GlyphKind("&", "impulse"), CMnistDigitsKind((2, 5))],
                         ids=["cmnist", "glyphs", "digits"])
def test_each_canvas_role_draws_its_split_seed_and_slice(kind, bundle, monkeypatch):
    calls: list[tuple] = []

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((args, kwargs))
        return tiny(args[2])

    monkeypatch.setattr(datasets, "cmnist", spy)
    monkeypatch.setattr(datasets, "glyphs", spy)
    for role, (split, plus, sliced) in CANVAS_ROLES.items():
        calls.clear()
        out = kind.draw(bundle, role, 3, seed=11, after=4)
        want_offset = 4 if sliced else 0
        if isinstance(kind, CMnistDigitsKind):
            assert [c[0] for c in calls] == [(d, split, 3, kind.background, 11 + plus) for d in (2, 5)], role
            assert len(out) == 6
        else:
            first = kind.digit if isinstance(kind, CMnistKind) else kind.char
            assert [c[0] for c in calls] == [(first, split, 3, kind.background, 11 + plus)], role
        assert all(c[1] == {"offset": want_offset} for c in calls), role
    with pytest.raises(ValueError, match=r"^role must be one of \('train', 'val', 'val_exemplars', 'exemplars', "
                                         r"'unlabeled', 'test'\), got 'holdout'$"):
        kind.draw(bundle, "holdout", 1, seed=0)


def test_each_photo_role_draws_its_split_and_own_seed_and_carries_crops_where_a_prototype_needs_them(bundle,
                                                                                                      monkeypatch):
    sets: list[tuple] = []
    gens: list[tuple] = []

    def photo_set(bundle_, manifest, class_name, split, n, seed, crops=False):  # type: ignore[no-untyped-def]
        sets.append((class_name, split, n, seed, crops))
        return tiny(n)

    def generate(manifest, class_name, split, n, seed, size):  # type: ignore[no-untyped-def]
        gens.append((class_name, split, n, seed, size))
        return tiny(n)

    monkeypatch.setattr(datasets, "photo_set", photo_set)
    monkeypatch.setattr(datasets, "generate", generate)
    kind = PhotoKind("birds", manifest={"objects": {}})
    want = {"train": ("train", 7, True), "val": ("val", 7, False), "val_exemplars": ("val", 507, True),
            "exemplars": ("train", 1007, True), "test": ("test", 7, False)}
    for role, (split, seed, crops) in want.items():
        sets.clear()
        kind.draw(bundle, role, 3, seed=7, after=4)
        assert sets == [("birds", split, 3, seed, crops)], role
    out = kind.draw(bundle, "unlabeled", 5, seed=7, after=4)
    assert gens == [("birds", "train", 5, 2007, bundle.config.input.size)]  # its own draw: no features, no crops
    assert isinstance(out, LabeledImages) and len(out) == 5
    assert set(want) | {"unlabeled"} == set(ROLES)


def test_each_kind_records_what_it_is_and_trains_with_its_recipe(bundle, monkeypatch):
    """What results and provenance record of a kind (``meta``), the training sizes and the stage-1 selection rule:
    the recipes the shipped bundles were trained with (BENCHMARKS.md)."""
    one, glyph, general = CMnistKind(7, "clutter"), GlyphKind("&", "impulse"), CMnistDigitsKind()
    assert one.meta() == {"digit": 7, "background": "clutter"} and glyph.meta() == {"glyph": "&",
                                                                                   "background": "impulse"}
    assert general.digits == tuple(range(10))  # all ten: the served default's recipe
    assert general.meta() == {"digits": list(range(10)), "background": "patch"}
    assert one.sizes() == glyph.sizes() == {"n_train": 50, "n_val": 200, "exemplars": 5}
    assert general.sizes() == {"n_train": 50, "n_val": 20, "exemplars": 5}  # per digit
    assert not one.select_with_exemplars() and not glyph.select_with_exemplars()  # group prototypes
    assert general.select_with_exemplars()  # one prototype per digit: mixed groups would not order boxes
    emb, emb_one = general.embedding_config(), one.embedding_config()
    assert (emb.epochs, emb.eval_every) == (30, 5) and (emb_one.epochs, emb_one.eval_every) == (100, 20)
    photo = PhotoKind("birds")
    assert photo.meta() == {"class": "birds"} and photo.select_with_exemplars()
    assert photo.sizes() == {"n_train": 160, "n_val": 64, "exemplars": 5}
    assert photo.embedding_config().anchor == photo.setup.anchor == "shuffle_exemplar"

    seen: list[int] = []
    monkeypatch.setattr(datasets, "cmnist", lambda *a, **k: seen.append(k["offset"]) or tiny(a[2]))
    one.draw(bundle, "unlabeled", 2, seed=0)
    assert seen == [0]  # no earlier role: the slice starts at the draw's first image
    boxes = torch.arange(8.0).reshape(2, 4)
    monkeypatch.setattr(datasets, "generate", lambda *a, **k: LabeledImages(torch.zeros(2, 3, 8, 8), boxes))
    assert torch.equal(photo.draw(bundle, "unlabeled", 2, seed=0).boxes, boxes)  # kept for evaluation
