"""Decoding and validating uploaded images (PNG, JPEG; any mode PIL reads; any size up to the limits).

Everything is checked before anything is stored: size in bytes, declared and actual format, pixel
count read from the header (before decoding: decompression bombs), and a full decode (truncation).
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass

from PIL import Image, ImageFile

ImageFile.LOAD_TRUNCATED_IMAGES = False

FORMATS = {"PNG": ("image/png", ".png"), "JPEG": ("image/jpeg", ".jpg")}
ACCEPTED_DECLARED_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/pjpeg", "application/octet-stream", ""}
_OTHER_IMAGE_MAGIC = (b"GIF87a", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*", b"RIFF", b"\x00\x00\x01\x00")


class ImageRejected(Exception):  # noqa: N818 -- a verdict, not a crash
    """An upload that is not an acceptable image; ``reason`` picks the HTTP status in the routes."""

    def __init__(self, reason: str, detail: str):
        assert reason in ("bad_image", "too_large", "unsupported_type"), reason
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass
class UploadLimits:
    max_file_bytes: int
    max_image_pixels: int


@dataclass
class DecodedImage:
    filename: str | None
    data: bytes
    """The bytes as uploaded (what gets stored)."""
    image: Image.Image
    """Fully decoded."""
    format: str
    """``PNG`` or ``JPEG``."""

    @property
    def width(self) -> int:
        return self.image.width

    @property
    def height(self) -> int:
        return self.image.height

    @property
    def content_type(self) -> str:
        return FORMATS[self.format][0]

    @property
    def ext(self) -> str:
        return FORMATS[self.format][1]


def decode_image(data: bytes, *, filename: str | None, declared_type: str | None, limits: UploadLimits) -> DecodedImage:
    """Validate and decode one upload -> ``DecodedImage``; raises ``ImageRejected``."""
    name = filename or "upload"
    declared = (declared_type or "").split(";")[0].strip().lower()
    if declared not in ACCEPTED_DECLARED_TYPES:
        raise ImageRejected("unsupported_type", f"{name}: content type {declared!r} is not PNG or JPEG")
    if not data:
        raise ImageRejected("bad_image", f"{name}: empty file")
    if len(data) > limits.max_file_bytes:
        raise ImageRejected("too_large", f"{name}: {len(data)} bytes, the limit is {limits.max_file_bytes}")
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        fmt = "PNG"
    elif data.startswith(b"\xff\xd8\xff"):
        fmt = "JPEG"
    elif data.startswith(_OTHER_IMAGE_MAGIC):
        raise ImageRejected("unsupported_type", f"{name}: only PNG and JPEG images are accepted")
    else:
        raise ImageRejected("bad_image", f"{name}: not a PNG or JPEG image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=[fmt])
            w, h = img.size
            if w < 1 or h < 1:
                raise ImageRejected("bad_image", f"{name}: image has no pixels")
            if w * h > limits.max_image_pixels:
                raise ImageRejected("too_large", f"{name}: {w}x{h} pixels, the limit is {limits.max_image_pixels}")
            img.load()
    except ImageRejected:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageRejected("too_large", f"{name}: {e}") from e
    except Exception as e:  # PIL raises many types for broken files: SyntaxError, OSError, ValueError...
        raise ImageRejected("bad_image", f"{name}: cannot decode image ({type(e).__name__}: {e})") from e
    return DecodedImage(filename, data, img, fmt)


def round_box(box: tuple[float, float, float, float]) -> tuple[int, int, int, int]:
    """A box ``(x1, y1, x2, y2)`` in pixels -> its edges rounded to the nearest pixel edge (halves up)."""
    x1, y1, x2, y2 = (math.floor(v + 0.5) for v in box)
    return x1, y1, x2, y2


def cut_box(image: Image.Image, box: tuple[float, float, float, float]) -> Image.Image:
    """The crop of ``image`` inside ``box`` (in its pixels, edges rounded by ``round_box``): how an exemplar
    set's crops are cut from whole images with boxes. Mode, palette and transparency are kept."""
    return image.crop(round_box(box))
