"""Corrupted MNIST (cMNIST): digits pasted on 84x84 canvases with the four backgrounds of PAPER.md.

Training and validation images come from MNIST's training file only; test images from its test
file only. Every generator is deterministic for its seed.
"""

from __future__ import annotations

import gzip
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from models.data import DATA_DIR_ENV
from models.data import data_dir as qloc_data_dir

CANVAS = 84
DIGIT = 28
MEAN, STD = 0.1307, 0.3081
BACKGROUNDS = ("patch", "clutter", "impulse", "gaussian")
_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


def load_mnist(split: str, data_dir: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray]:
    """MNIST ``split`` ("train" | "test") -> (images ``uint8[N, 28, 28]``, labels ``uint8[N]``), read from
    ``data_dir`` (default: ``mnist`` in the data directory, ``QLOC_DATA_DIR``)."""
    if split not in _FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = Path(data_dir) if data_dir else qloc_data_dir() / "mnist"
    missing = [f for f in _FILES[split] if not (root / f).is_file()]
    if missing:
        raise FileNotFoundError(f"MNIST files {missing} are not in {root}: run from the checkout's root, or set "
                                f"{DATA_DIR_ENV} to the folder holding mnist/")
    return _read_mnist(split, str(root.resolve()))


@lru_cache(maxsize=2)
def _read_mnist(split: str, root_name: str) -> tuple[np.ndarray, np.ndarray]:
    root = Path(root_name)
    img_file, lbl_file = (root / f for f in _FILES[split])
    with gzip.open(img_file, "rb") as f:
        magic, n, rows, cols = struct.unpack(">IIII", f.read(16))
        if magic != 2051:
            raise ValueError(f"{img_file} is not an IDX image file (magic {magic})")
        images = np.frombuffer(f.read(), dtype=np.uint8).reshape(n, rows, cols)
    with gzip.open(lbl_file, "rb") as f:
        magic, n_lbl = struct.unpack(">II", f.read(8))
        if magic != 2049 or n_lbl != n:
            raise ValueError(f"{lbl_file} does not match {img_file}")
        labels = np.frombuffer(f.read(), dtype=np.uint8)
    return images, labels


@dataclass(frozen=True)
class CMnistSpec:
    """What to generate. ``split`` is "train", "val" or "test"; val is a disjoint part of MNIST's train."""

    digit: int
    split: str = "train"
    n: int = 50
    background: str = "patch"
    seed: int = 0
    val_fraction: float = 0.2
    offset: int = 0  # skip this many source digits of the split (disjoint sets of one split)


@dataclass
class CMnistBatch:
    """``images`` float ``[N, 1, 84, 84]`` in [0, 1]; ``boxes`` ``[N, 4]``; ``labels`` long ``[N]``."""

    images: Tensor
    boxes: Tensor
    labels: Tensor

    def __len__(self) -> int:
        return self.images.shape[0]


def _source_indices(labels: np.ndarray, digit: int, split: str, val_fraction: float) -> np.ndarray:
    """Indices of ``digit`` in the MNIST file; "train" and "val" are disjoint, fixed parts of it."""
    idx = np.flatnonzero(labels == digit)
    if split == "test":
        return idx
    n_val = int(len(idx) * val_fraction)
    # Fixed (seed-independent) partition, so no seed can leak a validation digit into training.
    perm = np.random.default_rng(12345 + digit).permutation(len(idx))
    return np.sort(idx[perm[:n_val]]) if split == "val" else np.sort(idx[perm[n_val:]])


def _paste_patches(canvas: np.ndarray, box: tuple[int, int, int, int], rng: np.random.Generator, count: int):
    bx1, by1, bx2, by2 = box
    placed = 0
    while placed < count:
        s = int(rng.integers(19, 56))
        x, y = int(rng.integers(0, CANVAS - s + 1)), int(rng.integers(0, CANVAS - s + 1))
        if x < bx2 and bx1 < x + s and y < by2 and by1 < y + s:
            continue  # overlaps the digit: resample
        canvas[y:y + s, x:x + s] = np.maximum(canvas[y:y + s, x:x + s], rng.integers(50, 220) / 255.0)
        placed += 1


def _clutter(canvas: np.ndarray, pool: np.ndarray, rng: np.random.Generator, count: int = 16):
    occupied = canvas > 0
    placed, tries = 0, 0
    while placed < count and tries < 2000:
        tries += 1
        x, y = int(rng.integers(0, CANVAS - 6 + 1)), int(rng.integers(0, CANVAS - 6 + 1))
        if occupied[y:y + 6, x:x + 6].any():
            continue
        src = pool[int(rng.integers(0, len(pool)))]
        fx, fy = int(rng.integers(0, DIGIT - 6 + 1)), int(rng.integers(0, DIGIT - 6 + 1))
        canvas[y:y + 6, x:x + 6] = src[fy:fy + 6, fx:fx + 6] / 255.0
        occupied[y:y + 6, x:x + 6] = True
        placed += 1


def _corrupt(canvas: np.ndarray, background: str, rng: np.random.Generator, box, pool) -> np.ndarray:
    if background == "patch":
        _paste_patches(canvas, box, rng, 4)
    elif background == "clutter":
        _clutter(canvas, pool, rng)
    elif background == "impulse":
        u = rng.random(canvas.shape)
        canvas = canvas.copy()
        canvas[u < 0.03] = 0.0
        canvas[u > 1 - 0.03] = 1.0
    elif background == "gaussian":
        canvas = np.clip(canvas + rng.normal(0.0, 0.12, canvas.shape), 0.0, 1.0)
    elif background != "none":
        raise ValueError(f"background must be one of {BACKGROUNDS + ('none',)}, got {background!r}")
    return canvas


def generate(spec: CMnistSpec, data_dir: str | None = None) -> CMnistBatch:
    """Generate ``spec.n`` cMNIST images of one digit; deterministic for ``spec.seed``."""
    images, labels = load_mnist("test" if spec.split == "test" else "train", data_dir)
    idx = _source_indices(labels, spec.digit, spec.split, spec.val_fraction)
    bg_key = BACKGROUNDS.index(spec.background) if spec.background in BACKGROUNDS else 9
    rng = np.random.default_rng([spec.seed, spec.digit, bg_key, {"train": 0, "val": 1, "test": 2}[spec.split]])
    order = rng.permutation(len(idx))[spec.offset:spec.offset + spec.n]
    if len(order) < spec.n:
        raise ValueError(f"only {len(idx) - spec.offset} digit-{spec.digit} images in the {spec.split} split")
    chosen = idx[order]
    pool = images[np.flatnonzero(labels != spec.digit)[:5000]]
    out = np.zeros((spec.n, CANVAS, CANVAS), dtype=np.float32)
    boxes = np.zeros((spec.n, 4), dtype=np.float32)
    for i, src in enumerate(chosen):  # data generation, not a hot path
        canvas = np.zeros((CANVAS, CANVAS), dtype=np.float64)
        x, y = int(rng.integers(0, CANVAS - DIGIT + 1)), int(rng.integers(0, CANVAS - DIGIT + 1))
        canvas[y:y + DIGIT, x:x + DIGIT] = images[src] / 255.0
        box = (x, y, x + DIGIT, y + DIGIT)
        out[i] = _corrupt(canvas, spec.background, rng, box, pool)
        boxes[i] = box
    return CMnistBatch(torch.from_numpy(out)[:, None], torch.from_numpy(boxes),
                       torch.full((spec.n,), spec.digit, dtype=torch.long))


def generate_pair(digits: tuple[int, int], split: str = "train", n: int = 50, seed: int = 0,
                  data_dir: str | None = None) -> tuple[CMnistBatch, CMnistBatch]:
    """Selective variant: two digits on one canvas, non-overlapping, 3 gray patches.

    Returns the same images twice, with the boxes (and labels) of ``digits[0]`` and of ``digits[1]``.
    """
    images, labels = load_mnist("test" if split == "test" else "train", data_dir)
    rng = np.random.default_rng([seed, digits[0], digits[1], 7, {"train": 0, "val": 1, "test": 2}[split]])
    srcs = []
    for d in digits:
        idx = _source_indices(labels, d, split, 0.2)
        srcs.append(idx[rng.permutation(len(idx))[:n]])
    out = np.zeros((n, CANVAS, CANVAS), dtype=np.float32)
    boxes = np.zeros((2, n, 4), dtype=np.float32)
    for i in range(n):
        canvas = np.zeros((CANVAS, CANVAS), dtype=np.float64)
        ax, ay = (int(v) for v in rng.integers(0, CANVAS - DIGIT + 1, 2))
        while True:
            bx, by = (int(v) for v in rng.integers(0, CANVAS - DIGIT + 1, 2))
            if abs(ax - bx) >= DIGIT or abs(ay - by) >= DIGIT:
                break
        canvas[ay:ay + DIGIT, ax:ax + DIGIT] = images[srcs[0][i]] / 255.0
        canvas[by:by + DIGIT, bx:bx + DIGIT] = np.maximum(canvas[by:by + DIGIT, bx:bx + DIGIT],
                                                         images[srcs[1][i]] / 255.0)
        boxes[0, i] = (ax, ay, ax + DIGIT, ay + DIGIT)
        boxes[1, i] = (bx, by, bx + DIGIT, by + DIGIT)
        # Patches avoid both digits: paste them against the union of the two boxes.
        _paste_patches_multi(canvas, [tuple(boxes[0, i]), tuple(boxes[1, i])], rng, 3)
        out[i] = canvas
    t = torch.from_numpy(out)[:, None]
    return tuple(CMnistBatch(t, torch.from_numpy(boxes[k]), torch.full((n,), digits[k], dtype=torch.long))
                 for k in range(2))


def _paste_patches_multi(canvas, boxes, rng, count):
    placed = 0
    while placed < count:
        s = int(rng.integers(19, 56))
        x, y = int(rng.integers(0, CANVAS - s + 1)), int(rng.integers(0, CANVAS - s + 1))
        if any(x < b[2] and b[0] < x + s and y < b[3] and b[1] < y + s for b in boxes):
            continue
        canvas[y:y + s, x:x + s] = rng.integers(50, 220) / 255.0
        placed += 1

