"""cMNIST generation checked against MNIST itself: which file and which part of it each split draws from, each
background's corruption by its own rule (gray patches off the digit, clutter cut from other digits around the
digit's ink, impulse and gaussian noise at their rates), the selective two-digit images, and the refusals. What the
benchmarks and the shipped bundles are measured on, so a split that leaks or a background that drifts shows here."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from models.data.cmnist import CMnistSpec, _source_indices, generate, generate_pair, load_mnist

TRAIN = load_mnist("train")
TEST = load_mnist("test")


def digit_crops(batch) -> np.ndarray:
    """``[N, 28, 28]`` uint8: the digit inside each box, back in MNIST's 0..255."""
    return np.stack([np.rint(img[0, b[1]:b[3], b[0]:b[2]].numpy() * 255).astype(np.uint8)
                     for img, b in zip(batch.images, batch.boxes.long(), strict=True)])


def background(images: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """The pixels of ``images [N, 1, S, S]`` outside each image's box, flattened."""
    out = images.clone()
    for img, b in zip(out, boxes.long(), strict=True):
        img[0, b[1]:b[3], b[0]:b[2]] = float("nan")
    return out[~torch.isnan(out)]


def source_of(crop: np.ndarray, images: np.ndarray, candidates: np.ndarray) -> int | None:
    """The index among ``candidates`` of the MNIST image ``crop`` is, or None."""
    hits = candidates[(images[candidates] == crop).all(axis=(1, 2))]
    return int(hits[0]) if len(hits) else None


def test_splits_partition_the_files_fixed_parts_and_val_is_its_fraction():
    _, y = TRAIN
    _, yt = TEST
    for d in (0, 7):
        tr, va, te = (_source_indices(y if s != "test" else yt, d, s, 0.2) for s in ("train", "val", "test"))
        assert len(va) == int((y == d).sum() * 0.2) and len(tr) == (y == d).sum() - len(va)
        assert np.array_equal(te, np.flatnonzero(yt == d))  # test: every one of the test file's
        assert np.array_equal(np.sort(np.concatenate([tr, va])), np.flatnonzero(y == d))
        assert np.all(np.diff(tr) > 0) and np.all(np.diff(va) > 0)
        assert len(_source_indices(y, d, "val", 0.5)) == int((y == d).sum() * 0.5)
    # the partition is fixed per digit, not drawn from any seed
    assert np.array_equal(_source_indices(y, 3, "val", 0.2), _source_indices(y, 3, "val", 0.2))
    assert not np.array_equal(_source_indices(y, 3, "val", 0.2)[:50], np.flatnonzero(y == 3)[:50])


@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_each_split_draws_its_digits_from_its_own_part_of_mnist(split):
    images, labels = TEST if split == "test" else TRAIN
    batch = generate(CMnistSpec(5, split, 12, "none", seed=2))
    allowed = _source_indices(labels, 5, split, 0.2)
    sources = [source_of(c, images, allowed) for c in digit_crops(batch)]
    assert None not in sources and len(set(sources)) == 12  # 12 different digits, all of this split
    assert batch.labels.tolist() == [5] * 12 and batch.labels.dtype == torch.long and len(batch) == 12
    outside = batch.images.clone()
    for img, b in zip(outside, batch.boxes.long(), strict=True):
        img[0, b[1]:b[3], b[0]:b[2]] = 0
    assert float(outside.abs().max()) == 0  # "none": the digit alone


def test_splits_seeds_and_backgrounds_draw_apart():
    base = generate(CMnistSpec(4, "train", 6, "patch", seed=0))
    for other in (CMnistSpec(4, "val", 6, "patch", seed=0), CMnistSpec(4, "train", 6, "patch", seed=1),
                  CMnistSpec(4, "train", 6, "clutter", seed=0)):
        assert not torch.equal(base.boxes, generate(other).boxes)


def test_mnist_has_two_files_and_other_splits_are_refused_by_name():
    with pytest.raises(ValueError, match="^split must be 'train' or 'test', got 'val'$"):
        load_mnist("val")  # val is a part of the train file: generate's split, not a file


def test_an_offset_past_the_split_is_refused_by_name():
    n = int((TRAIN[1] == 9).sum() * 0.2)
    generate(CMnistSpec(9, "val", 1, "none", offset=n - 1))  # the last one is still there
    with pytest.raises(ValueError, match="^only 0 digit-9 images in the val split$"):
        generate(CMnistSpec(9, "val", 1, "none", offset=n))
    with pytest.raises(ValueError, match="background must be one of .*'none'.*got 'fog'"):
        generate(CMnistSpec(9, "val", 1, "fog"))


def test_patches_are_four_gray_squares_off_the_digit():
    batch = generate(CMnistSpec(2, "train", 10, "patch", seed=3))
    for img, b in zip(batch.images[:, 0].numpy(), batch.boxes.long(), strict=True):
        out = img.copy()
        out[b[1]:b[3], b[0]:b[2]] = 0
        vals = np.unique(out[out > 0])
        assert 1 <= len(vals) <= 4 and vals.min() >= 50 / 255 - 1e-6 and vals.max() <= 219 / 255 + 1e-6
        covered = (out > 0).sum()
        assert 19 * 19 <= covered <= 4 * 55 * 55


def test_clutter_is_6_pixel_pieces_around_the_digits_ink_which_stays_as_it_was():
    batch = generate(CMnistSpec(6, "train", 8, "clutter", seed=4))
    x, y = TRAIN
    sixes = x[_source_indices(y, 6, "train", 0.2)]  # [K, 28, 28]
    ink = sixes > 0
    for crop in digit_crops(batch):
        same_ink = ((sixes == crop[None]) | ~ink).all(axis=(1, 2))
        assert same_ink.any()  # the digit's ink is an MNIST 6's, untouched; pieces only where it has none
    for i in range(len(batch)):
        bg = background(batch.images[i:i + 1], batch.boxes[i:i + 1])
        assert 0 < int((bg > 0).sum()) <= 16 * 36  # at most 16 pieces of 6 x 6
    none = generate(CMnistSpec(6, "train", 8, "none", seed=4))
    assert not torch.equal(none.images, batch.images)


def test_impulse_and_gaussian_noise_at_their_rates():
    imp = generate(CMnistSpec(1, "train", 20, "impulse", seed=5))
    bg = background(imp.images, imp.boxes)
    assert 0.025 < float((bg == 1.0).float().mean()) < 0.035  # 3 % salt on the background
    assert float(((bg != 0) & (bg != 1)).float().sum()) == 0  # and nothing else there
    gau = generate(CMnistSpec(1, "train", 20, "gaussian", seed=5))
    bg = background(gau.images, gau.boxes)
    assert 0.04 < float(bg.mean()) < 0.06  # N(0, 0.12) clipped at 0: mean 0.12 / sqrt(2 pi) = 0.048
    assert 0.06 < float(bg.std()) < 0.08 and float((bg == 0).float().mean()) > 0.45  # half clipped to 0


def test_two_digit_images_hold_both_digits_of_their_split_apart_and_three_patches_off_both():
    first, second = generate_pair((3, 8), "test", n=8, seed=1)
    images, labels = TEST
    for batch, d in ((first, 3), (second, 8)):
        allowed = _source_indices(labels, d, "test", 0.2)
        assert all(source_of(c, images, allowed) is not None for c in digit_crops(batch))
    for img, a, b in zip(first.images[:, 0].numpy(), first.boxes.long(), second.boxes.long(), strict=True):
        assert abs(int(a[0] - b[0])) >= 28 or abs(int(a[1] - b[1])) >= 28  # apart
        out = img.copy()
        out[a[1]:a[3], a[0]:a[2]] = 0
        out[b[1]:b[3], b[0]:b[2]] = 0
        assert 1 <= len(np.unique(out[out > 0])) <= 3
    assert not torch.equal(first.boxes, generate_pair((3, 8), "val", n=8, seed=1)[0].boxes)


def digest(*arrays) -> str:  # type: ignore[no-untyped-def]
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a.numpy()).tobytes())
    return h.hexdigest()[:16]


def test_the_generated_images_are_the_ones_every_cmnist_number_was_measured_on():
    """Every cMNIST figure in BENCHMARKS.md and every shipped grayscale bundle's training came from these generators
    (unchanged since 2026-11-26): a change to what they draw (a range, a seed's parts, a constant, numpy's streams)
    changes the benchmarks' data, so it shows here. A deliberate change re-runs the benchmarks and updates these."""
    cases = {
        "patch": CMnistSpec(4, "train", 64, "patch", seed=0), "clutter": CMnistSpec(4, "train", 6, "clutter", seed=1),
        "impulse": CMnistSpec(3, "val", 6, "impulse", seed=2), "gaussian": CMnistSpec(2, "test", 6, "gaussian", seed=3),
        "none": CMnistSpec(7, "test", 6, "none", seed=4, offset=10)}
    got = {name: digest(b.images, b.boxes) for name, b in ((k, generate(s)) for k, s in cases.items())}
    first, second = generate_pair((4, 9), "test", n=64, seed=0)
    got["pair"] = digest(first.images, first.boxes, second.boxes)
    assert got == {"patch": "bf2c39245b9a8ac6", "clutter": "f71c4386f665fbd9", "impulse": "035e320290393ef7",
                   "gaussian": "c41d353bb3368637", "none": "6dfe670790cd88c6", "pair": "07eb46f06d3f8cb6"}


def test_two_digit_images_default_to_fifty_of_seed_0_as_float32_in_0_1():
    first, second = generate_pair((1, 7))
    again, _ = generate_pair((1, 7), "train", n=50, seed=0)
    assert len(first) == 50 and torch.equal(first.images, again.images)
    for batch, d in ((first, 1), (second, 7)):
        assert batch.images.dtype == torch.float32 and batch.boxes.dtype == torch.float32
        assert batch.labels.dtype == torch.long and batch.labels.tolist() == [d] * 50
        assert batch.images.shape == (50, 1, 84, 84)
    assert float(first.images.min()) >= 0 and float(first.images.max()) == 1.0  # MNIST's ink reaches 255


def test_two_digit_images_draw_each_digit_from_the_splits_part_and_place_them_over_the_whole_canvas():
    x, y = TRAIN
    first, second = generate_pair((0, 6), "val", n=300, seed=2)
    for batch, d in ((first, 0), (second, 6)):
        allowed = _source_indices(y, d, "val", 0.2)
        sources = [source_of(c, x, allowed) for c in digit_crops(batch)[:20]]
        assert None not in sources and len(set(sources)) == 20
        corners = batch.boxes[:, :2]
        assert float(corners.min()) == 0 and float(corners.max()) == 84 - 28  # every position, both edges
    a, b = first.boxes, second.boxes
    dx, dy = (a[:, 0] - b[:, 0]).abs(), (a[:, 1] - b[:, 1]).abs()
    assert bool(((dx >= 28) | (dy >= 28)).all())  # apart: no overlap
    assert bool(((dx < 28) | (dy < 28)).any())  # ... on one axis only is enough: side by side, or one above the other
    for other in (generate_pair((0, 6), "train", n=300, seed=2), generate_pair((0, 6), "test", n=300, seed=2),
                  generate_pair((6, 0), "val", n=300, seed=2)[::-1]):  # each split, and the digits' order, apart
        assert not torch.equal(first.boxes, other[0].boxes) and not torch.equal(second.boxes, other[1].boxes)


def test_the_data_directory_given_is_read_before_the_environments(tmp_path, monkeypatch):
    from models.data import DATA_DIR_ENV

    repo = Path(__file__).resolve().parents[2] / "data" / "mnist"
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))  # holds no MNIST
    assert len(generate(CMnistSpec(2, "test", 3, "none"), data_dir=str(repo))) == 3
    assert len(generate_pair((2, 5), "test", n=3, data_dir=str(repo))[0]) == 3
    with pytest.raises(FileNotFoundError):
        generate_pair((2, 5), "test", n=3)


class CountingRng:
    """A numpy ``Generator`` that counts its ``integers`` draws."""

    def __init__(self, seed: int) -> None:
        self.rng, self.draws = np.random.default_rng(seed), 0

    def integers(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.draws += 1
        return self.rng.integers(*args, **kwargs)


def test_clutter_gives_up_on_a_canvas_with_no_room_after_2000_tries():
    """Every 6x6 spot holds ink: no piece fits, and the search ends after its budget (two position draws a try)."""
    from models.data.cmnist import _clutter

    canvas = np.ones((84, 84))
    rng = CountingRng(0)
    _clutter(canvas, TRAIN[0][:10], rng)  # type: ignore[arg-type]
    assert rng.draws == 2 * 2000 and float(canvas.min()) == 1.0
    half = np.ones((84, 84))
    half[:, :6] = 0  # room for pieces in one column only: they fill it, then the tries run out
    _clutter(half, TRAIN[0][:10], CountingRng(1))  # type: ignore[arg-type]
    assert 0 < int((half[:, :6] > 0).sum()) <= 14 * 36
