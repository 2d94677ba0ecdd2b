"""``benchmarks/real_photo_pairs.py``: pairs of photos of different classes, stitched with their boxes mapped."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from models.data.realphotos import RealPhoto

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rpp():
    sys.path.insert(0, str(ROOT))
    from benchmarks import real_photo_pairs
    return real_photo_pairs


def photo(w: int, h: int, box, cls: str, colour) -> RealPhoto:
    arr = np.zeros((h, w, 3), np.uint8)
    x1, y1, x2, y2 = box
    arr[y1:y2, x1:x2] = colour
    return RealPhoto(Image.fromarray(arr), tuple(float(v) for v in box), cls, "val", f"{cls}-{w}x{h}.png")


@pytest.mark.parametrize("sizes,stacked", [(((400, 200), (300, 200)), "vertically"),
                                           (((200, 400), (300, 400)), "horizontally")])
def test_stitch_maps_each_box_onto_its_object(rpp, sizes, stacked):
    a = photo(*sizes[0], (40, 20, 120, 100), "cats", (255, 0, 0))
    b = photo(*sizes[1], (10, 50, 90, 150), "boats", (0, 0, 255))
    image, boxes = rpp.stitch(a, b, side=320)
    long_side = image.height if stacked == "vertically" else image.width
    short_side = image.width if stacked == "vertically" else image.height
    assert short_side == 320 and long_side > 320  # stacked along the photos' short side
    arr = np.asarray(image).astype(int)
    for (x1, y1, x2, y2), channel in zip(boxes, (0, 2), strict=True):
        inside = arr[round(y1) + 2:round(y2) - 2, round(x1) + 2:round(x2) - 2, channel]
        assert inside.size and inside.min() > 200  # the object's colour fills its mapped box
        mask = arr[..., channel] > 128
        assert mask.sum() <= (x2 - x1 + 2) * (y2 - y1 + 2)  # and is nowhere else


def test_pairs_join_photos_of_different_classes_repeatably(rpp):
    photos = [photo(100, 80, (0, 0, 10, 10), c, (9, 9, 9)) for c in ("a", "a", "b", "c", "c", "c")]
    pairs = rpp.pairs(photos, seed=0)
    assert len(pairs) == len(photos)
    assert all(p.cls != q.cls for p, q in pairs)
    assert all(any(p is x for x in pair) for p, pair in zip(photos, pairs, strict=True))  # each photo is in its pair
    assert [(p.file_name, q.file_name) for p, q in pairs] == [(p.file_name, q.file_name)
                                                              for p, q in rpp.pairs(photos, seed=0)]
