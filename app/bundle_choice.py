"""Which bundle a new exemplar set gets when the client names none: the server's default, or for exemplars that are
color photos the photo default.

The default bundle (``QLOC_DEFAULT_BUNDLE``, ``mnist-general``) reads gray 84 x 84 images: a set of color photo
crops made on it answers nothing right (CorLoc 0.0 on the real-photo benchmark's val and test photos through the
API, against 58.3 / 52.5 on ``photo-general``: BENCHMARKS.md, "The bundle of a set that names none"). So a set whose
exemplars look like photos gets ``QLOC_DEFAULT_PHOTO_BUNDLE`` (``photo-general``) when it is installed; other sets
keep the default as before. A client that names ``bundle`` always gets that one.

"Like photos" is two things, both needed (the medians over the set's crops):

- **in color**: the colorfulness of Hasler and Suesstrunk (2003), ``sqrt(std(rg)^2 + std(yb)^2) + 0.3 *
  sqrt(mean(rg)^2 + mean(yb)^2)`` with ``rg = R - G`` and ``yb = (R + G) / 2 - B`` on 0-255 pixels, at least
  ``COLOR_MIN``. A gray image scores 0 (also as an RGB JPEG: its chroma planes are flat); the real-photo benchmark's
  31 exemplar crops score 11.9-101, its 121 val and test photographs 4.7-129 (median 41) but for two gray ones (0),
  a sepia-toned photo about 35;
- **larger than a cMNIST-style image**: a longer side of at least ``PHOTO_MIN_SIDE`` pixels. Color alone is not
  enough: cMNIST-style digits tinted red on the gray patch background, exemplars and images, score 93-96 on the
  default and 29-31 on the photo bundle (same section); their crops are 28 px, the benchmark's photo crops 157-1051.
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
THUMBNAIL = 64
"""Longer side an exemplar is read at (enough for its colors; the cost does not grow with the upload)."""


def colorfulness(image: Image.Image) -> float:
    """Hasler-Suesstrunk colorfulness of ``image`` (any mode; 0 for gray), read on a thumbnail."""
    small = image.convert("RGB")
    small.thumbnail((THUMBNAIL, THUMBNAIL))
    rgb = np.asarray(small, dtype=np.float64)  # [H, W, 3]
    rg = rgb[..., 0] - rgb[..., 1]
    yb = 0.5 * (rgb[..., 0] + rgb[..., 1]) - rgb[..., 2]
    return float(np.hypot(rg.std(), yb.std()) + 0.3 * np.hypot(rg.mean(), yb.mean()))


def like_photos(crops: Sequence[Image.Image]) -> bool:
    """Whether a set's exemplar crops look like color photos: the median of their colorfulness at least
    ``COLOR_MIN`` and the median of their longer sides at least ``PHOTO_MIN_SIDE``."""
    if not crops:
        return False
    return (statistics.median(max(c.size) for c in crops) >= PHOTO_MIN_SIDE
            and statistics.median(colorfulness(c) for c in crops) >= COLOR_MIN)


def installed_photo_default(photo_default: str | None, installed: Sequence[str]) -> str | None:
    """The photo default (``QLOC_DEFAULT_PHOTO_BUNDLE``) when one is set and installed, else ``None``."""
    return photo_default if photo_default and photo_default in installed else None


def bundle_of_new_set(named: str | None, crops: Sequence[Image.Image], *, default: str, photo_default: str | None,
                      installed: Sequence[str]) -> str:
    """The bundle a new set is made with: ``named`` when the client gave one; else ``photo_default`` for crops that
    look like color photos when it is ``installed``; else ``default``."""
    if named is not None:
        return named
    photo = installed_photo_default(photo_default, installed)
    return photo if photo is not None and like_photos(crops) else default
