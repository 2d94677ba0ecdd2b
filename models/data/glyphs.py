"""Glyphs: objects that are not digits (letters and symbols rendered from TrueType fonts) on cMNIST canvases.

Each class is one character of ``GLYPH_CLASSES``. An instance is that character rendered with PIL in a
font drawn among the fonts found on the machine (``font_files``: a glob of ``/usr/share/fonts``, DejaVu
on this project's machines), with a random stroke width and a small rotation (``GlyphStyle``), cut tight
to its ink and resized so its long side is ``size`` pixels (rarely one more: ``render_glyph``), 28-36 by
default: the cMNIST frame is 28, and the shipped cMNIST bundle's boxes never shrink below 28 px a side,
so an object of that long side and aspect >= 0.5 can still be found with IoU >= 0.5. Pixels below
``INK_THRESHOLD`` after resizing are set to 0, so the tile's ink is exactly its non-zero pixels and its
box is tight: every edge row and column of the box holds ink. The tile (white on black, like an MNIST
digit) is pasted at a uniform position on an 84x84 canvas and the canvas corrupted with the four cMNIST
backgrounds, through ``models.data.cmnist``'s own helpers (patches never overlap the glyph's box; the
clutter fragments are cut from glyphs of the *other* classes, rendered from the same split's fonts,
instead of MNIST digits).

Data discipline (fixed, seed-independent): the fonts are split once -- a fixed permutation holds out a
quarter of them (at least one) as the ``test`` fonts; ``train`` and ``val`` render with the others. So
test images show the class in fonts no exemplar or unlabeled image used. Besides, every image has its
own random streams keyed by (seed, class, split, index) -- the glyph's, and its background's keyed by the
background too (so one seed shows the same glyphs on each background): ``train``, ``val`` and ``test``
draws never share a stream, and ``offset`` skips the first images of a draw so two slices of one draw
(exemplars, then unlabeled images) are disjoint. When no TrueType font is found, PIL's built-in font
(``ImageFont.load_default(size=...)``, one font) serves every split, and only the random streams keep
the splits apart (the test split then shows no unseen font).

Every generator is deterministic for its seed (numpy ``Generator``s only).
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from models.data.cmnist import BACKGROUNDS, CANVAS, DIGIT, _corrupt
from models.data.types import LabeledImages

GLYPH_CLASSES = ("A", "K", "R", "W", "e", "g", "#", "&", "@", "%", "?", "$")
"""One character per class; none is a digit."""
FONT_GLOBS = ("/usr/share/fonts/**/*.ttf", "/usr/share/fonts/**/*.otf")
SPLITS = ("train", "val", "test")
INK_THRESHOLD = 0.1
"""Tile pixels below this (on the [0, 1] scale) after resizing are set to 0: the ink is what is left."""
TEST_FONT_FRACTION = 0.25
_RENDER_SIZE = 64  # font size the glyph is drawn at before it is cut and resized down
_POOL_SIZE = 64  # glyphs of the other classes the clutter fragments are cut from


@dataclass(frozen=True)
class GlyphStyle:
    """The ranges an instance is drawn from (uniform; sizes and strokes inclusive)."""

    size: tuple[int, int] = (28, 36)
    """Long side of the glyph's tight box on the canvas, pixels."""
    stroke: tuple[int, int] = (0, 3)
    """Extra stroke width at the render size (64 px), i.e. about 0 to 1.5 px on the canvas."""
    rotation: float = 12.0
    """Rotation, uniform in +- this many degrees."""


@dataclass(frozen=True)
class GlyphSpec:
    """What to generate: ``n`` images of the class ``char`` (one of ``GLYPH_CLASSES``, or any other
    character) from ``split`` ("train" | "val" | "test"), images ``offset`` .. ``offset + n - 1`` of the draw."""

    char: str
    split: str = "train"
    n: int = 50
    background: str = "patch"
    seed: int = 0
    offset: int = 0
    style: GlyphStyle = GlyphStyle()


@lru_cache(maxsize=1)
def font_files() -> tuple[str, ...]:
    """The TrueType / OpenType fonts found (sorted paths); empty when none (then PIL's built-in font serves)."""
    found: set[str] = set()
    for pattern in FONT_GLOBS:
        found.update(glob.glob(pattern, recursive=True))
    return tuple(sorted(found))


def split_fonts(split: str) -> tuple[str | None, ...]:
    """The fonts of ``split``: the test fonts are a fixed quarter of ``font_files()`` (at least one, none
    shared with train / val); ``(None,)`` (PIL's built-in font) when no font file is found."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    files = font_files()
    if not files:
        return (None,)
    if len(files) == 1:
        return files
    perm = np.random.default_rng(2024).permutation(len(files))  # fixed, seed-independent partition
    n_test = max(1, round(len(files) * TEST_FONT_FRACTION))
    chosen = perm[:n_test] if split == "test" else perm[n_test:]
    return tuple(files[i] for i in sorted(chosen))


@lru_cache(maxsize=256)
def _font(path: str | None, size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    if path is None:
        return ImageFont.load_default(size=size)
    return ImageFont.truetype(path, size)


def render_glyph(char: str, font: str | None, size: int, stroke: int = 0, rotation: float = 0.0) -> np.ndarray:
    """One glyph tile: ``char`` in ``font`` (a path; None: PIL's built-in font), ``stroke`` px extra stroke
    at the render size, rotated by ``rotation`` degrees, cut tight to its ink and resized so its long side
    is ``size`` -> ``float32 [h, w]`` in [0, 1], white ink on 0, pixels below ``INK_THRESHOLD`` zeroed and
    every edge row / column holding ink. (Where the threshold cuts a faint edge row at every nearby scale,
    the long side is ``size + 1``: 2 of 4,752 font / class / size / stroke / rotation combinations.)"""
    r = _RENDER_SIZE
    img = Image.new("L", (3 * r, 3 * r), 0)
    ImageDraw.Draw(img).text((1.5 * r, 1.5 * r), char, font=_font(font, r), fill=255, anchor="mm",
                             stroke_width=stroke, stroke_fill=255)
    if rotation:
        img = img.rotate(rotation, resample=Image.Resampling.BICUBIC, expand=False)
    bbox = img.getbbox()
    if bbox is None:
        raise ValueError(f"font {font} renders no ink for {char!r}")
    img = img.crop(bbox)
    # The threshold may cut a faint edge row: then resize a pixel larger, and keep the tile whose long side
    # is ``size`` (else the nearest above it, else the nearest below).
    tiles = []
    for target in range(size, size + 4):
        tile = _resized_ink(img, target)
        if tile is not None and max(tile.shape) == size:
            return tile
        tiles += [] if tile is None else [tile]
    if not tiles:
        raise ValueError(f"font {font} leaves no ink for {char!r} at {size} px")
    return min(tiles, key=lambda t: (max(t.shape) < size, abs(max(t.shape) - size)))


def _resized_ink(img: Image.Image, long_side: int) -> np.ndarray | None:
    """``img`` resized so its long side is ``long_side``, thresholded and cut to its ink (None: no ink left)."""
    w, h = img.size
    k = long_side / max(w, h)
    nw, nh = max(1, round(w * k)), max(1, round(h * k))
    tile = np.asarray(img.resize((nw, nh), Image.Resampling.LANCZOS), dtype=np.float32) / 255.0
    tile = np.where(tile >= INK_THRESHOLD, np.clip(tile, 0.0, 1.0), 0.0).astype(np.float32)
    ys, xs = np.nonzero(tile)
    if len(ys) == 0:
        return None
    return tile[ys.min():ys.max() + 1, xs.min():xs.max() + 1]


def _draw_tile(char: str, fonts: tuple[str | None, ...], style: GlyphStyle, rng: np.random.Generator) -> np.ndarray:
    font = fonts[int(rng.integers(0, len(fonts)))]
    size = int(rng.integers(style.size[0], style.size[1] + 1))
    stroke = int(rng.integers(style.stroke[0], style.stroke[1] + 1))
    rotation = float(rng.uniform(-style.rotation, style.rotation))
    return render_glyph(char, font, size, stroke, rotation)


def _keys(spec: GlyphSpec, i: int) -> tuple[list[int], list[int]]:
    """The random streams of image ``i`` of a draw: the glyph's (font, size, stroke, rotation, position) and
    its background's. The glyph's does not depend on the background: one seed shows the same instances on
    every background."""
    bg = BACKGROUNDS.index(spec.background) if spec.background in BACKGROUNDS else 9
    glyph = [spec.seed, ord(spec.char), SPLITS.index(spec.split), spec.offset + i]
    return glyph, glyph + [bg, 1]


@lru_cache(maxsize=32)
def _clutter_pool(char: str, split: str) -> np.ndarray:
    """``uint8 [K, 28, 28]``: glyphs of the classes other than ``char`` in ``split``'s fonts, each fitted in a
    28x28 frame (as the MNIST digits cMNIST's clutter is cut from); fixed per (char, split)."""
    others = [c for c in GLYPH_CLASSES if c != char]
    rng = np.random.default_rng([ord(char), SPLITS.index(split), 77])
    fonts = split_fonts(split)
    pool = np.zeros((_POOL_SIZE, DIGIT, DIGIT), dtype=np.uint8)
    for i in range(_POOL_SIZE):
        tile = _draw_tile(others[i % len(others)], fonts, GlyphStyle(size=(20, DIGIT)), rng)
        h, w = tile.shape
        y, x = (DIGIT - h) // 2, (DIGIT - w) // 2
        pool[i, y:y + h, x:x + w] = np.round(tile * 255).astype(np.uint8)
    return pool


def generate(spec: GlyphSpec) -> LabeledImages:
    """``spec.n`` canvases ``float32 [n, 1, 84, 84]`` in [0, 1] with the tight ink boxes ``float32 [n, 4]``
    (integer pixel edges); deterministic for the spec. Image ``i`` depends only on (seed, char, split,
    offset + i) -- and its background on ``background`` too: a draw of ``n`` images is a prefix of a longer
    one with the same spec, and the same spec on another background shows the same glyphs at the same boxes."""
    if spec.split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {spec.split!r}")
    if spec.background not in BACKGROUNDS + ("none",):
        raise ValueError(f"background must be one of {BACKGROUNDS + ('none',)}, got {spec.background!r}")
    if len(spec.char) != 1:
        raise ValueError(f"a glyph class is one character, got {spec.char!r}")
    if spec.style.size[1] > CANVAS:
        raise ValueError(f"glyph size {spec.style.size} does not fit a {CANVAS}x{CANVAS} canvas")
    fonts = split_fonts(spec.split)
    pool = _clutter_pool(spec.char, spec.split) if spec.background == "clutter" else None
    out = np.zeros((spec.n, CANVAS, CANVAS), dtype=np.float32)
    boxes = np.zeros((spec.n, 4), dtype=np.float32)
    for i in range(spec.n):  # data generation, not a hot path
        glyph_key, background_key = _keys(spec, i)
        rng = np.random.default_rng(glyph_key)
        tile = _draw_tile(spec.char, fonts, spec.style, rng)
        h, w = tile.shape
        x, y = int(rng.integers(0, CANVAS - w + 1)), int(rng.integers(0, CANVAS - h + 1))
        canvas = np.zeros((CANVAS, CANVAS), dtype=np.float64)
        canvas[y:y + h, x:x + w] = tile
        box = (x, y, x + w, y + h)
        out[i] = _corrupt(canvas, spec.background, np.random.default_rng(background_key), box, pool)
        boxes[i] = box
    return LabeledImages(torch.from_numpy(out)[:, None], torch.from_numpy(boxes))


def glyphs(char: str, split: str, n: int, background: str = "patch", seed: int = 0, offset: int = 0) -> LabeledImages:
    """Shorthand for ``generate(GlyphSpec(...))`` (the signature of ``models.experiments.cmnist.cmnist``)."""
    return generate(GlyphSpec(char, split, n, background, seed, offset))
