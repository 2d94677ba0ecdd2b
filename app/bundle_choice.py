"""Which bundle a new exemplar set gets when the client names none: the server's default, or for exemplars in
color the color default.

The default bundle (``QLOC_DEFAULT_BUNDLE``, ``mnist-general``) reads gray 84 x 84 images: a set of color photo
crops made on it answers nothing right (CorLoc 0.0 on the real-photo benchmark's val and test photos through the
API, against 58.3 / 52.5 on ``photo-general``: BENCHMARKS.md, "The bundle of a set that names none"). So a set
whose exemplars are in color gets ``QLOC_DEFAULT_COLOR_BUNDLE`` (``photo-general``) when it is installed; gray
exemplars, the cMNIST bundles' kind of image, keep the default as before. A client that names ``bundle`` always
gets that one.

"In color" is the colorfulness of Hasler and Suesstrunk (2003): ``sqrt(std(rg)^2 + std(yb)^2) + 0.3 *
sqrt(mean(rg)^2 + mean(yb)^2)`` with ``rg = R - G`` and ``yb = (R + G) / 2 - B`` on 0-255 pixels. A gray image
scores 0 (also as an RGB JPEG: its chroma planes are flat); the real-photo benchmark's 31 exemplar crops score
11.9-101, its 121 val and test photographs 4.7-129 (median 41) but for two gray ones (0), a sepia-toned photo about
35. The set is in color when the median of its exemplars' colorfulness is at least ``COLOR_MIN``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np
from PIL import Image

COLOR_MIN = 3.0
"""Colorfulness from which an exemplar is in color: above any gray image's (0), below the least colorful color
photograph of the real-photo benchmark (4.7, swans on gray water)."""
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


def in_color(crops: Sequence[Image.Image]) -> bool:
    """Whether a set of exemplar crops is in color: the median of their colorfulness is at least ``COLOR_MIN``."""
    return bool(crops) and statistics.median(colorfulness(c) for c in crops) >= COLOR_MIN


def bundle_of_new_set(named: str | None, crops: Sequence[Image.Image], *, default: str, color_default: str | None,
                      installed: Sequence[str]) -> str:
    """The bundle a new set is made with: ``named`` when the client gave one; else ``color_default`` for crops in
    color when it is ``installed``; else ``default``."""
    if named is not None:
        return named
    if color_default and color_default in installed and in_color(crops):
        return color_default
    return default
