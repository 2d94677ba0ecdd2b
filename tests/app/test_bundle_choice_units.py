"""``app.bundle_choice``: the colorfulness and the mid-tones of an exemplar by value, whether a set's crops look like
photos, and the bundle a new set that names none gets."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
from PIL import Image
from skimage import data

from app.bundle_choice import (
    COLOR_MIN,
    MIDTONES_MIN,
    PHOTO_MIN_SIDE,
    THUMBNAIL,
    bundle_of_new_set,
    colorfulness,
    like_photos,
    midtones,
)
from models.data.types import exemplar_crops
from models.experiments.cmnist import cmnist


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


def grown(image: Image.Image, side: int = PHOTO_MIN_SIDE) -> Image.Image:
    """``image`` resized to a longer side of ``side`` pixels (nearest: its colors kept)."""
    w, h = image.size
    return image.resize((side, max(1, round(side * h / w))) if w >= h else (max(1, round(side * w / h)), side),
                        Image.Resampling.NEAREST)


def test_a_set_looks_like_color_photos_by_the_medians_of_its_crops_colors_and_sizes():
    gray = Image.new("RGB", (PHOTO_MIN_SIDE, 60), (90, 90, 90))
    color = grown(rgb([[(255, 0, 0), (0, 0, 255)]] * 2))
    barely = grown(rgb([[(100, 100, 100), (100, 100, 100 - 4)]]))  # yb = (0, 4): std 2, mean 2 -> 2.6
    assert colorfulness(barely) == pytest.approx(2 + 0.3 * 2)
    assert colorfulness(barely) < COLOR_MIN
    assert like_photos([color]) and like_photos([gray, color, color]) and like_photos([gray, color])  # 2: the mean
    assert not like_photos([gray]) and not like_photos([color, gray, gray]) and not like_photos([barely])
    exactly = grown(rgb([[(100, 100, 103), (100, 100, 97)]]))  # yb = (-3, 3): std 3, mean 0
    assert colorfulness(exactly) == COLOR_MIN == 3.0 and like_photos([exactly])  # the bar is inclusive
    assert not like_photos([])


def test_color_crops_smaller_than_a_photos_are_not_photos():
    """cMNIST-style objects in color (28-px crops of 84-px images) stay on the gray default: it answers them right."""
    color = rgb([[(255, 0, 0), (0, 0, 255)]] * 2)
    assert like_photos([grown(color, PHOTO_MIN_SIDE)]) and like_photos([grown(color, 400)])
    assert not like_photos([grown(color, PHOTO_MIN_SIDE - 1)]) and not like_photos([grown(color, 28)])
    tall = grown(rgb([[(255, 0, 0), (0, 0, 255)]]).transpose(Image.Transpose.ROTATE_90))  # the longer side counts
    assert tall.size == (PHOTO_MIN_SIDE // 2, PHOTO_MIN_SIDE) and like_photos([tall])
    assert like_photos([grown(color, 28), grown(color), grown(color, 900)])  # the median crop's side
    assert not like_photos([grown(color, 28), grown(color, 28), grown(color, 900)])


def test_the_bundle_of_a_new_set():
    photo, gray = [Image.new("RGB", (120, 90), (250, 10, 10))], [Image.new("L", (120, 90), 99)]
    small = [Image.new("RGB", (28, 28), (250, 10, 10))]
    choose = {"default": "digits", "photo_default": "photos", "installed": ["digits", "photos"]}
    assert bundle_of_new_set(None, photo, **choose) == "photos"
    assert bundle_of_new_set(None, gray, **choose) == "digits"
    assert bundle_of_new_set(None, small, **choose) == "digits"
    assert bundle_of_new_set(None, [Image.fromarray(data.camera())], **choose) == "photos"  # a gray photograph
    assert bundle_of_new_set("digits", photo, **choose) == "digits"
    assert bundle_of_new_set("other", gray, **choose) == "other"  # named: taken as given (unknown: the caller's 422)
    assert bundle_of_new_set(None, photo, **{**choose, "installed": ["digits"]}) == "digits"
    assert bundle_of_new_set(None, photo, **{**choose, "photo_default": ""}) == "digits"
    assert bundle_of_new_set(None, photo, **{**choose, "photo_default": None}) == "digits"


def gray(pixels: list[int]) -> Image.Image:
    return Image.fromarray(np.array([pixels], np.uint8), "L")


def test_midtones_is_the_share_of_pixels_in_the_middle_half_of_the_images_own_range():
    # 50 pixels: the 2nd and 98th percentiles are the darkest and the brightest (10 each), 0 and 200; the middle
    # half is (50, 150), ends excluded: 120 and 100 are in it, 50, 150, 20 and 180 are not
    image = gray([0] * 10 + [200] * 10 + [120] * 7 + [100] * 5 + [50, 150] * 4 + [20, 180] * 5)
    assert midtones(image) == pytest.approx(12 / 50)
    assert midtones(gray([v // 2 + 40 for v in [0] * 10 + [200] * 10 + [120] * 7 + [100] * 5 + [50, 150] * 4
                          + [20, 180] * 5])) == pytest.approx(12 / 50)  # any contrast, any brightness
    assert midtones(gray([90] * 30)) == 0.0  # one level: no tones
    assert midtones(gray([0, 255] * 20)) == 0.0  # two levels: strokes on a ground
    assert midtones(Image.new("RGB", (40, 30), (200, 30, 30))) == 0.0


def test_midtones_tell_photographs_from_strokes_in_gray_and_in_color_at_any_size():
    for photo in (data.camera(), data.chelsea(), data.coffee(), data.astronaut()):
        image = Image.fromarray(photo)
        small = image.copy()
        small.thumbnail((48, 48))
        for variant in (image, image.convert("L"), small):
            assert midtones(variant) > MIDTONES_MIN
    digits = [Image.fromarray((c[0].numpy() * 255).astype(np.uint8)) for c in exemplar_crops(cmnist(7, "train", 5))]
    assert max(midtones(d) for d in digits) < MIDTONES_MIN / 2 < MIDTONES_MIN
    assert max(midtones(d.resize((84, 84), Image.Resampling.BICUBIC)) for d in digits) < MIDTONES_MIN  # enlarged


def test_a_set_of_gray_or_small_photographs_looks_like_photos_and_strokes_in_color_do_not():
    camera = Image.fromarray(data.camera()).resize((120, 120))  # gray, colorfulness 0
    thumb = Image.fromarray(data.chelsea())
    thumb.thumbnail((48, 48))  # in color, under PHOTO_MIN_SIDE
    assert colorfulness(camera) == 0 and max(thumb.size) < PHOTO_MIN_SIDE
    assert like_photos([camera]) and like_photos([thumb]) and like_photos([camera, thumb, Image.new("L", (9, 9))])
    strokes = np.zeros((200, 200, 3), np.uint8)
    strokes[40:160, 90:110, 0] = strokes[90:110, 40:160, 2] = 250  # a red and a blue bar: in color, photo-sized
    assert colorfulness(Image.fromarray(strokes)) > COLOR_MIN and midtones(Image.fromarray(strokes)) < MIDTONES_MIN
    assert like_photos([Image.fromarray(strokes)])  # by the color rule, as before
    assert not like_photos([Image.fromarray(strokes).resize((50, 50), Image.Resampling.NEAREST)])  # 50 px: not
    assert not like_photos([Image.new("L", (9, 9)), Image.new("L", (9, 9)), camera])  # the median crop is flat


def test_midtones_reads_gray_levels_the_darkest_and_brightest_two_percent_left_out():
    # in color, the gray levels count (ITU-R 601 luma): red 76 and green 150 sit in the middle of black..white, though
    # every channel of every pixel is 0 or 255
    colors = [(0, 0, 0)] * 10 + [(255, 255, 255)] * 10 + [(255, 0, 0)] * 3 + [(0, 255, 0)] * 2
    assert midtones(rgb([colors])) == pytest.approx(5 / 25)
    # the range is the 2nd to 98th percentile (numpy's linear interpolation), the rest of the thumbnail counted
    camera = Image.fromarray(data.camera())  # 512 x 512: read at 64 x 64
    small = camera.copy()
    small.thumbnail((THUMBNAIL, THUMBNAIL))
    pixels = np.asarray(small, np.float64)
    lo, hi = np.percentile(pixels, 2), np.percentile(pixels, 98)
    assert (lo, hi) != (np.percentile(pixels, 3), np.percentile(pixels, 99))
    expected = float(((pixels > lo + (hi - lo) / 4) & (pixels < lo + 3 * (hi - lo) / 4)).mean())
    assert midtones(camera) == pytest.approx(expected, abs=1e-12)


def test_a_flat_crop_has_no_midtones_and_no_division_by_zero():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 0 / 0 would warn
        assert midtones(Image.new("L", (30, 20), 77)) == 0.0


def test_the_midtones_bar_is_inclusive():
    exactly = gray([0] * 10 + [200] * 10 + [120] * 10 + [20] * 20)  # 10 of 50 in the middle half: 0.2
    assert midtones(exactly) == MIDTONES_MIN == 0.2
    assert colorfulness(exactly) == 0 and max(exactly.size) < PHOTO_MIN_SIDE  # only the mid-tones can say photo
    assert like_photos([exactly])
    assert not like_photos([gray([0] * 10 + [200] * 10 + [120] * 9 + [20] * 21)])  # 0.18
