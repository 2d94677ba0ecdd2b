"""Decoding uploads: PNG and JPEG in any mode, everything else refused with the reason."""

import io

import pytest
from PIL import Image
from service_fixtures import jpeg_bytes, png_bytes

from app.images import ImageRejected, UploadLimits, decode_image

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
    (b"not an image", "image/png", "bad_image"),
    (png_bytes(50, 50)[:60], "image/png", "bad_image"),
    (png_bytes(50, 50), "text/plain", "unsupported_type"),
    (encode(Image.new("L", (5, 5)), "GIF"), "image/png", "unsupported_type"),
    (encode(Image.new("L", (5, 5)), "BMP"), None, "unsupported_type"),
    (png_bytes(400, 300, square=False), "image/png", "too_large"),
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 1_000_001, "image/png", "too_large"),
])
def test_rejections(data, declared, reason):
    with pytest.raises(ImageRejected) as e:
        decode_image(data, filename="x", declared_type=declared, limits=LIMITS)
    assert e.value.reason == reason
