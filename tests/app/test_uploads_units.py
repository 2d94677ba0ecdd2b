"""``app.routes.uploads`` by value, with Starlette's ``UploadFile``: every refusal's status and whole message, the
limits' edges, and what a file read or decoded gives back. Every route that takes images goes through it; the routes'
own tests (``test_app_bad_input.py``, ``test_app_upload_limits.py``, ``test_app_images.py``) check it through
HTTP."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from service_fixtures import make_test_settings, refusal
from service_fixtures import upload_file as upload
from starlette.datastructures import UploadFile

from app.routes.uploads import (
    check_file_count,
    check_request_pixels,
    check_text,
    decode_all,
    decode_one,
    read_images,
    read_one,
    read_raw,
)


@pytest.fixture
def settings(tmp_path, bundle_dir):  # type: ignore[no-untyped-def]
    return make_test_settings(tmp_path, bundle_dir, max_files_per_request=3, max_file_bytes=400,
                              max_image_pixels=1_000, max_request_pixels=2_000, decode_max_side=32)


def png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (w, h), 128).save(buf, "PNG")
    return buf.getvalue()


def test_text_with_a_nul_byte_is_refused_naming_where_it_is():
    check_text(None, "name")
    check_text("tabby", "name")
    assert refusal(check_text, "tab\x00by", "name") == (422, "name contains a NUL byte (\\x00); remove it")


def test_the_file_count_and_filenames_are_checked_first(settings):
    assert refusal(check_file_count, [], settings) == (422, "at least one file is required")
    three = [upload(b"x") for _ in range(3)]
    check_file_count(three, settings)  # the limit itself
    assert refusal(check_file_count, [*three, upload(b"x")], settings) == (413, "4 files; at most 3 per request")
    assert refusal(check_file_count, three, settings, max_files=2) == (413, "3 files; at most 2 per request")
    check_file_count(three, settings, max_files=10)  # a route's own limit never raises the setting's
    assert refusal(check_file_count, [*three, upload(b"x")], settings, max_files=10)[0] == 413
    check_file_count([upload(b"x", None), upload(b"x", "b" * 255)], settings)
    assert refusal(check_file_count, [upload(b"x"), upload(b"x", "b\x00.png")], settings) == (
        422, "the filename of file 2 contains a NUL byte (\\x00); remove it")
    assert refusal(check_file_count, [upload(b"x", "b" * 256)], settings) == (
        422, "the filename of file 1 has 256 characters; at most 255")


def test_a_file_is_read_from_its_start_and_refused_above_the_limit_naming_it(settings):
    f = upload(b"x" * 400)
    f.file.seek(7)
    assert read_one(f, settings) == b"x" * 400
    assert refusal(read_one, upload(b"x" * 401, "big.png"), settings) == (413, "big.png: larger than 400 bytes")
    assert refusal(read_one, upload(b"x" * 401, None), settings) == (413, "upload: larger than 400 bytes")
    assert refusal(read_one, upload(b"x" * 401, ""), settings) == (413, "upload: larger than 400 bytes")
    assert read_raw([upload(b"ab"), upload(b"c")], settings) == [b"ab", b"c"]


class CountingIO(io.BytesIO):
    """A file that records how many bytes each ``read`` asked for."""

    def __init__(self, data: bytes):
        super().__init__(data)
        self.asked: list[int | None] = []

    def read(self, size: int | None = -1) -> bytes:
        self.asked.append(size)
        return super().read(size)


def test_a_file_larger_than_the_limit_is_refused_having_read_one_byte_past_it(settings):
    """However large the upload (a spooled temporary file on disk), no more than the limit and one byte is held."""
    f = CountingIO(b"x" * 100_000)
    assert refusal(read_one, UploadFile(f, filename="huge.png"), settings)[0] == 413
    assert f.asked == [401]


def test_the_requests_pixels_are_summed_from_the_headers_and_refused_above_the_budget(settings):
    check_request_pixels([None, 1_000, 1_000], settings)  # the budget itself; an unreadable header counts none
    assert refusal(check_request_pixels, [2_001], settings) == (413, (
        "1 image of 2,001 pixels in all (width x height, summed); the limit is 2,000 pixels per request: send fewer "
        "or smaller images"))
    assert refusal(check_request_pixels, [1_000, None, 1_001], settings) == (413, (
        "3 images of 2,001 pixels in all (width x height, summed); the limit is 2,000 pixels per request: send "
        "fewer or smaller images"))


def test_decoding_refusals_keep_their_status_and_message(settings):
    assert refusal(decode_one, upload(b"", "e.png"), b"", settings) == (400, "e.png: empty file")
    assert refusal(decode_one, upload(b"", "t.txt", "text/plain"), png(4, 4), settings) == (
        415, "t.txt: content type 'text/plain' is not PNG, JPEG or WebP")
    assert refusal(decode_one, upload(b"", "l.png"), png(40, 30), settings) == (
        413, "l.png: 40x30 pixels, the limit is 1000")


def test_decoded_images_keep_their_bytes_only_when_asked_and_are_shrunk_to_the_decode_side(settings):
    data = png(50, 20)  # the image limit itself
    got = decode_one(upload(data, "a.png"), data, settings)
    assert (got.filename, got.data, got.format, got.width, got.height) == ("a.png", data, "PNG", 50, 20)
    assert max(got.image.size) == 32 and got.scale[0] == pytest.approx(50 / 32)
    assert decode_one(upload(data), data, settings, keep_data=False).data == b""
    small = png(10, 10)
    assert [d.width for d in decode_all([upload(data), upload(small)], [data, small], settings)] == [50, 10]
    with pytest.raises(ValueError):  # one file per bytes read, or a bug in the route
        decode_all([upload(data)], [data, small], settings)
    assert refusal(decode_all, [upload(data)] * 4, [png(30, 30)] * 4, settings) == (413, (
        "4 images of 3,600 pixels in all (width x height, summed); the limit is 2,000 pixels per request: send fewer "
        "or smaller images"))


def test_read_images_checks_count_size_and_pixels_before_decoding_any(settings):
    a, b = png(30, 20), png(20, 20)
    got = read_images([upload(a, "a.png"), upload(b, "b.png")], settings)
    assert [(d.filename, d.data, d.width) for d in got] == [("a.png", a, 30), ("b.png", b, 20)]
    assert read_images([upload(a)], settings, keep_data=False)[0].data == b""
    assert refusal(read_images, [upload(a)] * 3, settings, max_files=2)[0] == 413
    exact = a + b"\0" * (400 - len(a))  # the file limit itself (what follows a PNG's end is not read)
    assert read_images([upload(exact)], settings)[0].data == exact
    big = upload(a + b"\0" * (401 - len(a)), "big.png")
    assert refusal(read_images, [upload(b"not an image"), big], settings) == (413, "big.png: larger than 400 bytes")
    square = png(40, 40)
    assert refusal(read_images, [upload(square), upload(square), upload(b"not an image")], settings)[1].startswith(
        "3 images of 3,200 pixels")  # not: the last file is no image, nor the first too large (the budget comes first)
    assert refusal(read_images, [upload(a), upload(b"not an image", "n.png")], settings) == (
        415, "n.png: not a PNG, JPEG or WebP image")
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (16, 16), dtype=np.uint8)).save(buf, "PNG")
    code, message = refusal(read_images, [upload(a), upload(buf.getvalue()[:200], "cut.png")], settings)
    assert code == 400 and message.startswith("cut.png: cannot decode image"), message
