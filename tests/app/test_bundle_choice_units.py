"""``app.bundle_choice``: the colorfulness of an exemplar, by value, and the bundle a new set that names none gets."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from skimage import data

from app.bundle_choice import COLOR_MIN, THUMBNAIL, bundle_of_new_set, colorfulness, in_color


def rgb(pixels: list[list[tuple[int, int, int]]]) -> Image.Image:
    return Image.fromarray(np.array(pixels, np.uint8), "RGB")


def reference(image: Image.Image) -> float:
    """Hasler and Suesstrunk's formula written out pixel by pixel (numbers from 0 to 255)."""
    pixels = np.asarray(image.convert("RGB")).reshape(-1, 3).tolist()
    rg = [r - g for r, g, _ in pixels]
    yb = [(r + g) / 2 - b for r, g, b in pixels]

    def mean(v: list[float]) -> float:
        return sum(v) / len(v)

    def std(v: list[float]) -> float:
        m = mean(v)
        return (sum((x - m) ** 2 for x in v) / len(v)) ** 0.5

    return (std(rg) ** 2 + std(yb) ** 2) ** 0.5 + 0.3 * (mean(rg) ** 2 + mean(yb) ** 2) ** 0.5


def test_colorfulness_is_hasler_and_suesstrunks_on_small_images():
    red_blue = rgb([[(255, 0, 0), (0, 0, 255)]])
    # rg = (255, 0): std 127.5, mean 127.5; yb = (127.5, -255): std 191.25, mean -63.75
    expected = (127.5 ** 2 + 191.25 ** 2) ** 0.5 + 0.3 * (127.5 ** 2 + 63.75 ** 2) ** 0.5
    assert colorfulness(red_blue) == pytest.approx(expected) == pytest.approx(reference(red_blue))
    tinted = rgb([[(120, 100, 80)] * 3, [(90, 100, 110)] * 3])
    assert colorfulness(tinted) == pytest.approx(reference(tinted))
    flat = rgb([[(10, 200, 30)]])  # one color: no spread, only the mean's term
    assert colorfulness(flat) == pytest.approx(0.3 * (190 ** 2 + 75 ** 2) ** 0.5)


def test_a_large_image_is_read_on_a_thumbnail_of_its_colors():
    cat = Image.fromarray(data.chelsea())  # 451 x 300
    small = cat.copy()
    small.thumbnail((THUMBNAIL, THUMBNAIL))
    assert max(small.size) == THUMBNAIL
    assert colorfulness(cat) == pytest.approx(reference(small))
    assert 30 < colorfulness(cat) < 45  # a brown cat on a brown carpet: moderately colorful


@pytest.mark.parametrize("mode", ["L", "1", "LA", "I", "F", "RGB", "RGBA", "P"])
def test_a_gray_image_is_not_colorful_in_any_mode(mode):
    gray = Image.fromarray(data.camera()).resize((90, 60))
    assert colorfulness(gray.convert(mode)) == 0.0


def test_a_gray_image_saved_as_an_rgb_jpeg_stays_gray_and_a_sepia_print_is_in_color():
    buf = io.BytesIO()
    Image.fromarray(data.camera()).convert("RGB").save(buf, "JPEG", quality=30)
    assert colorfulness(Image.open(io.BytesIO(buf.getvalue()))) < 0.5 < COLOR_MIN
    gray = np.asarray(Image.fromarray(data.camera()).resize((64, 64)), np.float64) / 255
    sepia = np.stack([gray, gray * 0.85, gray * 0.65], -1)
    assert colorfulness(Image.fromarray((sepia * 255).astype(np.uint8))) > 10 * COLOR_MIN


def test_a_set_is_in_color_by_the_median_of_its_crops():
    gray = Image.new("RGB", (8, 8), (90, 90, 90))
    color = rgb([[(255, 0, 0), (0, 0, 255)]] * 2)
    barely = rgb([[(100, 100, 100), (100, 100, 100 - 4)]])  # yb = (0, 4): std 2, mean 2 -> 2.6
    assert colorfulness(barely) == pytest.approx(2 + 0.3 * 2)
    assert colorfulness(barely) < COLOR_MIN
    assert in_color([color]) and in_color([gray, color, color]) and in_color([gray, color])  # median of 2: the mean
    assert not in_color([gray]) and not in_color([color, gray, gray]) and not in_color([barely])
    exactly = rgb([[(100, 100, 103), (100, 100, 97)]])  # yb = (-3, 3): std 3, mean 0
    assert colorfulness(exactly) == COLOR_MIN == 3.0 and in_color([exactly])  # the bar is inclusive
    assert not in_color([])


def test_the_bundle_of_a_new_set():
    color, gray = [Image.new("RGB", (4, 4), (250, 10, 10))], [Image.new("L", (4, 4), 99)]
    choose = {"default": "digits", "color_default": "photos", "installed": ["digits", "photos"]}
    assert bundle_of_new_set(None, color, **choose) == "photos"
    assert bundle_of_new_set(None, gray, **choose) == "digits"
    assert bundle_of_new_set("digits", color, **choose) == "digits"
    assert bundle_of_new_set("other", gray, **choose) == "other"  # named: taken as given (unknown: the caller's 422)
    assert bundle_of_new_set(None, color, **{**choose, "installed": ["digits"]}) == "digits"
    assert bundle_of_new_set(None, color, **{**choose, "color_default": ""}) == "digits"
    assert bundle_of_new_set(None, color, **{**choose, "color_default": None}) == "digits"
