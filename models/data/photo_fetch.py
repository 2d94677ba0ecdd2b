"""The photo packages fetched and indexed: ``qloc fetch-photos`` (``fetch``, ``fetch_main``).

Sources (Debian packages, fetched with ``apt-get download`` + ``dpkg-deb -x``; nothing installed):

- objects: ``tuxpaint-stamps-default`` -- PNG photos cut out with an alpha channel, one folder per
  class (``models.data.photos.CLASSES``); GPL-2 (Bill Kendrick and the Tux Paint contributors).
- backgrounds: ``scratch`` ``Media/Backgrounds`` (MIT, CC-BY-SA-3.0) and ``mate-backgrounds``
  ``nature/`` (GPL-2+, one author per file).

``fetch(cache)`` writes ``cache/manifest.json``: every kept file with its class, split, license and
copyright holder, the rejected files with the reason, and each package's version and copyright file
(also copied to ``cache/licenses/``). The rules that keep only real photos are in ``PHOTO_RULES``.

Splits are by source file: within each class (and among backgrounds) the files are ordered by the
sha256 of their path and cut 60/20/20 into train/val/test, each split non-empty, so no object photo
and no background is shared between splits. ``models.data.photos`` reads the manifest and generates.
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
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from models.data import photo_cache_dir
from models.data.debian import deb_field, download, run
from models.data.photos import CLASSES, MANIFEST, MANIFEST_FORMAT, MANIFEST_VERSION, SPLITS, load_manifest

VERSION_FILE = ".qloc-package-version"
KEEP_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".gif", ".svg", ".txt", ".dat"})

STAMPS_ROOT = "usr/share/tuxpaint/stamps"
OBJECT_PACKAGE = "tuxpaint-stamps-default"
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

SPLIT_FRACTIONS = (0.6, 0.2, 0.2)


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
