"""Decoding uploads: PNG, JPEG and WebP in any mode, everything else refused with the reason."""

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps
from service_fixtures import jpeg_bytes, png_bytes

from app.images import ORIENTATION, ImageRejected, UploadLimits, decode_image, header_pixels, open_stored

LIMITS = UploadLimits(max_file_bytes=1_000_000, max_image_pixels=100_000)


def encode(img, fmt):
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA", "LA", "P", "1", "I;16"])
def test_png_modes(mode):
    im = decode_image(encode(Image.new(mode, (30, 20)), "PNG"), filename="a.png", declared_type="image/png",
                      limits=LIMITS)
    assert (im.width, im.height, im.format, im.content_type) == (30, 20, "PNG", "image/png")


def test_jpeg_and_undeclared_type():
    im = decode_image(jpeg_bytes(60, 40), filename=None, declared_type=None, limits=LIMITS)
    assert (im.width, im.height, im.format, im.ext) == (60, 40, "JPEG", ".jpg")


@pytest.mark.parametrize("data,declared,reason", [
    (b"", "image/png", "bad_image"),
    (b"not an image", "image/png", "unsupported_type"),
    (png_bytes(50, 50)[:60], "image/png", "bad_image"),
    (png_bytes(50, 50), "text/plain", "unsupported_type"),
    (encode(Image.new("L", (5, 5)), "GIF"), "image/png", "unsupported_type"),
    (encode(Image.new("L", (5, 5)), "BMP"), None, "unsupported_type"),
    (b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\x00" * 32, None, "unsupported_type"),  # RIFF, but a sound
    (encode(Image.new("RGB", (20, 20)), "WEBP")[:30], "image/webp", "bad_image"),  # a WebP cut short
    (png_bytes(400, 300, square=False), "image/png", "too_large"),
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 1_000_001, "image/png", "too_large"),
])
def test_rejections(data, declared, reason):
    with pytest.raises(ImageRejected) as e:
        decode_image(data, filename="x", declared_type=declared, limits=LIMITS)
    assert e.value.reason == reason



def _encoded(fmt):
    return lambda: encode(Image.new("RGB", (16, 16)), fmt)


@pytest.mark.parametrize("make,named", [
    (_encoded("GIF"), "GIF"), (_encoded("BMP"), "BMP"), (_encoded("TIFF"), "TIFF"),
    (_encoded("ICO"), "ICO"), (_encoded("PDF"), "PDF"), (_encoded("JPEG2000"), "JPEG 2000"),
    (lambda: b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + b"\x00" * 40, "HEIC"),  # a phone's photo
    (lambda: b"\x00\x00\x00\x1cftypavif\x00\x00\x00\x00avifmif1" + b"\x00" * 40, "AVIF"),
    (lambda: b'\xef\xbb\xbf<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg"/>', "SVG"),
])
def test_an_image_format_not_taken_is_named_in_its_refusal(make, named):
    """A format that is an image, but not one taken, is refused naming it (what to convert from), not as 'not an
    image'; anything else keeps the plain refusal."""
    with pytest.raises(ImageRejected) as e:
        decode_image(make(), filename="photo", declared_type=None, limits=LIMITS)
    assert e.value.reason == "unsupported_type"
    assert e.value.detail == (f"photo: {named} format; only PNG, JPEG or WebP images are accepted: convert it to "
                              "one of them first"), e.value.detail
    with pytest.raises(ImageRejected) as e:
        decode_image(b"<html><body>not a picture</body></html>", filename="page", declared_type=None, limits=LIMITS)
    assert e.value.detail == "page: not a PNG, JPEG or WebP image"


# --- decoded upright and small: EXIF orientation, downscaling while decoding, animated PNGs

def scene(width: int, height: int, box: tuple[int, int, int, int], seed: int = 0) -> Image.Image:
    """An upright RGB scene: dark noise with a bright rectangle at ``box``."""
    rng = np.random.default_rng(seed)
    arr = (rng.random((height, width, 3)) * 60).astype(np.uint8)
    x1, y1, x2, y2 = box
    arr[y1:y2, x1:x2] = (250, 240, 60)
    return Image.fromarray(arr)


def rotated_jpeg(upright: Image.Image, orientation: int = 6, quality: int = 95) -> bytes:
    """A JPEG whose stored pixels are ``upright`` turned so that a viewer applying ``orientation`` shows it upright
    (6: stored turned 90 degrees counter-clockwise, shown turned back clockwise)."""
    inverse = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    buf = io.BytesIO()
    upright.transpose(inverse[orientation]).save(buf, "JPEG", quality=quality, exif=exif.tobytes())
    return buf.getvalue()


def bright_box(img: Image.Image) -> tuple[int, int, int, int]:
    """The bounding box of the bright pixels (the rectangle of ``scene``), in ``img``'s pixels."""
    arr = np.asarray(img.convert("L"))
    ys, xs = np.nonzero(arr > 150)
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1


BIG = UploadLimits(max_file_bytes=50_000_000, max_image_pixels=20_000_000)


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_is_applied(orientation):
    box = (20, 10, 50, 30)  # in the upright frame: 120 x 80
    data = rotated_jpeg(scene(120, 80, box), orientation)
    stored = Image.open(io.BytesIO(data))
    assert stored.size == ((80, 120) if orientation in (6, 8) else (120, 80))  # really stored turned
    im = decode_image(data, filename="phone.jpg", declared_type="image/jpeg", limits=LIMITS)
    assert (im.width, im.height) == (120, 80) and im.image.size == (120, 80)
    assert bright_box(im.image) == box
    assert np.array_equal(np.asarray(im.image), np.asarray(ImageOps.exif_transpose(stored)))  # PIL's own answer


def test_a_box_in_the_upright_frame_cuts_the_object_from_a_rotated_jpeg():
    box = (30, 20, 90, 60)
    data = rotated_jpeg(scene(400, 300, box, seed=1), 6)
    im = decode_image(data, filename=None, declared_type=None, limits=BIG, max_side=100)
    assert (im.width, im.height) == (400, 300) and im.image.size == (100, 75)
    crop = im.crop(box, max_side=100)  # the box is smaller than max_side: cut at full resolution
    assert crop.size == (60, 40)
    assert np.asarray(crop.convert("L")).mean() > 150  # the bright rectangle, not the dark noise


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_large_images_are_decoded_downscaled_and_boxes_map_back(fmt):
    box = (1000, 600, 1800, 1000)
    data = encode(scene(4000, 2000, box, seed=2), fmt)
    im = decode_image(data, filename="big", declared_type=None, limits=BIG, max_side=500)
    assert im.image.size == (500, 250) and (im.width, im.height) == (4000, 2000)
    assert im.scale == (8.0, 8.0)
    found = bright_box(im.image)
    assert all(abs(a - b) <= 1 for a, b in zip(found, (125, 75, 225, 125), strict=True))
    assert im.box_to_full((125, 75, 225, 125)) == box and im.box_to_decoded(box) == (125, 75, 225, 125)
    # A crop larger than max_side is cut from a decode just fine enough: its longer side about max_side.
    crop = im.crop((0, 0, 4000, 2000), max_side=500)
    assert crop.size == (500, 250)
    crop = im.crop(box, max_side=400)
    assert crop.size == (400, 200)
    crop = im.crop(box, max_side=None)
    assert crop.size == (800, 400)


def test_small_images_are_untouched():
    data = encode(Image.new("P", (60, 40), 3), "PNG")
    im = decode_image(data, filename=None, declared_type=None, limits=LIMITS, max_side=60)
    assert im.image.mode == "P" and im.image.size == (60, 40) and im.scale == (1.0, 1.0)


@pytest.mark.parametrize("mode", ["P", "1", "LA", "RGBA", "I;16", "CMYK"])
def test_every_mode_downscales(mode):
    img = Image.new(mode, (300, 200))
    if mode == "P":
        img.info["transparency"] = 0
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    im = decode_image(encode(img, fmt), filename=None, declared_type=None, limits=LIMITS, max_side=90)
    assert im.image.size == (90, 60) and (im.width, im.height) == (300, 200)
    assert im.image.mode not in ("P", "1")  # resampled in a mode that interpolates


def test_a_16_bit_grayscale_png_is_scaled_to_8_bits_not_clipped():
    """A full-range 16-bit PNG (scientific and medical cameras write them) is seen as its 8-bit version, v * 257 ->
    v, at full size, downscaled, and stored then decoded again; PIL's own conversion would make every value above
    255 white."""
    rng = np.random.default_rng(0)
    eight = (rng.random((40, 60)) * 255).astype(np.uint8)
    sixteen = encode(Image.fromarray(eight.astype(np.uint16) * 257), "PNG")
    assert Image.open(io.BytesIO(sixteen)).mode.startswith("I")
    im = decode_image(sixteen, filename="d.png", declared_type="image/png", limits=LIMITS)
    assert im.image.mode == "L" and np.array_equal(np.asarray(im.image), eight)
    assert np.array_equal(np.asarray(open_stored(im.data).image), eight)
    small = decode_image(sixteen, filename="d.png", declared_type="image/png", limits=LIMITS, max_side=30)
    ref = decode_image(encode(Image.fromarray(eight), "PNG"), filename="e.png", declared_type="image/png",
                       limits=LIMITS, max_side=30)
    assert small.image.size == (30, 20) and np.array_equal(np.asarray(small.image), np.asarray(ref.image))


def test_header_pixels_reads_only_the_header():
    data = encode(scene(300, 200, (1, 1, 5, 5)), "JPEG")
    assert header_pixels(io.BytesIO(data[:2000])) == 60_000  # the header alone is enough
    assert header_pixels(io.BytesIO(b"GIF89a....")) is None
    assert header_pixels(io.BytesIO(b"\x89PNG\r\n\x1a\n broken")) is None


def apng(frames: int) -> bytes:
    imgs = [Image.new("RGB", (20, 20), (60 * i, 0, 0)) for i in range(frames)]
    buf = io.BytesIO()
    imgs[0].save(buf, "PNG", save_all=True, append_images=imgs[1:])
    return buf.getvalue()


def test_animated_png_is_refused():
    with pytest.raises(ImageRejected) as e:
        decode_image(apng(3), filename="anim.png", declared_type="image/png", limits=LIMITS)
    assert e.value.reason == "unsupported_type"
    assert "animated" in e.value.detail and "3 frames" in e.value.detail and "still PNG" in e.value.detail
    assert decode_image(apng(1), filename=None, declared_type=None, limits=LIMITS).image.size == (20, 20)


@pytest.mark.parametrize("lossless", [False, True])
def test_webp_is_decoded_downscaled_upright_and_stored_as_webp(lossless):
    box = (200, 100, 360, 180)
    img = scene(800, 400, box, seed=3)
    exif = Image.Exif()
    exif[ORIENTATION] = 6
    buf = io.BytesIO()
    img.transpose(Image.Transpose.ROTATE_90).save(buf, "WEBP", lossless=lossless, quality=95, exif=exif.tobytes())
    data = buf.getvalue()
    assert header_pixels(io.BytesIO(data)) == 320_000
    im = decode_image(data, filename="p.webp", declared_type="image/webp", limits=BIG, max_side=200)
    assert (im.format, im.content_type, im.ext) == ("WEBP", "image/webp", ".webp")
    assert (im.width, im.height) == (800, 400) and im.image.size == (200, 100)  # upright, downscaled
    found = im.box_to_full(bright_box(im.image))
    assert all(abs(a - b) <= 8 for a, b in zip(found, box, strict=True))
    stored = open_stored(data, max_side=200)
    assert stored.format == "WEBP" and np.array_equal(np.asarray(stored.image), np.asarray(im.image))


def test_animated_webp_is_refused():
    frames = [Image.new("RGB", (20, 20), (60 * i, 0, 0)) for i in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, "WEBP", save_all=True, append_images=frames[1:])
    with pytest.raises(ImageRejected) as e:
        decode_image(buf.getvalue(), filename="anim.webp", declared_type="image/webp", limits=LIMITS)
    assert e.value.reason == "unsupported_type" and "animated WebP" in e.value.detail and "still WebP" in e.value.detail


def test_stored_images_decode_as_uploads_do():
    data = rotated_jpeg(scene(120, 80, (20, 10, 50, 30)), 6)
    up = decode_image(data, filename=None, declared_type=None, limits=LIMITS, max_side=60)
    stored = open_stored(data, max_side=60)
    assert (stored.width, stored.height, stored.format) == (120, 80, "JPEG")
    assert np.array_equal(np.asarray(stored.image), np.asarray(up.image))


def test_decoding_a_large_jpeg_never_holds_it_at_full_resolution(tmp_path):
    """Peak memory of one decode, in a fresh process: a 4000x4000 RGB JPEG is 48 MB decoded at full
    resolution; downscaled by the decoder (1/4 scale, then 896 px) it needs a few MB."""
    path = tmp_path / "big.jpg"
    scene(4000, 4000, (100, 100, 900, 900), seed=3).save(path, "JPEG", quality=90)
    code = textwrap.dedent(f"""
        import re, sys
        from app.images import UploadLimits, decode_image

        def peak_kib():  # this process's high-water RSS (ru_maxrss would include the parent's, across exec)
            return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))

        data = open({str(path)!r}, "rb").read()
        limits = UploadLimits(50_000_000, 20_000_000)
        decode_image(data, filename=None, declared_type=None, limits=limits, max_side=64)  # warm up
        before = peak_kib()
        im = decode_image(data, filename=None, declared_type=None, limits=limits, max_side=int(sys.argv[1]))
        print((peak_kib() - before) // 1024, im.image.size)
    """)
    runs = {}
    for side in ("896", "4000"):
        out = subprocess.run([sys.executable, "-c", code, side], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parents[2]).stdout.split(maxsplit=1)
        runs[side] = int(out[0]), out[1].strip()
    assert runs["896"][1] == "(896, 896)" and runs["4000"][1] == "(4000, 4000)"
    assert runs["4000"][0] >= 40  # MiB: the full-resolution decode, which the measure does see
    assert runs["896"][0] <= 16, runs


def test_a_truncated_jpeg_is_refused_when_decoded_downscaled_too():
    data = encode(scene(4000, 2000, (10, 10, 90, 90), seed=4), "JPEG")
    with pytest.raises(ImageRejected) as e:
        decode_image(data[: len(data) // 2], filename="cut.jpg", declared_type=None, limits=BIG, max_side=500)
    assert e.value.reason == "bad_image"


def test_a_bilevel_image_is_read_descreened_at_its_full_resolution():
    """A 1-bit (dithered) image becomes the grays its dots stand for: a uniform 25 % gray dithered reads back near
    25 % everywhere, not 0 / 255; its size and any other mode's pixels are as before."""
    gray = Image.new("L", (64, 48), 64)
    dithered = encode(gray.convert("1"), "PNG")  # Floyd-Steinberg
    im = decode_image(dithered, filename="a.png", declared_type="image/png", limits=LIMITS)
    arr = np.asarray(im.image, dtype=np.float32)
    assert im.image.mode == "L" and (im.width, im.height) == (64, 48)
    assert len(np.unique(arr)) > 8 and abs(arr[8:-8, 8:-8].mean() - 64) < 8 and arr[8:-8, 8:-8].std() < 40
    assert np.asarray(Image.open(io.BytesIO(dithered)).convert("L")).std() > 90  # the raw dots: 0 and 255
    plain = np.asarray(decode_image(encode(gray, "PNG"), filename="b.png", declared_type="image/png",
                                    limits=LIMITS).image)
    assert (plain == 64).all()  # an 8-bit gray image is untouched
    stored = open_stored(dithered)  # the worker reads the stored file the same way
    assert np.array_equal(np.asarray(stored.image), np.asarray(im.image))
