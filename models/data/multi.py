"""Several instances per image (issue 13): 1-4 copies of the query object plus distractors of other kinds.

- ``cmnist_multi``: 84x84 cMNIST canvases with ``min_instances..max_instances`` MNIST digits of the query
  and ``distractors`` digits of other classes (28x28 frames, as in ``models.data.cmnist``), then the
  background's corruption (gray patches by default, pasted around every digit).
- ``photos_multi``: the cut-and-paste photos of ``models.data.photos`` with several cut-outs of the query
  class and distractor cut-outs of other classes on one background crop.

**Overlap rule.** Objects are placed one after another, each at a position drawn uniformly among the
whole-pixel positions where it overlaps no placed object by more than ``max_overlap`` pixels on *both* axes
(so boxes may touch, or share a strip at most ``max_overlap`` px thick: two 28x28 frames sharing a 4-px
strip have an IoU of 0.08). cMNIST's default of 4 px only lets the frames' empty margins meet (MNIST centres
each digit in a 20x20 box of its 28x28 frame); strokes that meet are merged with ``max``. On photos the rule
holds for the cut-outs' rectangles, which contain their (ground-truth) alpha boxes. A layout with no room
left for its next object is started again, up to ``LAYOUT_TRIES`` times (an 84x84 canvas holds at most 9
disjoint 28x28 frames; 4 instances + 3 distractors at 4 px fit in about one layout in ten).

Ground-truth boxes are ``[k_i, 4]`` float tensors ``(x1, y1, x2, y2)`` in input pixels, one per image (and
the same for the distractors). Sources are those of the single-object generators: MNIST's train file
(disjoint fixed train / val parts) or test file; the photo splits by source file. Deterministic per seed.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from models.data.cmnist import BACKGROUNDS, CANVAS, DIGIT, _corrupt, _source_indices, load_mnist
from models.data.photos import (
    ALPHA_THRESHOLD,
    SPLITS,
    PasteParams,
    _background_crop,
    _load_background,
    _load_object,
    _object_cutout,
    load_manifest,
    mask_box,
    split_files,
)

PLACE_TRIES = 200
"""Positions drawn for one gray patch before it is skipped."""
LAYOUT_TRIES = 1000
"""Layouts tried for one image before the generator raises (the objects asked for do not fit)."""
PATCHES = 4
"""Gray patches per cMNIST canvas ("patch" background), as many as fit around the digits."""


@dataclass
class MultiBatch:
    """Images with every instance of the query and the distractors.

    ``images`` float ``[N, C, S, S]`` in [0, 1]; ``boxes`` N tensors ``[k_i, 4]`` (the query's instances,
    ``k_i >= 1``); ``distractor_boxes`` N tensors ``[m_i, 4]`` and ``distractor_labels`` N long tensors
    ``[m_i]`` (the digit; for photos the index of the class in the manifest's ``objects``, i.e. ``CLASSES``' order).
    ``query`` is the digit or class name asked for.
    """

    images: Tensor
    boxes: list[Tensor]
    distractor_boxes: list[Tensor]
    distractor_labels: list[Tensor]
    query: int | str

    def __len__(self) -> int:
        return self.images.shape[0]

    @property
    def counts(self) -> Tensor:
        """Instances of the query per image -> long ``[N]``."""
        return torch.tensor([len(b) for b in self.boxes], dtype=torch.long)


def _conflicts(x: int, y: int, w: int, h: int, placed: list[tuple[int, int, int, int]], max_overlap: int) -> bool:
    """Whether the box ``(x, y, x + w, y + h)`` overlaps a ``placed`` box by more than ``max_overlap`` px on
    both axes (the overlap rule)."""
    for px1, py1, px2, py2 in placed:
        iw = min(x + w, px2) - max(x, px1)
        ih = min(y + h, py2) - max(y, py1)
        if iw > max_overlap and ih > max_overlap:
            return True
    return False


def place(sizes: list[tuple[int, int]], canvas: int, max_overlap: int, rng: np.random.Generator
          ) -> list[tuple[int, int, int, int]]:
    """Positions for objects of ``sizes`` ``(w, h)`` on a ``canvas x canvas`` image, fully inside and
    overlapping one another by at most ``max_overlap`` px on one axis (the module's overlap rule) -> boxes
    ``(x1, y1, x2, y2)`` in the order of ``sizes``.

    Each object's top-left corner is drawn uniformly among the whole-pixel positions still allowed by the
    objects placed before it; when none is left the layout starts again (up to ``LAYOUT_TRIES`` times, then
    ``RuntimeError``). Seven 28x28 frames on 84x84 (4-px overlap) fit in about one layout in ten.
    """
    for _ in range(LAYOUT_TRIES):
        placed: list[tuple[int, int, int, int]] = []
        for w, h in sizes:
            if w > canvas or h > canvas:
                raise ValueError(f"an object of {w}x{h} px does not fit on a {canvas}x{canvas} canvas")
            free = np.ones((canvas - h + 1, canvas - w + 1), dtype=bool)  # [y, x] top-left corners
            for px1, py1, px2, py2 in placed:  # corners whose box would overlap this one by > max_overlap on both axes
                free[max(0, py1 + max_overlap - h + 1):max(0, py2 - max_overlap),
                     max(0, px1 + max_overlap - w + 1):max(0, px2 - max_overlap)] = False
            ys, xs = np.nonzero(free)
            if len(ys) == 0:
                break  # no room left for this object: start the layout again
            j = int(rng.integers(len(ys)))
            x, y = int(xs[j]), int(ys[j])
            placed.append((x, y, x + w, y + h))
        if len(placed) == len(sizes):
            return placed
    raise RuntimeError(f"{len(sizes)} objects of sizes {sizes} did not fit on a {canvas}x{canvas} canvas with at most "
                       f"{max_overlap} px of overlap in {LAYOUT_TRIES} layouts: ask for fewer or smaller objects")


def _counts(rng: np.random.Generator, min_instances: int, max_instances: int, distractors: tuple[int, int]
            ) -> tuple[int, int]:
    return int(rng.integers(min_instances, max_instances + 1)), int(rng.integers(distractors[0], distractors[1] + 1))


def _check_counts(min_instances: int, max_instances: int, distractors: tuple[int, int]) -> None:
    if not 1 <= min_instances <= max_instances:
        raise ValueError(f"need 1 <= min_instances <= max_instances, got {min_instances}, {max_instances}")
    if not 0 <= distractors[0] <= distractors[1]:
        raise ValueError(f"distractors must be (min, max) with 0 <= min <= max, got {distractors}")


def _paste_patches_around(canvas: np.ndarray, boxes: list[tuple[int, int, int, int]], rng: np.random.Generator,
                          count: int) -> int:
    """cMNIST's gray patches (side 19-55, gray 50-220) where they miss every box; a patch that finds no room in
    ``PLACE_TRIES`` draws is skipped (a crowded canvas gets fewer) -> patches pasted."""
    pasted = 0
    for _ in range(count):
        for _ in range(PLACE_TRIES):
            s = int(rng.integers(19, 56))
            x, y = int(rng.integers(0, CANVAS - s + 1)), int(rng.integers(0, CANVAS - s + 1))
            if not _conflicts(x, y, s, s, boxes, 0):
                canvas[y:y + s, x:x + s] = rng.integers(50, 220) / 255.0
                pasted += 1
                break
    return pasted


def cmnist_multi(digit: int, split: str = "test", n: int = 50, seed: int = 0, background: str = "patch",
                 min_instances: int = 1, max_instances: int = 4, distractors: tuple[int, int] = (0, 3),
                 max_overlap: int = 4, val_fraction: float = 0.2, data_dir: str | None = None) -> MultiBatch:
    """``n`` cMNIST canvases ``[n, 1, 84, 84]``, each with ``k ~ U{min_instances..max_instances}`` distinct
    MNIST images of ``digit`` and ``m ~ U{distractors}`` of other digits (each digit drawn uniformly from the
    nine others), placed by the overlap rule (``max_overlap`` px), then ``background`` (``"patch"``: up to
    ``PATCHES`` gray patches around every digit; the other cMNIST backgrounds as in ``models.data.cmnist``).

    ``split`` "train" / "val" (disjoint fixed parts of MNIST's train file) or "test" (its test file);
    deterministic for ``(seed, digit, background, split)`` and the counts asked for.
    """
    _check_counts(min_instances, max_instances, distractors)
    if background not in BACKGROUNDS + ("none",):
        raise ValueError(f"background must be one of {BACKGROUNDS + ('none',)}, got {background!r}")
    images, labels = load_mnist("test" if split == "test" else "train", data_dir)
    split_key = {"train": 0, "val": 1, "test": 2}[split]
    sources = {d: _source_indices(labels, d, split, val_fraction) for d in range(10)}
    others = np.array([d for d in range(10) if d != digit])
    bg_key = BACKGROUNDS.index(background) if background in BACKGROUNDS else 9
    rng = np.random.default_rng([seed, digit, bg_key, split_key, 13])
    pool = images[np.flatnonzero(labels != digit)[:5000]]  # cMNIST's clutter fragments
    out = np.zeros((n, CANVAS, CANVAS), dtype=np.float32)
    inst, dist, dist_lbl = [], [], []
    for i in range(n):  # data generation, not a hot path
        k, m = _counts(rng, min_instances, max_instances, distractors)
        kinds = np.concatenate([np.full(k, digit), rng.choice(others, m)])  # [k + m]
        srcs = [rng.choice(sources[digit], k, replace=False)]
        srcs += [rng.choice(sources[int(d)], 1) for d in kinds[k:]]
        srcs = np.concatenate(srcs)
        boxes = place([(DIGIT, DIGIT)] * (k + m), CANVAS, max_overlap, rng)
        canvas = np.zeros((CANVAS, CANVAS), dtype=np.float64)
        for (x1, y1, x2, y2), src in zip(boxes, srcs, strict=True):
            canvas[y1:y2, x1:x2] = np.maximum(canvas[y1:y2, x1:x2], images[src] / 255.0)
        if background == "patch":
            _paste_patches_around(canvas, boxes, rng, PATCHES)
        else:
            canvas = _corrupt(canvas, background, rng, boxes[0], pool)
        out[i] = canvas
        b = torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4)
        inst.append(b[:k])
        dist.append(b[k:])
        dist_lbl.append(torch.from_numpy(kinds[k:].astype(np.int64)))
    return MultiBatch(torch.from_numpy(out)[:, None], inst, dist, dist_lbl, digit)


MULTI_OBJECT_SIDE = (0.2, 0.35)
"""Long side of each pasted cut-out in ``photos_multi``, as a fraction of the image side (45-78 px at 224):
smaller than the single-object generator's 0.25-0.6 so that 4 instances and 3 distractors fit."""


def photos_multi(manifest: dict[str, Any] | str | os.PathLike, class_name: str, split: str = "test", n: int = 50,
                 seed: int = 0, size: int = 224, min_instances: int = 1, max_instances: int = 4,
                 distractors: tuple[int, int] = (0, 3), max_overlap: int | None = None,
                 params: PasteParams = PasteParams(object_side=MULTI_OBJECT_SIDE)) -> MultiBatch:
    """``n`` photos ``[n, 3, size, size]``: a background crop with ``k ~ U{min_instances..max_instances}``
    cut-outs of ``class_name`` and ``m ~ U{distractors}`` cut-outs of other classes (class uniform among the
    others, photo uniform in the class), all from the ``split`` files, each scaled, flipped and jittered as
    in ``models.data.photos.generate`` (``params``) and placed by the overlap rule (``max_overlap`` px,
    default 2 % of ``size``). Boxes are the tight boxes of each cut-out's own alpha (>= ``ALPHA_THRESHOLD``).

    Deterministic for ``(seed, class_name, split, size)`` and the counts asked for.
    """
    _check_counts(min_instances, max_instances, distractors)
    if not isinstance(manifest, dict):
        manifest = load_manifest(manifest)
    root = Path(manifest["root"])
    classes = list(manifest["objects"])
    objs, bgs = split_files(manifest, class_name, split)
    other_objs = {c: split_files(manifest, c, split)[0] for c in classes if c != class_name}
    other_names = sorted(other_objs)
    overlap = round(0.02 * size) if max_overlap is None else max_overlap
    rng = np.random.default_rng([seed, zlib.crc32(class_name.encode()), SPLITS.index(split), size, 13])
    images = np.empty((n, size, size, 3), dtype=np.float32)
    inst, dist, dist_lbl = [], [], []
    for i in range(n):  # data generation, not a hot path
        k, m = _counts(rng, min_instances, max_instances, distractors)
        kinds = [class_name] * k + [other_names[int(j)] for j in rng.integers(0, len(other_names), m)]
        items = [objs[rng.integers(len(objs))] if c == class_name else
                 other_objs[c][rng.integers(len(other_objs[c]))] for c in kinds]
        canvas = _background_crop(_load_background(str(root / bgs[rng.integers(len(bgs))]["path"]), size), size, rng,
                                  params)
        cutouts = [_object_cutout(_load_object(str(root / it["path"])), size, rng, params) for it in items]
        spots = place([(a.shape[1], a.shape[0]) for _, a in cutouts], size, overlap, rng)
        boxes = []
        for (rgb, alpha), (x, y, _, _) in zip(cutouts, spots, strict=True):
            h, w = alpha.shape
            region = canvas[y:y + h, x:x + w]
            region *= 1.0 - alpha[..., None]
            region += rgb * alpha[..., None]
            bx1, by1, bx2, by2 = mask_box(alpha >= ALPHA_THRESHOLD)
            boxes.append((x + bx1, y + by1, x + bx2, y + by2))
        images[i] = canvas
        b = torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4)
        inst.append(b[:k])
        dist.append(b[k:])
        dist_lbl.append(torch.tensor([classes.index(c) for c in kinds[k:]], dtype=torch.long))
    return MultiBatch(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous().clamp_(0, 1), inst, dist, dist_lbl,
                      class_name)

