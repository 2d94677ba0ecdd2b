"""What ``app.client`` sends as images: paths, bytes, PIL images or numpy arrays encoded for a multipart upload."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ImageInput = Any
"""A path (``str`` / ``Path``), ``bytes``, a ``(filename, bytes)`` pair, a binary file object, a PIL image or a
numpy array."""


def _sniff(data: bytes) -> str:
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return "image/png"  # PNG, or anything else: the API names what is wrong with it


def _array_to_png(arr: Any) -> bytes:
    import numpy as np
    from PIL import Image

    a = np.asarray(arr)
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[2] not in (3, 4)):
        raise ValueError(f"an image array is HxW or HxWx{{1,3,4}}; got shape {a.shape}")
    if a.dtype == np.bool_:  # a mask: white where true, as PIL reads it (HxW: a 1-bit image, read as the API reads one)
        if a.ndim == 2:
            return _pil_to_png(Image.fromarray(a))
        a = a.astype(np.uint8) * 255
    if a.dtype == np.uint16 and a.ndim == 2:  # sent as a 16-bit PNG: the API scales it to 8 bits
        return _pil_to_png(Image.fromarray(a))
    if a.dtype == np.uint16:  # PNG has no 16-bit colour that PIL writes: its 8 bits here, scaled as the API would
        a = np.rint(a / 257.0).astype(np.uint8)
    elif a.dtype != np.uint8:
        if a.size and np.issubdtype(a.dtype, np.floating):
            if not np.isfinite(a).all():
                raise ValueError("an image array holds NaN or infinite values")
            lo, hi = float(a.min()), float(a.max())
            if lo < 0.0 or hi > 255.0:
                raise ValueError(f"a float image array is read as [0, 1] (all values within it) or else [0, 255]; "
                                 f"got values from {lo:g} to {hi:g}: scale it first")
            if hi <= 1.0:
                a = a * 255.0
        elif a.size and (int(a.min()) < 0 or int(a.max()) > 255):
            raise ValueError(f"an integer image array is read as [0, 255] (or uint16 as 16 bits); got values from "
                             f"{int(a.min())} to {int(a.max())}: scale it first")
        a = np.rint(a).astype(np.uint8)  # within 0..255: checked above
    return _pil_to_png(Image.fromarray(a))


def _pil_to_png(img: Any) -> bytes:
    import numpy as np
    from PIL import ImageOps

    # As a viewer shows it, as the API reads a file sent by path: a JPEG opened with PIL keeps its EXIF orientation
    # in its metadata, which a re-encoded PNG would lose (the boxes would come back in the sideways frame).
    img = ImageOps.exif_transpose(img)
    if img.mode in ("I", "F"):  # 32-bit integers or floats: PIL's conversion to 8 bits would clip them
        return _wide_to_png(img)
    if img.mode in ("I;16B", "I;16L", "I;16N"):  # PIL's convert to I;16 clips them at 255: their values, as uint16
        return _array_to_png(np.asarray(img).astype(np.uint16))
    if img.mode == "PA":
        img = img.convert("RGBA")
    # PNG holds these as they are (transparency and palettes too: the API composites them as it would the file's);
    # 16-bit grayscale stays 16-bit (the API scales it). Other modes (CMYK, YCbCr, ...) go as RGB.
    if img.mode not in ("1", "L", "LA", "P", "RGB", "RGBA", "I;16"):
        img = img.convert("RGB")
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def _wide_to_png(img: Any) -> bytes:
    """A PIL image of mode ``I`` (how PIL often holds 16-bit data) or ``F`` -> PNG bytes, by the array rules: ``I``
    values within 0..255 as 8 bits, up to 65535 as 16-bit grayscale (the API scales it), others a ``ValueError``;
    ``F`` as a float array ([0, 1], or else [0, 255])."""
    import numpy as np

    a = np.asarray(img)
    if img.mode == "I" and a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi > 65535:
            raise ValueError(f"a PIL image of mode I is read as 8 bits (0..255) or 16 bits (0..65535); got values "
                             f"from {lo} to {hi}: scale it first")
        a = a.astype(np.uint16 if hi > 255 else np.uint8)
    return _array_to_png(a)


def encode_image(image: ImageInput, index: int = 0) -> tuple[str, bytes, str]:
    """One image -> ``(filename, bytes, content type)``, ready for a multipart upload."""
    if isinstance(image, str | Path):
        path = Path(image)
        data = path.read_bytes()
        return path.name, data, _sniff(data)
    if isinstance(image, bytes | bytearray | memoryview):
        data = bytes(image)
        ext = {"image/jpeg": "jpg", "image/webp": "webp"}.get(_sniff(data), "png")
        return f"image{index}.{ext}", data, _sniff(data)
    if _is_pair(image):
        name, content = image
        data = content.read() if hasattr(content, "read") else bytes(content)
        return name, data, _sniff(data)
    if hasattr(image, "read"):
        data = image.read()
        name = Path(str(getattr(image, "name", f"image{index}.png"))).name
        return name, data, _sniff(data)
    try:
        from PIL import Image

        if isinstance(image, Image.Image):
            return f"image{index}.png", _pil_to_png(image), "image/png"
    except ImportError:  # pragma: no cover - Pillow is a dependency of qloc
        pass
    if hasattr(image, "__array__") or isinstance(image, list):
        return f"image{index}.png", _array_to_png(image), "image/png"
    raise TypeError(f"cannot send {type(image).__name__} as an image: give a path, bytes, a PIL image or an array")


def _is_pair(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)


def files_fields(images: ImageInput | Sequence[ImageInput], field: str = "files"
                 ) -> list[tuple[str, tuple[str, bytes, str]]]:
    """One image or a list (or tuple) of images -> the multipart ``files`` (or ``field``) fields. An array is one
    image: give a list of arrays for several."""
    many = isinstance(images, list) or (isinstance(images, tuple) and not _is_pair(images))
    items = list(images) if many else [images]  # type: ignore[arg-type]
    if not items:
        raise ValueError("at least one image is needed")
    return [(field, encode_image(im, i)) for i, im in enumerate(items)]
