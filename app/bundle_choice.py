"""Which bundle a new exemplar set gets when the client names none: the server's default, or for exemplars that look
like photos the photo default.

The default bundle (``QLOC_DEFAULT_BUNDLE``, ``mnist-general``) reads gray 84 x 84 images of strokes: a set of photo
crops made on it answers nothing right (CorLoc 0.0 on the real-photo benchmark's photos through the API, in color,
in gray levels and as 96-px thumbnails, against 52-58 on ``photo-general``: BENCHMARKS.md, "The bundle of a set
that names none"). So a set whose exemplars look like photos gets ``QLOC_DEFAULT_PHOTO_BUNDLE`` (``photo-general``)
when it is installed; other sets keep the default as before. A client that names ``bundle`` always gets that one.

"Like photos" is either of two things (the medians over the set's crops):

- **in continuous tones**, in color or gray and at any size: ``midtones``, the share of a crop's pixels in the
  middle half of its own gray range, at least ``MIDTONES_MIN``. Digits and characters on the cMNIST backgrounds are
  strokes on a flat ground, their pixels at the two ends of the range (at most 0.15); photographs' tones run through
  it (the benchmark's exemplar sets 0.28-0.72).
- **in color and photo-sized** (the rule before the mid-tones, kept for photos of few tones such as tools on white):
  the colorfulness of Hasler and Suesstrunk (2003), ``sqrt(std(rg)^2 + std(yb)^2) + 0.3 * sqrt(mean(rg)^2 +
  mean(yb)^2)`` with ``rg = R - G`` and ``yb = (R + G) / 2 - B`` on 0-255 pixels, at least ``COLOR_MIN`` (a gray
  image scores 0, also as an RGB JPEG; the benchmark's 31 exemplar crops 11.9-101, its val and test photographs
  4.7-129 but for two gray ones), and a longer side of at least ``PHOTO_MIN_SIDE`` pixels. Color alone is not
  enough: cMNIST-style digits tinted red, exemplars and images, score 93-96 on the default and 29-31 on the photo
  bundle; their crops are 28 px, the benchmark's photo crops 157-1051.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np
from PIL import Image

COLOR_MIN = 3.0
"""Colorfulness from which an exemplar is in color: above any gray image's (0), below the least colorful color
photograph of the real-photo benchmark (4.7, swans on gray water)."""
PHOTO_MIN_SIDE = 100
"""Longer side (pixels) from which an exemplar crop may be a photo's: above a whole cMNIST-style image (84), below
the real-photo benchmark's smallest exemplar crop (157)."""
MIDTONES_MIN = 0.2
"""Median ``midtones`` from which a set's crops are photos whatever their color and size: above every cMNIST-style
set's (at most 0.12 over the ten digits on the four backgrounds, also enlarged 3 times or saved as JPEGs; 0.15 for
printed characters), below the real-photo benchmark's exemplar sets' (0.28-0.72 in color, in gray and as 96-px
thumbnails; sets of 5 other crops of one class of its exemplar and val photos 0.17-0.72, tools and household lowest:
in color and photo-sized those are photos by the other rule). Its test photos were not read to choose it."""
THUMBNAIL = 64
"""Longer side an exemplar is read at (enough for its colors and tones; the cost does not grow with the upload)."""


def _thumbnail(image: Image.Image, mode: str) -> np.ndarray:
    """``image`` in ``mode``, shrunk to a longer side of at most ``THUMBNAIL`` -> its pixels as float64."""
    small = image.convert(mode)
    small.thumbnail((THUMBNAIL, THUMBNAIL))
    return np.asarray(small, dtype=np.float64)


def colorfulness(image: Image.Image) -> float:
    """Hasler-Suesstrunk colorfulness of ``image`` (any mode; 0 for gray), read on a thumbnail."""
    rgb = _thumbnail(image, "RGB")  # [H, W, 3]
    rg = rgb[..., 0] - rgb[..., 1]
    yb = 0.5 * (rgb[..., 0] + rgb[..., 1]) - rgb[..., 2]
    return float(np.hypot(rg.std(), yb.std()) + 0.3 * np.hypot(rg.mean(), yb.mean()))


def midtones(image: Image.Image) -> float:
    """The share of ``image``'s pixels in the middle half of its own gray range (its 2nd to 98th percentile), read
    on a thumbnail: near 0 for strokes on a flat ground (digits, characters, line art: their pixels sit at the two
    ends), mostly 0.3-0.8 for photographs (their tones run through the range)."""
    gray = _thumbnail(image, "L")  # [H, W]
    lo, hi = np.percentile(gray, (2, 98))
    if hi <= lo:  # one gray level: no tones at all
        return 0.0
    level = (gray - lo) / (hi - lo)
    return float(((level > 0.25) & (level < 0.75)).mean())


def like_photos(crops: Sequence[Image.Image]) -> bool:
    """Whether a set's exemplar crops look like photos: in color and photo-sized (the medians of their colorfulness
    at least ``COLOR_MIN`` and of their longer sides at least ``PHOTO_MIN_SIDE``), or, in gray levels or at any
    size, in continuous tones (the median of their ``midtones`` at least ``MIDTONES_MIN``)."""
    if not crops:
        return False
    if statistics.median(midtones(c) for c in crops) >= MIDTONES_MIN:
        return True
    return (statistics.median(max(c.size) for c in crops) >= PHOTO_MIN_SIDE
            and statistics.median(colorfulness(c) for c in crops) >= COLOR_MIN)


def installed_photo_default(photo_default: str | None, installed: Sequence[str]) -> str | None:
    """The photo default (``QLOC_DEFAULT_PHOTO_BUNDLE``) when one is set and installed, else ``None``."""
    return photo_default if photo_default and photo_default in installed else None


def bundle_of_new_set(named: str | None, crops: Sequence[Image.Image], *, default: str, photo_default: str | None,
                      installed: Sequence[str]) -> str:
    """The bundle a new set is made with: ``named`` when the client gave one; else ``photo_default`` for crops that
    look like photos when it is ``installed``; else ``default``."""
    if named is not None:
        return named
    photo = installed_photo_default(photo_default, installed)
    return photo if photo is not None and like_photos(crops) else default
