"""Decoding an upload pixel for pixel: each mode downscaled against Pillow's own conversion and resize, the
decoder's draft asked for exactly when it helps, bilevel images descreened unless they carry a colour key, every
EXIF orientation, the fit of a size, box rounding and mapping, crops, header reads and the names of formats not
taken. No HTTP: ``app.images`` alone, against Pillow called plainly."""

from __future__ import annotations

import io
import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFilter, ImageOps, JpegImagePlugin

from app.images import (
    BILEVEL_SIGMA,
    ORIENTATION,
    DecodedImage,
    ImageRejected,
    UploadLimits,
    decode_image,
    fit,
    header_pixels,
    open_stored,
    other_format,
    round_box,
    sniff_format,
)

LIMITS = UploadLimits(max_file_bytes=20_000_000, max_image_pixels=20_000_000)


def encode(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def noise(mode: str, size: tuple[int, int], seed: int = 0) -> Image.Image:
    """An image of ``mode`` with random content (a palette image: random indices into a random palette)."""
    rng = np.random.default_rng(seed)
    w, h = size
    if mode == "P":
        img = Image.fromarray(rng.integers(0, 16, (h, w), dtype=np.uint8), "L").convert("P")
        img.putpalette(rng.integers(0, 256, 16 * 3, dtype=np.uint8).tolist())
        return img
    if mode == "1":
        return Image.fromarray(rng.random((h, w)) > 0.5)
    bands = len(Image.new(mode, (1, 1)).getbands())
    arr = rng.integers(0, 256, (h, w, bands) if bands > 1 else (h, w), dtype=np.uint8)
    return Image.fromarray(arr, mode)


def decode(data: bytes, max_side: int | None = None) -> DecodedImage:
    return decode_image(data, filename="a", declared_type=None, limits=LIMITS, max_side=max_side)


def pixels(img: Image.Image) -> np.ndarray:
    return np.asarray(img)


# ---- modes, downscaled --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "key", "as_mode"), [
    ("L", False, "L"), ("RGB", False, "RGB"), ("RGBA", False, "RGBA"), ("LA", False, "LA"),
    ("P", False, "RGB"),  # a palette resampled would pick nearest pixels: its colours first
    ("P", True, "RGBA"),  # a palette's colour key becomes alpha, or it would not survive the resampling
    ("L", True, "RGBA"), ("RGB", True, "RGBA"), ("1", True, "RGBA")])
def test_each_mode_is_downscaled_in_the_mode_that_keeps_its_colours_and_transparency(mode, key, as_mode):
    img = noise(mode, (300, 200), seed=1)
    kw = {"transparency": 0 if mode in ("P", "L", "1") else (0, 0, 0)} if key else {}
    data = encode(img, "PNG", **kw)
    opened = Image.open(io.BytesIO(data))
    assert ("transparency" in opened.info) == key
    expected = opened.convert(as_mode).resize((90, 60), Image.Resampling.BICUBIC, reducing_gap=2.0)
    im = decode(data, max_side=90)
    assert im.image.mode == as_mode and (im.width, im.height) == (300, 200)
    assert np.array_equal(pixels(im.image), pixels(expected))


def test_a_large_reduction_goes_through_pillows_reducing_gap():
    img = noise("RGB", (2000, 1000), seed=2)
    data = encode(img)
    im = decode(data, max_side=100)
    expected = img.resize((100, 50), Image.Resampling.BICUBIC, reducing_gap=2.0)
    assert np.array_equal(pixels(im.image), pixels(expected))
    assert not np.array_equal(pixels(im.image), pixels(img.resize((100, 50), Image.Resampling.BICUBIC)))


def test_a_bilevel_image_is_descreened_at_its_full_resolution_unless_it_has_a_colour_key():
    img = noise("1", (64, 48), seed=3)
    im = decode(encode(img))
    expected = img.convert("L").filter(ImageFilter.GaussianBlur(BILEVEL_SIGMA))
    assert im.image.mode == "L" and np.array_equal(pixels(im.image), pixels(expected))
    keyed = decode(encode(img, transparency=0))  # its 0s are transparent: no grays to recover
    assert keyed.image.mode == "1" and np.array_equal(pixels(keyed.image), pixels(img))


# ---- the JPEG decoder's draft -------------------------------------------------------------------------------------


@pytest.fixture
def drafts(monkeypatch):
    """The drafts asked of Pillow's JPEG decoder: (mode, size) per call."""
    asked: list[tuple[str, tuple[int, int]]] = []
    real = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        asked.append((mode, size))
        return real(self, mode, size)

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    return asked


def test_a_large_jpeg_is_drafted_to_the_target_size_in_its_own_mode(drafts):
    for mode in ("RGB", "L"):
        data = encode(noise(mode, (800, 600), seed=4), "JPEG")
        before = len(drafts)
        im = decode(data, max_side=90)
        assert drafts[before:] == [(mode, (90, 68))] and im.image.size == (90, 68)  # one draft per decode
        ref = Image.open(io.BytesIO(data))
        ref.draft(mode, (90, 68))  # the decoder's 1/8 scale (100 x 75: never below the target), then the resize
        assert ref.size == (100, 75)
        expected = ref.convert(mode).resize((90, 68), Image.Resampling.BICUBIC, reducing_gap=2.0)
        assert np.array_equal(pixels(im.image), pixels(expected))


def test_no_draft_is_asked_of_an_image_decoded_at_its_own_size_or_not_a_jpeg(drafts, monkeypatch):
    data = encode(noise("RGB", (120, 80)), "JPEG")
    decode(data, max_side=120)
    decode(data, max_side=None)
    asked_png = []
    real = Image.Image.draft
    monkeypatch.setattr(Image.Image, "draft", lambda self, mode, size: (asked_png.append(size), real(self, mode,
                                                                                                      size))[1])
    decode(encode(noise("RGB", (400, 300))), max_side=100)
    assert drafts == [] and asked_png == []


# ---- EXIF orientation ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_exif_orientation_is_shown_as_a_viewer_shows_it(orientation):
    stored = noise("RGB", (60, 40), seed=5)
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    data = encode(stored, "PNG", exif=exif.tobytes())
    im = decode(data)
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    assert np.array_equal(pixels(im.image), pixels(upright.convert("RGB")))
    assert (im.width, im.height) == ((40, 60) if orientation >= 5 else (60, 40))
    stored_again = open_stored(data)
    assert (stored_again.width, stored_again.height) == (im.width, im.height)


@pytest.mark.parametrize("value", [0, 9, 300])
def test_an_orientation_out_of_range_is_shown_as_stored(value):
    stored = noise("RGB", (60, 40), seed=6)
    exif = Image.Exif()
    exif[ORIENTATION] = value
    im = decode(encode(stored, "PNG", exif=exif.tobytes()))
    assert np.array_equal(pixels(im.image), pixels(stored)) and (im.width, im.height) == (60, 40)


def test_an_unreadable_exif_block_is_shown_as_stored(monkeypatch):
    stored = noise("RGB", (60, 40), seed=7)
    exif = Image.Exif()
    exif[ORIENTATION] = 6
    data = encode(stored, "PNG", exif=exif.tobytes())

    def broken(self):
        raise SyntaxError("not an EXIF block")

    monkeypatch.setattr(Image.Image, "getexif", broken)
    im = decode(data)
    assert np.array_equal(pixels(im.image), pixels(stored)) and (im.width, im.height) == (60, 40)


# ---- sizes, boxes, crops ------------------------------------------------------------------------------------------


def test_fit_keeps_the_aspect_and_at_least_a_pixel_a_side():
    assert fit((100, 50), 100) == (100, 50) and fit((100, 50), None) == (100, 50)  # already fits
    assert fit((101, 50), 100) == (100, 50) and fit((50, 400), 100) == (12, 100)
    assert fit((1000, 1), 100) == (100, 1) and fit((1, 1000), 10) == (1, 10)  # never below one pixel


def test_round_box_rounds_each_edge_to_the_nearest_pixel_edge_halves_up():
    assert round_box((0.49, 0.5, 10.5, 11.49)) == (0, 1, 11, 11)
    assert round_box((-0.5, 2.0, 3.2, 7.8)) == (0, 2, 3, 8)


def test_boxes_map_to_the_full_image_within_its_edges_and_back():
    im = decode(encode(noise("L", (400, 200))), max_side=100)
    assert im.scale == (4.0, 4.0)
    assert im.box_to_full((0.1, 0.2, 10.0, 20.0)) == pytest.approx((0.4, 0.8, 40.0, 80.0))
    assert im.box_to_full((-0.001, -0.002, 100.001, 50.002)) == (0.0, 0.0, 400.0, 200.0)  # clamped to the image
    assert im.box_to_full((0.0, 0.0, 0.1, 0.1)) == pytest.approx((0.0, 0.0, 0.4, 0.4))  # a tiny box stays tiny
    assert im.box_to_decoded((40.0, 80.0, 400.0, 200.0)) == (10.0, 20.0, 100.0, 50.0)


def test_a_crop_is_cut_at_full_resolution_when_the_box_fits_the_side_and_from_a_coarser_decode_otherwise():
    img = noise("L", (400, 200), seed=8)
    im = decode(encode(img), max_side=100)
    assert np.array_equal(pixels(im.crop((10, 20, 60, 120), max_side=100)), pixels(img.crop((10, 20, 60, 120))))
    assert np.array_equal(pixels(im.crop((10, 20, 110, 40), max_side=100)), pixels(img.crop((10, 20, 110, 40))))
    # a box 101 pixels tall is over the side: cut from a decode whose box is about 100 pixels
    assert im.crop((10, 20, 30, 121), max_side=100).size[1] == 100
    full = decode(encode(img))  # decoded at full resolution: the crop is cut from that image, not decoded again
    assert np.array_equal(pixels(full.crop((0, 0, 50, 50), max_side=None)), pixels(img.crop((0, 0, 50, 50))))
    bare = decode_image(encode(img), filename="a", declared_type=None, limits=LIMITS, max_side=100, keep_data=False)
    with pytest.raises(ValueError, match=r"^crop needs the image's bytes \(decode with keep_data\)$"):
        bare.crop((0, 0, 10, 10), max_side=100)


def test_stored_images_keep_their_name_and_format():
    png = open_stored(encode(noise("L", (30, 20))), filename="kept.png")
    assert png.filename == "kept.png" and png.format == "PNG" and png.content_type == "image/png"
    jpg = open_stored(encode(noise("RGB", (30, 20)), "JPEG"))
    assert jpg.format == "JPEG" and jpg.ext == ".jpg"


def test_a_stored_image_over_pillows_pixel_bound_still_opens(monkeypatch):
    """What was accepted once is read again without a warning turned error (the upload's limits applied then)."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        im = open_stored(encode(noise("L", (40, 30))))  # 1,200 pixels: over the bound, under twice it
    assert im.image.size == (40, 30)


# ---- headers and formats ------------------------------------------------------------------------------------------


def test_header_pixels_reads_the_stream_from_its_start_and_only_images_taken():
    data = encode(noise("RGB", (300, 200)), "JPEG")
    stream = io.BytesIO(data)
    stream.seek(100)  # wherever a caller left it
    assert header_pixels(stream) == 60_000
    ahead = io.BytesIO(b"prefix" + data)
    ahead.seek(6)
    assert header_pixels(ahead) is None  # what Pillow would open is not an image
    assert header_pixels(io.BytesIO(encode(noise("L", (7, 5))))) == 35
    assert header_pixels(io.BytesIO(encode(noise("RGB", (9, 4)), "WEBP"))) == 36
    assert header_pixels(io.BytesIO(encode(noise("RGB", (9, 4)), "GIF"))) is None
    assert header_pixels(io.BytesIO(b"\x89PNG\r\n\x1a\nbroken")) is None
    # a TIFF after a PNG signature is not read as a TIFF (only the formats taken are tried)
    assert header_pixels(io.BytesIO(b"\x89PNG\r\n\x1a\n" + encode(noise("L", (5, 5)), "TIFF"))) is None


@pytest.mark.parametrize(("data", "name"), [
    (b"\x00\x00\x00\x18ftypheic\x00\x00", "HEIC"),
    (b"\x00\x00\x00\x18ftypavif\x00\x00", "AVIF"),
    (b"<svg xmlns='http://www.w3.org/2000/svg'/>", "SVG"),
    (b"\xef\xbb\xbf  \n<SVG xmlns='http://www.w3.org/2000/svg'/>", "SVG"),
    (b"<?xml version='1.0'?>\n<svg/>", "SVG"),
    (b"<!DOCTYPE svg PUBLIC '-//W3C//DTD SVG 1.1//EN'>\n<svg/>", "SVG"),
    (b"<?xml version='1.0'?>\n<html/>", None),  # XML, not an SVG
    (b"\x00\x00\x00\x18ftypisom\x00\x00", None),  # an MP4 video: not an image brand
    (b"\x00\x00\x00\x18moovheic\x00\x00", None),  # the brand without its ftyp box
    (b"x" * 510 + b"<svg", None),  # text that is not XML
])
def test_formats_not_taken_are_named_by_their_first_bytes(data, name):
    assert other_format(data) == name


def test_an_svg_tag_past_the_first_512_bytes_is_not_read():
    assert other_format(b"<?xml version='1.0'?>" + b" " * 491 + b"<svg/>") is None
    assert other_format(b"<?xml version='1.0'?>" + b" " * 480 + b"<svg/>") == "SVG"


def test_sniff_format_names_what_it_takes_and_what_it_refuses():
    assert sniff_format(encode(noise("L", (4, 4))), "a") == "PNG"
    assert sniff_format(encode(noise("RGB", (4, 4)), "JPEG"), "a") == "JPEG"
    assert sniff_format(encode(noise("RGB", (4, 4)), "WEBP"), "a") == "WEBP"
    with pytest.raises(ImageRejected) as heic:
        sniff_format(b"\x00\x00\x00\x18ftypheic\x00\x00", "phone.heic")
    assert heic.value.reason == "unsupported_type" and str(heic.value) == heic.value.detail == (
        "phone.heic: HEIC format; only PNG, JPEG or WebP images are accepted: convert it to one of them first")
    with pytest.raises(ImageRejected, match=r"^notes.txt: not a PNG, JPEG or WebP image$"):
        sniff_format(b"hello", "notes.txt")


# ---- decode_image's checks, word for word -------------------------------------------------------------------------


def png_header(w: int, h: int) -> bytes:
    """A PNG that only claims its size (an empty IDAT): Pillow reads the header, never pixels."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def refused(data: bytes, *, name: str | None = "a.png", declared: str | None = None,
            limits: UploadLimits = LIMITS) -> ImageRejected:
    with pytest.raises(ImageRejected) as e:
        decode_image(data, filename=name, declared_type=declared, limits=limits)
    assert str(e.value) == e.value.detail
    return e.value


def test_the_declared_type_is_read_without_its_parameters_case_or_spaces():
    data = encode(noise("L", (8, 8)))
    for declared in ("image/PNG", " image/png ; charset=binary", "application/octet-stream", "", None):
        assert decode_image(data, filename="a", declared_type=declared, limits=LIMITS).format == "PNG"
    e = refused(data, declared="text/plain; charset=utf-8")
    assert (e.reason, e.detail) == ("unsupported_type", "a.png: content type 'text/plain' is not PNG, JPEG or WebP")


def test_byte_and_pixel_limits_hold_at_their_bound_and_refuse_past_it_by_name():
    data = encode(noise("L", (10, 8)))
    exact = UploadLimits(max_file_bytes=len(data), max_image_pixels=80)
    assert decode_image(data, filename=None, declared_type=None, limits=exact).image.size == (10, 8)
    e = refused(data, name=None, limits=UploadLimits(len(data) - 1, 80))
    assert (e.reason, e.detail) == ("too_large", f"upload: {len(data)} bytes, the limit is {len(data) - 1}")
    e = refused(data, limits=UploadLimits(len(data), 79))
    assert (e.reason, e.detail) == ("too_large", "a.png: 10x8 pixels, the limit is 79")
    e = refused(b"", name=None)
    assert (e.reason, e.detail) == ("bad_image", "upload: empty file")


@pytest.mark.parametrize("size", [(1, 5), (5, 1), (1, 1)])
def test_an_image_one_pixel_wide_or_tall_is_an_image(size):
    assert decode(encode(noise("L", size))).image.size == size


def test_an_animated_png_of_two_frames_is_refused_with_its_frame_count():
    frames = [noise("RGB", (20, 10), seed=i) for i in range(2)]
    data = encode(frames[0], "PNG", save_all=True, append_images=frames[1:])
    e = refused(data)
    assert (e.reason, e.detail) == ("unsupported_type", "a.png: an animated PNG (2 frames); animated images are not "
                                    "accepted: send the frame to use as a still PNG")
    assert decode(encode(frames[0], "PNG", save_all=True)).image.size == (20, 10)  # one frame: a still image


def test_a_multi_picture_jpeg_is_read_as_its_first_picture_drafted_like_a_jpeg(drafts):
    first, second = noise("RGB", (400, 300), seed=8), noise("RGB", (400, 300), seed=9)
    data = encode(first, "MPO", save_all=True, append_images=[second])
    assert Image.open(io.BytesIO(data)).format == "MPO"
    im = decode(data, max_side=100)
    assert im.format == "JPEG" and im.content_type == "image/jpeg" and drafts == [("RGB", (100, 75))]
    ref = Image.open(io.BytesIO(data))
    ref.draft("RGB", (100, 75))
    expected = ref.convert("RGB").resize((100, 75), Image.Resampling.BICUBIC, reducing_gap=2.0)
    assert np.array_equal(pixels(im.image), pixels(expected))
    stored = open_stored(data)
    assert stored.format == "JPEG" and stored.ext == ".jpg" and stored.data == data


def test_a_decompression_bomb_is_refused_by_the_upload_limit_before_any_pixel_is_read():
    e = refused(png_header(100_000, 100_000))  # Pillow refuses it on opening
    assert (e.reason, e.detail) == ("too_large", "a.png: 10000000000 pixels, the limit is 20000000")


def test_pillows_bomb_warning_is_a_refusal_of_the_upload(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 1,200 pixels: Pillow warns
    e = refused(encode(noise("L", (40, 30))))
    assert (e.reason, e.detail) == ("too_large", "a.png: 1200 pixels, the limit is 20000000")


def test_a_bomb_error_without_a_pixel_count_still_names_the_limit(monkeypatch):
    def bomb(*args, **kwargs):
        raise Image.DecompressionBombError("too big")

    monkeypatch.setattr(Image, "open", bomb)
    e = refused(encode(noise("L", (4, 4))))
    assert (e.reason, e.detail) == ("too_large", "a.png: more pixels than Pillow opens, the limit is 20000000")


def test_a_broken_image_is_refused_with_what_pillow_said():
    data = encode(noise("L", (40, 30)))
    e = refused(data[: len(data) // 2])
    assert e.reason == "bad_image" and e.detail.startswith("a.png: cannot decode image (")
    assert "NoneType" not in e.detail and e.detail.split("(", 1)[1].split(":", 1)[0] in (
        "OSError", "SyntaxError", "ValueError", "EOFError")


def test_a_decoded_upload_keeps_its_name_and_bytes_unless_told_not_to():
    data = encode(noise("L", (8, 8)))
    im = decode_image(data, filename="kept.png", declared_type=None, limits=LIMITS)
    assert im.filename == "kept.png" and im.data == data
    assert decode_image(data, filename=None, declared_type=None, limits=LIMITS, keep_data=False).data == b""


def test_an_svg_is_named_only_within_its_first_512_bytes_and_after_spaces_only():
    assert other_format(b"<?xml version='1.0'?>" + b" " * 488 + b"<svg/>") is None  # '<svg' from byte 509 on
    assert other_format(b"<?xml version='1.0'?>" + b" " * 487 + b"<svg/>") == "SVG"
    assert other_format(b"X<svg/>") is None and other_format(b"\t\r\n <svg/>") == "SVG"
