"""Real photographs with hand-drawn boxes: the real-photo benchmark (issue 15).

Unlike ``models.data.photos`` (cut-outs pasted on backgrounds), every image here is a whole, unaltered
photograph as its package ships it, and its box was drawn by hand. The annotations are committed next
to this module as COCO JSON (``realphotos.coco.json``); the photos are not: ``fetch`` gets them from
their packages and checks each file's sha256 against the annotation file, so a different package
version (a re-encoded or replaced photo) is detected instead of silently shifting the boxes.

Sources (``sources`` in the JSON; each image records its package, version, path, license and holder):

- Debian packages, fetched with ``apt-get download`` and read with ``dpkg-deb --fsys-tarfile`` (nothing
  is installed; only the listed files are kept): ``gcompris-qt-data`` (photos inside its Qt resource
  bundles ``*.rcc``, read by ``read_rcc``; the path is ``<bundle>!<path in the bundle>``), ``opencv-doc``
  (OpenCV's ``samples/data``), ``palapeli-data`` and ``lomiri-wallpapers-20.04``;
- PyPI: ``scikit-image`` (``skimage/data``, the copy installed in this environment).

How the boxes were drawn and checked, the rule for which object is boxed, and the counts per class and
split: ``LABELING.md`` next to this module. In short: one box per image, around the most prominent
instance of the image's class (largest visible extent, ties to the sharper / more central one), tight
around the visible extent of the object in pixels of the original file; each box drawn on a gridded
view of the image, then checked once more on a drawn overlay (``draw_overlays``).

Splits (``split`` per image): within each class the images are ordered by the sha256 of their
``file_name``; the first ``max(3, round(0.2 n))`` are ``exemplar`` images (their boxes give the exemplar
crops), the rest are cut in two halves, ``val`` then ``test`` (``assign_splits``). Exemplars therefore
never come from a val or test photo. Annotations may carry ``instance``: the same physical object in
several photos (OpenCV's box.png / box_in_scene.png, the Eiffel Tower in three photos, ...), for
instance queries whose exemplar is another photo of that very object.

The cache is ``$QLOC_DATA_DIR/real-photos`` (``real_photo_dir``): ``images/`` (the photos, named by
``file_name``), ``licenses/`` (each package's copyright file), ``overlays/`` (``draw_overlays``), and a
``.gitignore`` that keeps all of it out of git.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import time
import zlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch import Tensor

from models.data import data_dir
from models.data.debian import deb_field, download

ANNOTATIONS = Path(__file__).with_name("realphotos.coco.json")
FORMAT = "qloc-real-photos"
SPLITS = ("exemplar", "val", "test")
EXEMPLAR_FRACTION = 0.2
MIN_EXEMPLARS = 3
RCC_SEPARATOR = "!"
"""``source.path`` of a photo inside a Qt resource bundle: ``<bundle path in the package>!<path in the bundle>``."""


def real_photo_dir() -> Path:
    """Where ``qloc fetch-real-photos`` writes, and ``load`` reads, the real photos: ``<data dir>/real-photos``."""
    return data_dir() / "real-photos"


# ---------------------------------------------------------------- annotations

def load_annotations(path: str | os.PathLike = ANNOTATIONS) -> dict[str, Any]:
    """The COCO dict of the benchmark (``images``, ``annotations``, ``categories``, plus ``sources``)."""
    data = json.loads(Path(path).read_text())
    if data.get("info", {}).get("format") != FORMAT:
        raise ValueError(f"{path} is not a qloc real-photo annotation file")
    return data


def assign_splits(file_names: list[str]) -> dict[str, str]:
    """One class's ``file_name``s -> their split: ordered by sha256 of the name, the first
    ``max(MIN_EXEMPLARS, round(EXEMPLAR_FRACTION * n))`` are ``exemplar``, the rest half ``val``, half ``test``
    (the odd one goes to ``test``)."""
    order = sorted(file_names, key=lambda f: hashlib.sha256(f.encode()).hexdigest())
    n = len(order)
    n_ex = min(n, max(MIN_EXEMPLARS, round(EXEMPLAR_FRACTION * n)))
    n_val = (n - n_ex) // 2
    return {f: "exemplar" if i < n_ex else "val" if i < n_ex + n_val else "test" for i, f in enumerate(order)}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------- Qt resource bundles

def read_rcc(data: bytes) -> dict[str, bytes]:
    """The files of a Qt resource bundle (``rcc`` binary format, versions 1-3) -> ``{path: bytes}``.

    Layout: the ``qres`` magic, then the format version and the offsets of the tree, the data and the names.
    A tree node is (name offset, flags, then child count + first child for a directory, or locale + data
    offset for a file), plus an 8-byte modification time from version 2 on. A name is its length, a hash,
    and UTF-16BE text; a file's data is its size then its bytes, zlib-compressed after a 4-byte size when
    flag 1 is set (flag 4, zstd, is refused).
    """
    if data[:4] != b"qres":
        raise ValueError("not a Qt resource bundle (no 'qres' magic)")
    version, tree, blobs, names = struct.unpack(">IIII", data[4:20])
    node = 14 if version == 1 else 22

    def name(off: int) -> str:
        (n,) = struct.unpack(">H", data[names + off:names + off + 2])
        return data[names + off + 6:names + off + 6 + 2 * n].decode("utf-16-be")

    out: dict[str, bytes] = {}
    stack = [(0, "")]
    while stack:
        i, prefix = stack.pop()
        p = tree + i * node
        name_off, flags = struct.unpack(">IH", data[p:p + 6])
        path = f"{prefix}{name(name_off)}" if i else ""
        if flags & 2:  # a directory
            count, first = struct.unpack(">II", data[p + 6:p + 14])
            stack.extend((c, f"{path}/" if path else "") for c in range(first, first + count))
            continue
        (off,) = struct.unpack(">I", data[p + 10:p + 14])
        (size,) = struct.unpack(">I", data[blobs + off:blobs + off + 4])
        raw = data[blobs + off + 4:blobs + off + 4 + size]
        if flags & 4:
            raise ValueError(f"{path}: zstd-compressed resources are not supported")
        out[path] = zlib.decompress(raw[4:]) if flags & 1 else raw
    return out


# ---------------------------------------------------------------- fetching

def fetch(cache_dir: str | os.PathLike | None = None, annotations: str | os.PathLike = ANNOTATIONS,
          force: bool = False, keep_debs: bool = False, log=print) -> Path:
    """Download the packages the annotation file names, copy each photo to ``cache_dir/images/<file_name>``
    and check its sha256 -> ``cache_dir``.

    Idempotent: a package whose photos are all present with the right sha256 is not fetched again
    (``force=True`` refetches everything). Raises ``RuntimeError`` when a photo is missing from its
    package or its sha256 differs (the message names the recorded and the fetched package versions).
    Debian packages need ``apt-get`` (download only) and ``dpkg-deb``; the ``.deb`` is deleted after use
    unless ``keep_debs``. PyPI sources are read from the installed distribution.
    """
    cache = Path(cache_dir) if cache_dir is not None else real_photo_dir()
    data = load_annotations(annotations)
    cache.mkdir(parents=True, exist_ok=True)
    (cache / ".gitignore").write_text("# fetched by `qloc fetch-real-photos`: not part of the repository\n*\n")
    by_package: dict[str, list[dict]] = defaultdict(list)
    for im in data["images"]:
        by_package[im["source"]["package"]].append(im)
    fetched_versions = {}
    for pkg, images in sorted(by_package.items()):
        if not force and all(_matches(cache, im) for im in images):
            continue
        kind = data["sources"][pkg]["kind"]
        if kind == "deb":
            files, version = _deb_files(pkg, images, cache, keep_debs, log)
        elif kind == "pypi":
            files, version = _pypi_files(pkg, images, cache)
        else:
            raise ValueError(f"source {pkg}: unknown kind {kind!r}")
        fetched_versions[pkg] = version
        for im in images:
            if im["file_name"] not in files:
                raise RuntimeError(f"{pkg} {version} has no {im['source']['path']} (annotated from version "
                                   f"{im['source']['version']})")
            dest = cache / "images" / im["file_name"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.tmp")
            tmp.write_bytes(files[im["file_name"]])
            os.replace(tmp, dest)
        log(f"{pkg} {version}: {len(images)} photos")
    bad = verify(cache, data)
    if bad:
        lines = []
        for im, why in bad:
            pkg = im["source"]["package"]
            got = f", fetched {fetched_versions[pkg]}" if pkg in fetched_versions else ""
            lines.append(f"  {im['file_name']}: {why} ({pkg} annotated at {im['source']['version']}{got})")
        raise RuntimeError(f"{len(bad)} photos differ from the annotated files (another package version?):\n"
                           + "\n".join(lines[:20]))
    log(f"{len(data['images'])} photos in {cache / 'images'}, all sha256 as annotated")
    return cache


def verify(cache_dir: str | os.PathLike | None = None, data: dict[str, Any] | None = None) -> list[tuple[dict, str]]:
    """Photos of the annotation file that are missing from the cache or whose sha256 differs -> ``[(image, why)]``."""
    cache = Path(cache_dir) if cache_dir is not None else real_photo_dir()
    data = data or load_annotations()
    bad = []
    for im in data["images"]:
        f = cache / "images" / im["file_name"]
        if not f.is_file():
            bad.append((im, "missing"))
        elif _sha256(f.read_bytes()) != im["sha256"]:
            bad.append((im, "sha256 differs"))
    return bad


def _matches(cache: Path, im: dict) -> bool:
    f = cache / "images" / im["file_name"]
    return f.is_file() and _sha256(f.read_bytes()) == im["sha256"]


def _deb_files(pkg: str, images: list[dict], cache: Path, keep_debs: bool, log) -> tuple[dict[str, bytes], str]:
    """Read the annotated photos (and the copyright file) out of a Debian package -> ({file_name: bytes}, version)."""
    deb = download(pkg, cache / "debs", log)
    version = deb_field(deb, "Version")
    members: dict[str, list[tuple[str, str | None]]] = defaultdict(list)  # member -> [(file_name, rcc path)]
    for im in images:
        member, _, inner = im["source"]["path"].partition(RCC_SEPARATOR)
        members[member].append((im["file_name"], inner or None))
    copyright_member = f"usr/share/doc/{pkg}/copyright"
    files: dict[str, bytes] = {}
    try:
        proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE)
    except FileNotFoundError as e:
        raise RuntimeError("dpkg-deb not found: fetching the real photos needs Debian's apt-get and dpkg-deb") from e
    with proc, tarfile.open(fileobj=proc.stdout, mode="r|*") as tar:
        for m in tar:
            name = m.name.removeprefix("./")
            if not m.isfile() or (name not in members and name != copyright_member):
                continue
            blob = tar.extractfile(m).read()
            if name == copyright_member:
                (cache / "licenses").mkdir(exist_ok=True)
                (cache / "licenses" / f"{pkg}.copyright").write_bytes(blob)
                continue
            inside = None
            for file_name, inner in members[name]:
                if inner is None:
                    files[file_name] = blob
                    continue
                inside = inside if inside is not None else read_rcc(blob)
                if inner in inside:
                    files[file_name] = inside[inner]
    if proc.returncode:
        raise RuntimeError(f"dpkg-deb --fsys-tarfile {deb} failed (exit {proc.returncode})")
    if not keep_debs:
        deb.unlink()
    log(f"read {len(files)} photos from {deb.name}")
    return files, version


def _pypi_files(dist: str, images: list[dict], cache: Path) -> tuple[dict[str, bytes], str]:
    """Read the annotated photos from an installed PyPI distribution -> ({file_name: bytes}, version)."""
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError as e:
        raise RuntimeError(f"{dist} is not installed: pip install {dist}") from e
    files = {}
    for im in images:
        top, _, rest = im["source"]["path"].partition("/")
        spec = importlib.util.find_spec(top)
        if spec is None or spec.origin is None:
            raise RuntimeError(f"{dist}: module {top} not found")
        f = Path(spec.origin).parent / rest
        if f.is_file():
            files[im["file_name"]] = f.read_bytes()
    for f in importlib.metadata.files(dist) or []:  # its license file
        if f.name.upper().startswith(("LICENSE", "COPYING")):
            (cache / "licenses").mkdir(exist_ok=True)
            shutil.copyfile(f.locate(), cache / "licenses" / f"{dist}.copyright")
            break
    return files, version


# ---------------------------------------------------------------- loading

@dataclass
class RealPhoto:
    """One annotated photo: ``image`` (RGB, original size; a float tensor ``[3, H, W]`` in [0, 1] when
    loaded with ``tensors=True``), ``box`` ``(x1, y1, x2, y2)`` in its pixels, its class, split, file and
    the ``instance`` name when the same object is in other photos."""

    image: Image.Image | Tensor
    box: tuple[float, float, float, float]
    cls: str
    split: str
    file_name: str
    instance: str | None = None


def load(split: str, cls: str | None = None, cache_dir: str | os.PathLike | None = None,
         tensors: bool = False, annotations: str | os.PathLike = ANNOTATIONS) -> list[RealPhoto]:
    """The photos of ``split`` (``exemplar`` / ``val`` / ``test``, or ``all``), of class ``cls`` or of every
    class, ordered by class then file name. Needs ``fetch`` first."""
    if split not in (*SPLITS, "all"):
        raise ValueError(f"split must be one of {SPLITS} or 'all', got {split!r}")
    cache = Path(cache_dir) if cache_dir is not None else real_photo_dir()
    data = load_annotations(annotations)
    cats = {c["id"]: c["name"] for c in data["categories"]}
    if cls is not None and cls not in cats.values():
        raise ValueError(f"unknown class {cls!r}; known: {sorted(cats.values())}")
    anns = {a["image_id"]: a for a in data["annotations"]}
    out = []
    for im in sorted(data["images"], key=lambda im: (im["class"], im["file_name"])):
        if (split != "all" and im["split"] != split) or (cls is not None and im["class"] != cls):
            continue
        path = cache / "images" / im["file_name"]
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: run `qloc fetch-real-photos --cache {cache}` first")
        with Image.open(path) as f:
            image = f.convert("RGB")
        a = anns[im["id"]]
        x, y, w, h = a["bbox"]
        out.append(RealPhoto(_to_tensor(image) if tensors else image, (x, y, x + w, y + h), cats[a["category_id"]],
                             im["split"], im["file_name"], a.get("instance")))
    return out


def _to_tensor(image: Image.Image) -> Tensor:
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float().div_(255.0)


def classes(annotations: str | os.PathLike = ANNOTATIONS) -> list[str]:
    """The class names, in category id order."""
    return [c["name"] for c in sorted(load_annotations(annotations)["categories"], key=lambda c: c["id"])]


# ---------------------------------------------------------------- overlays (the box check)

def draw_overlays(cache_dir: str | os.PathLike | None = None, annotations: str | os.PathLike = ANNOTATIONS,
                  max_side: int = 640) -> Path:
    """Draw every box on its photo (shrunk to ``max_side``) -> ``cache_dir/overlays/<class>/<name>.png``,
    plus one contact sheet per class (``<class>.png``): what the second check of each box looked at."""
    cache = Path(cache_dir) if cache_dir is not None else real_photo_dir()
    out = cache / "overlays"
    for cls in classes(annotations):
        tiles = []
        for p in load("all", cls, cache, annotations=annotations):
            im = p.image.copy()
            f = min(1.0, max_side / max(im.size))
            im = im.resize((max(1, round(im.width * f)), max(1, round(im.height * f))), Image.Resampling.BILINEAR)
            d = ImageDraw.Draw(im)
            x1, y1, x2, y2 = (v * f for v in p.box)
            for k, colour in enumerate(("black", "yellow", "yellow")):
                d.rectangle((x1 - 1 + k, y1 - 1 + k, x2 - k, y2 - k), outline=colour, width=1)
            d.text((4, 4), f"{p.split} {Path(p.file_name).name}", fill="yellow", stroke_width=1, stroke_fill="black")
            dest = out / cls / (Path(p.file_name).with_suffix("").as_posix().replace("/", "__") + ".png")
            dest.parent.mkdir(parents=True, exist_ok=True)
            im.save(dest)
            tiles.append(im)
        _contact_sheet(tiles).save(out / f"{cls}.png")
    return out


def _contact_sheet(tiles: list[Image.Image], side: int = 240, cols: int = 5) -> Image.Image:
    rows = max(1, (len(tiles) + cols - 1) // cols)
    sheet = Image.new("RGB", (cols * side, rows * side), "white")
    for i, t in enumerate(tiles):
        t = t.copy()
        t.thumbnail((side - 4, side - 4))
        sheet.paste(t, ((i % cols) * side + 2, (i // cols) * side + 2))
    return sheet


# ---------------------------------------------------------------- CLI

def fetch_main(argv: list[str] | None = None) -> int:
    """``qloc fetch-real-photos [--cache DIR] [--force] [--overlays]``: fetch the real photos and check them."""
    ap = argparse.ArgumentParser(prog="qloc fetch-real-photos", description=fetch_main.__doc__)
    ap.add_argument("--cache", default=str(real_photo_dir()),
                    help=f"cache folder (default {real_photo_dir()}: $QLOC_DATA_DIR/real-photos)")
    ap.add_argument("--force", action="store_true", help="refetch every package")
    ap.add_argument("--overlays", action="store_true", help="also draw every box on its photo (cache/overlays)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        cache = fetch(args.cache, force=args.force)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    data = load_annotations()
    for cls in classes():
        per = {s: sum(im["class"] == cls and im["split"] == s for im in data["images"]) for s in SPLITS}
        print(f"  {cls:12s} {sum(per.values()):3d} photos  " + " ".join(f"{s} {k}" for s, k in per.items()))
    if args.overlays:
        print(f"  overlays in {draw_overlays(cache)}")
    print(f"  licenses: {sorted({im['license_name'] for im in data['images']})}; copyright files in "
          f"{cache / 'licenses'}  ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(fetch_main())
