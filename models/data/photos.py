"""Natural photos, offline: object cut-outs pasted on background photos, with exact boxes.

The photos come from Debian packages, fetched and indexed in a manifest by ``models.data.photo_fetch``
(``qloc fetch-photos``); this module reads the manifest (``load_manifest``, ``split_files``) and generates.

``generate`` pastes a cut-out (random scale, position, horizontal flip, colour jitter) on a random
background crop. The box is the tight box of the pasted alpha mask (alpha >= ``ALPHA_THRESHOLD``),
in integer pixel edges: exact by construction.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from models.data import photo_cache_dir
from models.data.types import exemplar_crops

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "qloc-photos"
MANIFEST_VERSION = 1

CLASSES = {
    "mammals": "animals/mammals", "birds": "animals/birds", "fish": "animals/fish",
    "insects": "animals/insects", "fruit": "food/fruit", "vegetables": "food/vegetables",
    "flowers": "plants/flowers", "trees": "plants/trees",
}
"""Class name -> tuxpaint stamps folder; sub-folders are part of the class (minus ``photo_fetch.NOT_PHOTO_DIRS``)."""
SPLITS = ("train", "val", "test")
ALPHA_THRESHOLD = 0.5
"""A pasted pixel belongs to the object (and its box) when its alpha is at least this."""


def load_manifest(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Read a manifest (its file or the cache folder holding it, default ``photo_cache_dir()``); adds
    ``"root"``, the cache folder."""
    path = Path(path) if path is not None else photo_cache_dir()
    if path.is_dir():
        path = path / MANIFEST
    if not path.is_file():  # the fetch's --cache is the folder that holds the manifest
        folder = path.parent if path.name == MANIFEST else path
        raise FileNotFoundError(f"{path} not found: run `qloc fetch-photos --cache {folder}` first")
    data = json.loads(path.read_text())
    if data.get("format") != MANIFEST_FORMAT or data.get("version", 0) > MANIFEST_VERSION:
        raise ValueError(f"{path} is not a qloc photo manifest this version reads")
    data["root"] = str(path.parent)
    return data


def split_files(manifest: dict[str, Any], class_name: str, split: str) -> tuple[list[dict], list[dict]]:
    """-> (object items of ``class_name`` in ``split``, background items in ``split``)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if class_name not in manifest["objects"]:
        raise ValueError(f"unknown class {class_name!r}; known: {sorted(manifest['objects'])}")
    objs = [it for it in manifest["objects"][class_name] if it["split"] == split]
    bgs = [it for it in manifest["backgrounds"] if it["split"] == split]
    if not objs or not bgs:
        raise ValueError(f"class {class_name!r} split {split!r} has {len(objs)} object photos and {len(bgs)} "
                         "backgrounds; both must be non-empty")
    return objs, bgs


# ---------------------------------------------------------------- generator

@dataclass
class PhotoBatch:
    """``images`` float ``[N, 3, S, S]`` RGB in [0, 1]; ``boxes`` float ``[N, 4]`` (x1, y1, x2, y2) in pixels,
    the tight box of ``masks`` (bool ``[N, S, S]``, pasted alpha >= ``ALPHA_THRESHOLD``); ``objects`` and
    ``backgrounds``: the manifest paths used for each image."""

    images: Tensor
    boxes: Tensor
    masks: Tensor
    objects: list[str]
    backgrounds: list[str]

    def __len__(self) -> int:
        return self.images.shape[0]


@dataclass(frozen=True)
class PasteParams:
    """Random ranges of ``generate``. Sides are fractions of the output side S."""

    object_side: tuple[float, float] = (0.25, 0.6)
    """Long side of the pasted object's alpha box, uniform in this range (56..134 px at S=224)."""
    background_crop: tuple[float, float] = (0.5, 1.0)
    """Side of the square background crop, as a fraction of the background's short side."""
    brightness: float = 0.2
    contrast: float = 0.2
    saturation: float = 0.2
    flip: float = 0.5


def generate(manifest: dict[str, Any] | str | os.PathLike, class_name: str, split: str = "train", n: int = 50,
             seed: int = 0, size: int = 224, params: PasteParams = PasteParams()) -> PhotoBatch:
    """``n`` images of ``class_name`` from the ``split`` files only; deterministic for (seed, class, split, size).

    Each image: a random square crop of a background (random horizontal flip) resized to ``size``, and
    one object cut-out trimmed to its alpha, scaled so that its long side is ``params.object_side`` x
    ``size``, flipped, colour-jittered (brightness, contrast, saturation), pasted at a uniform position
    fully inside the image. ``boxes`` come from the pasted alpha, so they are exact.
    """
    if not isinstance(manifest, dict):
        manifest = load_manifest(manifest)
    root = Path(manifest["root"])
    objs, bgs = split_files(manifest, class_name, split)
    rng = np.random.default_rng([seed, zlib.crc32(class_name.encode()), SPLITS.index(split), size])
    images = np.empty((n, size, size, 3), dtype=np.float32)
    masks = np.zeros((n, size, size), dtype=bool)
    boxes = np.zeros((n, 4), dtype=np.float32)
    used_o, used_b = [], []
    for i in range(n):  # data generation, not a hot path
        o, b = objs[rng.integers(len(objs))], bgs[rng.integers(len(bgs))]
        used_o.append(o["path"])
        used_b.append(b["path"])
        canvas = _background_crop(_load_background(str(root / b["path"]), size), size, rng, params)
        rgb, alpha = _object_cutout(_load_object(str(root / o["path"])), size, rng, params)
        h, w = alpha.shape
        y, x = int(rng.integers(0, size - h + 1)), int(rng.integers(0, size - w + 1))
        region = canvas[y:y + h, x:x + w]
        region *= 1.0 - alpha[..., None]
        region += rgb * alpha[..., None]
        masks[i, y:y + h, x:x + w] = alpha >= ALPHA_THRESHOLD
        boxes[i] = mask_box(masks[i])
        images[i] = canvas
    return PhotoBatch(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous().clamp_(0, 1),
                      torch.from_numpy(boxes), torch.from_numpy(masks), used_o, used_b)


def mask_box(mask: np.ndarray) -> tuple[int, int, int, int]:
    """Tight box ``(x1, y1, x2, y2)`` of a non-empty bool ``mask [H, W]``, in pixel edges (x2 = last column + 1)."""
    cols, rows = np.flatnonzero(mask.any(0)), np.flatnonzero(mask.any(1))
    if len(cols) == 0:
        raise ValueError("empty object mask: the cut-out has no pixel with alpha >= ALPHA_THRESHOLD")
    return int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1


@lru_cache(maxsize=256)
def _load_object(path: str) -> np.ndarray:
    """A cut-out trimmed to its alpha box: float32 ``[h, w, 4]`` RGBA in [0, 1]; RGB premultiplied by alpha."""
    with Image.open(path) as im:
        a = np.asarray(im.convert("RGBA")).astype(np.float32) / 255.0
    x1, y1, x2, y2 = mask_box(a[..., 3] >= ALPHA_THRESHOLD)
    a = a[y1:y2, x1:x2].copy()
    a[..., :3] *= a[..., 3:]  # premultiplied, so resizing does not bleed the transparent colour in
    return a


@lru_cache(maxsize=256)
def _load_background(path: str, size: int) -> np.ndarray:
    """A background photo as uint8 ``[H, W, 3]``, shrunk so that its short side is at most ``2 * size``."""
    with Image.open(path) as im:
        im.draft("RGB", (2 * size, 2 * size))  # JPEG: decode at a reduced scale, much faster
        im = im.convert("RGB")
        short = min(im.size)
        if short > 2 * size:
            f = 2 * size / short
            im = im.resize((round(im.width * f), round(im.height * f)), Image.Resampling.BILINEAR, reducing_gap=2.0)
        return np.asarray(im).copy()


def _background_crop(bg: np.ndarray, size: int, rng: np.random.Generator, p: PasteParams) -> np.ndarray:
    """A random square crop of ``bg [H, W, 3]`` -> float32 ``[size, size, 3]`` in [0, 1], maybe flipped."""
    h, w = bg.shape[:2]
    side = max(1, round(min(h, w) * rng.uniform(*p.background_crop)))
    y, x = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
    im = Image.fromarray(bg[y:y + side, x:x + side]).resize((size, size), Image.Resampling.BILINEAR)
    out = np.asarray(im).astype(np.float32) / 255.0
    return out[:, ::-1].copy() if rng.random() < p.flip else out


def _object_cutout(obj: np.ndarray, size: int, rng: np.random.Generator,
                   p: PasteParams) -> tuple[np.ndarray, np.ndarray]:
    """Scale, flip and jitter a premultiplied cut-out -> (straight RGB ``[h, w, 3]``, alpha ``[h, w]``)."""
    h, w = obj.shape[:2]
    scale = rng.uniform(*p.object_side) * size / max(h, w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    chans = [np.asarray(Image.fromarray(obj[..., c]).resize((nw, nh), Image.Resampling.BILINEAR)) for c in range(4)]
    a = np.clip(np.stack(chans, -1), 0.0, 1.0)  # [nh, nw, 4]
    if rng.random() < p.flip:
        a = a[:, ::-1]
    alpha = a[..., 3]
    rgb = np.where(alpha[..., None] > 1e-6, a[..., :3] / np.maximum(alpha[..., None], 1e-6), 0.0)
    rgb = _jitter(np.clip(rgb, 0, 1), alpha, rng, p)
    if not (alpha >= ALPHA_THRESHOLD).any():  # a sliver scaled to nothing: keep at least one pixel
        alpha = alpha.copy()
        alpha.flat[int(np.argmax(alpha))] = 1.0
    return rgb.astype(np.float32), alpha.astype(np.float32)


def _jitter(rgb: np.ndarray, alpha: np.ndarray, rng: np.random.Generator, p: PasteParams) -> np.ndarray:
    """Brightness, contrast (about the object's mean grey) and saturation factors in ``1 +- p.*``."""
    gray = rgb @ np.array([0.299, 0.587, 0.114], dtype=rgb.dtype)  # [h, w]
    rgb = rgb * rng.uniform(1 - p.brightness, 1 + p.brightness)
    mean = float((gray * alpha).sum() / max(alpha.sum(), 1e-6))
    rgb = (rgb - mean) * rng.uniform(1 - p.contrast, 1 + p.contrast) + mean
    gray = rgb @ np.array([0.299, 0.587, 0.114], dtype=rgb.dtype)
    rgb = (rgb - gray[..., None]) * rng.uniform(1 - p.saturation, 1 + p.saturation) + gray[..., None]
    return np.clip(rgb, 0.0, 1.0)


def crops(batch: PhotoBatch) -> list[Tensor]:
    """The ground-truth crops of ``batch`` as ``[3, h, w]`` float tensors (exemplars as a client would send)."""
    return [c.clone() for c in exemplar_crops(batch)]  # the one crop rule, shared with cMNIST
