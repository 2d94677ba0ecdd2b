"""Decoding and validating uploaded images (PNG, JPEG; any mode PIL reads; any size up to the limits).

Everything is checked before anything is stored: size in bytes, declared and actual format, pixel
count read from the header (before decoding: decompression bombs), animation (an animated PNG is
refused, not silently cut to its first frame), and a full decode (truncation).

Images are decoded the way every viewer shows them, and small:

- **EXIF orientation** is applied (the ``Orientation`` tag, as ``PIL.ImageOps.exif_transpose`` does): a
  portrait phone JPEG whose pixels are stored sideways is analysed upright, its ``width`` / ``height``
  are the upright frame's, and boxes (given or returned) are in that frame.
- **Bilevel images are descreened**: a 1-bit image (PIL mode ``1``: a fax, a scan, a dithered print) is read as
  grayscale smoothed by a Gaussian of ``BILEVEL_SIGMA`` pixels at its full resolution, so the halftone dots
  become the gray levels they stand for (the bundles learned from gray images: on dithered cMNIST test digits the
  answer's CorLoc was 43-53 read as raw dots, 100 descreened, 99-100 in gray; BENCHMARKS.md, "Bilevel images").
- **Downscaled while decoding** to a longer side of at most ``max_side`` (``QLOC_DECODE_MAX_SIDE``): a
  JPEG is decoded at 1/2, 1/4 or 1/8 scale by its decoder (``Image.draft``: the full-resolution pixels
  never exist), any image is then resized (antialiased) to fit. ``DecodedImage`` keeps the full image's
  size and maps boxes between its decoded pixels and the full image's (``box_to_full``).
"""

from __future__ import annotations

import io
import math
import re
import warnings
from dataclasses import dataclass
from typing import IO

from PIL import Image, ImageFile, ImageFilter

from models.inference import to_8bit

ImageFile.LOAD_TRUNCATED_IMAGES = False

FORMATS = {"PNG": ("image/png", ".png"), "JPEG": ("image/jpeg", ".jpg"), "WEBP": ("image/webp", ".webp")}
ACCEPTED_DECLARED_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/pjpeg", "image/webp",
                           "application/octet-stream", ""}
_OTHER_IMAGE_MAGIC = {b"GIF87a": "GIF", b"GIF89a": "GIF", b"BM": "BMP", b"II*\x00": "TIFF", b"MM\x00*": "TIFF",
                      b"II+\x00": "BigTIFF", b"MM\x00+": "BigTIFF", b"\x00\x00\x01\x00": "ICO", b"8BPS": "Photoshop",
                      b"%PDF-": "PDF", b"\x00\x00\x00\x0cjP  \r\n\x87\n": "JPEG 2000", b"\xffO\xffQ": "JPEG 2000",
                      b"\xff\n": "JPEG XL", b"\x00\x00\x00\x0cJXL \r\n\x87\n": "JPEG XL", b"qoif": "QOI",
                      b"DDS ": "DDS", b"\x76\x2f\x31\x01": "OpenEXR", b"#?RADIANCE": "Radiance HDR"}
"""Other image formats by their first bytes -> their name in the 415 that refuses them."""
_ISO_BRANDS = {b"heic": "HEIC", b"heix": "HEIC", b"hevc": "HEIC", b"heim": "HEIC", b"heis": "HEIC", b"mif1": "HEIF",
               b"msf1": "HEIF", b"avif": "AVIF", b"avis": "AVIF"}
"""Image brands of an ISO base media file (``ftyp`` box at byte 4): HEIC, a phone camera's default, and AVIF."""
_PNG_MAGIC, _JPEG_MAGIC = b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff"
ACCEPTED = "PNG, JPEG or WebP"
"""The formats taken, as error messages name them."""


def _is_webp(head: bytes) -> bool:
    return head[:4] == b"RIFF" and head[8:12] == b"WEBP"

ORIENTATION = 0x0112
"""The EXIF tag of the orientation the stored pixels are shown in."""
_TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
              5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
              8: Image.Transpose.ROTATE_90}
"""Orientation -> the transposition that shows the stored pixels upright (``PIL.ImageOps.exif_transpose``'s)."""
_RESAMPLE = Image.Resampling.BICUBIC
BILEVEL_SIGMA = 0.7
"""Standard deviation, in the image's own pixels, of the Gaussian a 1-bit image is smoothed with (``_decode``): chosen
on dithered cMNIST validation digits, MNIST's training file (0.7 against 0.5 / 1.0 / 1.4: as many answers right or
more, more of them ``found``)."""

Box = tuple[float, float, float, float]


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
    """The bytes as uploaded (what gets stored); ``b""`` when the caller did not keep them."""
    image: Image.Image
    """Decoded, EXIF orientation applied, its longer side at most the ``max_side`` it was decoded with."""
    format: str
    """``PNG``, ``JPEG`` or ``WEBP``."""
    width: int
    """Of the full image, upright (EXIF orientation applied): the frame of boxes given and returned."""
    height: int

    @property
    def scale(self) -> tuple[float, float]:
        """(full / decoded) along x and y: 1.0 for an image decoded at full resolution."""
        return self.width / self.image.width, self.height / self.image.height

    def box_to_full(self, box: Box) -> Box:
        """A box in the pixels of ``image`` -> the same box in the full (upright) image's pixels, within the image
        (the model's float32 arithmetic can overshoot an edge by a rounding error, which strict readers refuse)."""
        sx, sy = self.scale
        w, h = self.width, self.height
        return (min(max(box[0] * sx, 0.0), w), min(max(box[1] * sy, 0.0), h),
                min(max(box[2] * sx, 0.0), w), min(max(box[3] * sy, 0.0), h))

    def box_to_decoded(self, box: Box) -> Box:
        """A box in the full (upright) image's pixels -> the same box in the pixels of ``image``."""
        sx, sy = self.scale
        return box[0] / sx, box[1] / sy, box[2] / sx, box[3] / sy

    def crop(self, box: Box, *, max_side: int | None) -> Image.Image:
        """The crop inside ``box`` (full upright pixels) at the resolution it needs: the image is decoded again
        from ``data`` at full resolution if the box's longer side is at most ``max_side`` (cut exactly as
        ``cut_box`` cuts the full image), else just large enough that the crop's longer side is about
        ``max_side``. One decode at a time; it is dropped once the crop is cut."""
        if not self.data:
            raise ValueError("crop needs the image's bytes (decode with keep_data)")
        side = max(box[2] - box[0], box[3] - box[1])
        need = None  # the longer side to decode the whole image at; None: full resolution
        if max_side is not None and side > max_side:
            need = math.ceil(max(self.width, self.height) * max_side / side)
        if need is None and self.image.size == (self.width, self.height):
            return cut_box(self.image, box)
        again = open_stored(self.data, max_side=need)
        return cut_box(again.image, again.box_to_decoded(box))

    @property
    def content_type(self) -> str:
        return FORMATS[self.format][0]

    @property
    def ext(self) -> str:
        return FORMATS[self.format][1]


def sniff_format(data: bytes, name: str) -> str:
    """``PNG``, ``JPEG`` or ``WEBP`` from the first bytes; ``ImageRejected`` otherwise."""
    if data.startswith(_PNG_MAGIC):
        return "PNG"
    if data.startswith(_JPEG_MAGIC):
        return "JPEG"
    if _is_webp(data):
        return "WEBP"
    other = other_format(data)
    if other is not None:
        raise ImageRejected("unsupported_type", (f"{name}: {other} format; only {ACCEPTED} images are accepted: "
                                                 "convert it to one of them first"))
    raise ImageRejected("unsupported_type", f"{name}: not a {ACCEPTED} image")


def other_format(data: bytes) -> str | None:
    """The name of the image format (not one taken) that ``data`` starts as, or ``None``."""
    for magic, fmt in _OTHER_IMAGE_MAGIC.items():
        if data.startswith(magic):
            return fmt
    if data[4:8] == b"ftyp" and data[8:12] in _ISO_BRANDS:
        return _ISO_BRANDS[data[8:12]]
    head = data[:512].lstrip(b"\xef\xbb\xbf \t\r\n").lower()  # an SVG: XML text, perhaps after a BOM
    if head.startswith(b"<svg") or (head.startswith((b"<?xml", b"<!doctype svg")) and b"<svg" in head):
        return "SVG"
    return None


def header_pixels(fp: IO[bytes]) -> int | None:
    """Width x height read from the header of the image in ``fp`` (nothing decoded), or ``None`` if it cannot be
    read (the decode then refuses the file with its reason). Reads the stream from its start (where Pillow opens it
    from), leaves the position anywhere."""
    fp.seek(0)
    head = fp.read(12)
    if not (head.startswith(_PNG_MAGIC) or head.startswith(_JPEG_MAGIC) or _is_webp(head)):
        return None
    fp.seek(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            img = Image.open(fp, formats=list(FORMATS))
            w, h = img.size
    except Exception:  # a broken header, or a bomb PIL will not even open: the decode refuses it, saying why
        return None
    return w * h


def fit(size: tuple[int, int], max_side: int | None) -> tuple[int, int]:
    """``size`` scaled (aspect kept, each side at least 1) so that its longer side is at most ``max_side``."""
    w, h = size
    if max_side is None or max(w, h) <= max_side:
        return w, h
    k = max_side / max(w, h)
    return max(1, min(max_side, round(w * k))), max(1, min(max_side, round(h * k)))


def _orientation(img: Image.Image) -> int:
    try:
        value = img.getexif().get(ORIENTATION, 1)
    except Exception:  # an unreadable EXIF block is not a reason to refuse the pixels: shown as stored
        return 1
    return value if value in _TRANSPOSE else 1


def _decode(img: Image.Image, max_side: int | None) -> tuple[Image.Image, tuple[int, int]]:
    """An opened image -> (decoded, upright, longer side at most ``max_side``; the full upright size)."""
    w, h = img.size
    target = fit((w, h), max_side)
    if target != (w, h) and img.format in ("JPEG", "MPO"):
        img.draft(img.mode, target)  # the decoder's own 1/2, 1/4, 1/8 scaling, never below target
    img.load()
    orientation = _orientation(img)
    # A 16-bit grayscale PNG: scaled to 8 bits (PIL's conversion would clip it), before any resampling.
    img = to_8bit(img, int32_is_16bit=img.format == "PNG")
    if img.mode == "1" and "transparency" not in img.info:  # halftone dots back to the grays they stand for
        img = img.convert("L").filter(ImageFilter.GaussianBlur(BILEVEL_SIGMA))
    if img.size != target:
        # Resampling a palette (or 1-bit) image would pick nearest pixels; a colour key would not survive it.
        if img.mode in ("PA", "RGBA", "LA") or "transparency" in img.info:
            img = img.convert("LA" if img.mode == "LA" else "RGBA")
        elif img.mode in ("P", "1"):
            img = img.convert("RGB" if img.mode == "P" else "L")
        img = img.resize(target, _RESAMPLE, reducing_gap=2.0)
    if orientation != 1:
        img = img.transpose(_TRANSPOSE[orientation])
    full = (h, w) if orientation in (5, 6, 7, 8) else (w, h)
    return img, full


def decode_image(data: bytes, *, filename: str | None, declared_type: str | None, limits: UploadLimits,
                 max_side: int | None = None, keep_data: bool = True) -> DecodedImage:
    """Validate and decode one upload -> ``DecodedImage`` (upright; longer side at most ``max_side``, ``None``:
    full resolution); raises ``ImageRejected``. ``keep_data=False`` leaves ``data`` empty (nothing to store)."""
    name = filename or "upload"
    declared = (declared_type or "").split(";")[0].strip().lower()
    if declared not in ACCEPTED_DECLARED_TYPES:
        raise ImageRejected("unsupported_type", f"{name}: content type {declared!r} is not {ACCEPTED}")
    if not data:
        raise ImageRejected("bad_image", f"{name}: empty file")
    if len(data) > limits.max_file_bytes:
        raise ImageRejected("too_large", f"{name}: {len(data)} bytes, the limit is {limits.max_file_bytes}")
    fmt = sniff_format(data, name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=[fmt])
            w, h = img.size
            if w < 1 or h < 1:
                raise ImageRejected("bad_image", f"{name}: image has no pixels")
            if w * h > limits.max_image_pixels:
                raise ImageRejected("too_large", f"{name}: {w}x{h} pixels, the limit is {limits.max_image_pixels}")
            if fmt != "JPEG" and getattr(img, "n_frames", 1) > 1:  # APNG, animated WebP (an MPO JPEG: its first)
                kind = {"PNG": "PNG", "WEBP": "WebP"}[fmt]
                raise ImageRejected("unsupported_type", (
                    f"{name}: an animated {kind} ({img.n_frames} frames); animated images are not accepted: send "
                    f"the frame to use as a still {kind}"))
            image, (full_w, full_h) = _decode(img, max_side)
    except ImageRejected:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        # Pillow's own bound (far above ours) refused it before its size was read here: ours is what applies
        size = re.search(r"\((\d+) pixels\)", str(e))
        pixels = f"{size.group(1)} pixels" if size else "more pixels than Pillow opens"
        raise ImageRejected("too_large", f"{name}: {pixels}, the limit is {limits.max_image_pixels}") from e
    except Exception as e:  # PIL raises many types for broken files: SyntaxError, OSError, ValueError...
        raise ImageRejected("bad_image", f"{name}: cannot decode image ({type(e).__name__}: {e})") from e
    return DecodedImage(filename, data if keep_data else b"", image, fmt, full_w, full_h)


def open_stored(data: bytes, *, max_side: int | None = None, filename: str | None = None) -> DecodedImage:
    """An image stored after ``decode_image`` accepted it -> ``DecodedImage``, decoded the same way (upright,
    longer side at most ``max_side``): what the worker sees is what the API saw. No limits are checked."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        img = Image.open(io.BytesIO(data))
        fmt = img.format if img.format in FORMATS else "JPEG"  # MPO: a JPEG with more pictures
        image, (w, h) = _decode(img, max_side)
    return DecodedImage(filename, data, image, fmt, w, h)


def round_box(box: Box) -> tuple[int, int, int, int]:
    """A box ``(x1, y1, x2, y2)`` in pixels -> its edges rounded to the nearest pixel edge (halves up)."""
    x1, y1, x2, y2 = (math.floor(v + 0.5) for v in box)
    return x1, y1, x2, y2


def cut_box(image: Image.Image, box: Box) -> Image.Image:
    """The crop of ``image`` inside ``box`` (in its pixels, edges rounded by ``round_box``): how an exemplar
    set's crops are cut from whole images with boxes. Mode, palette and transparency are kept."""
    return image.crop(round_box(box))
