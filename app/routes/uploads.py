"""Reading multipart image uploads in the routes: every file is checked before anything is stored.

Memory is bounded by construction: the request's pixel count is read from the image headers and checked
against ``max_request_pixels`` before anything is decoded, then the files are decoded one at a time,
each downscaled while decoding to ``decode_max_side`` (``app.images``); a file's bytes are kept only when
the route stores them.
"""

from __future__ import annotations

import io

from fastapi import HTTPException, UploadFile, status

from app.config import Settings
from app.images import DecodedImage, ImageRejected, UploadLimits, decode_image, header_pixels

REJECTION_STATUS = {
    "bad_image": status.HTTP_400_BAD_REQUEST,
    "too_large": status.HTTP_413_CONTENT_TOO_LARGE,
    "unsupported_type": status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
}


MAX_FILENAME = 255
"""Longest filename kept (the column's width): a longer one is refused, not cut."""


def check_text(value: str | None, what: str) -> None:
    """Refuse text that a database cannot store the same everywhere: PostgreSQL rejects NUL bytes in text,
    SQLite keeps them, so both refuse them here (422), before anything is written."""
    if value is not None and "\x00" in value:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"{what} contains a NUL byte (\\x00); remove it")


def check_file_count(files: list[UploadFile], settings: Settings, *, max_files: int | None = None) -> None:
    """At least one file, at most the limit, and filenames that can be stored (no NUL, at most 255 characters)."""
    limit = min(settings.max_files_per_request, max_files or settings.max_files_per_request)
    if not files:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "at least one file is required")
    if len(files) > limit:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, f"{len(files)} files; at most {limit} per request")
    for i, f in enumerate(files, 1):
        check_text(f.filename, f"the filename of file {i}")
        if f.filename is not None and len(f.filename) > MAX_FILENAME:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                                f"the filename of file {i} has {len(f.filename)} characters; at most {MAX_FILENAME}")


def _too_large(f: UploadFile, settings: Settings) -> HTTPException:
    return HTTPException(status.HTTP_413_CONTENT_TOO_LARGE,
                         f"{f.filename or 'upload'}: larger than {settings.max_file_bytes} bytes")


def read_one(f: UploadFile, settings: Settings) -> bytes:
    """One file's bytes, from its start, refusing it (413) if larger than the limit without reading all of it."""
    f.file.seek(0)
    data = f.file.read(settings.max_file_bytes + 1)
    if len(data) > settings.max_file_bytes:
        raise _too_large(f, settings)
    return data


def read_raw(files: list[UploadFile], settings: Settings) -> list[bytes]:
    """Each file's bytes, refusing one larger than the limit without reading all of it."""
    return [read_one(f, settings) for f in files]


def check_request_pixels(pixels: list[int | None], settings: Settings) -> None:
    """413 when the images' pixels (from their headers; ``None``: unreadable, refused later) exceed the budget."""
    total = sum(p for p in pixels if p is not None)
    if total > settings.max_request_pixels:
        n = len(pixels)
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, (
            f"{n} image{'' if n == 1 else 's'} of {total:,} pixels in all (width x height, summed); the limit is "
            f"{settings.max_request_pixels:,} pixels per request: send fewer or smaller images"))


def _limits(settings: Settings) -> UploadLimits:
    return UploadLimits(settings.max_file_bytes, settings.max_image_pixels)


def decode_one(f: UploadFile, data: bytes, settings: Settings, *, keep_data: bool = True) -> DecodedImage:
    try:
        return decode_image(data, filename=f.filename, declared_type=f.content_type, limits=_limits(settings),
                            max_side=settings.decode_max_side, keep_data=keep_data)
    except ImageRejected as e:
        raise HTTPException(REJECTION_STATUS[e.reason], e.detail) from e


def decode_all(files: list[UploadFile], raw: list[bytes], settings: Settings) -> list[DecodedImage]:
    """The files already read (``read_raw``) -> decoded, one at a time, after the request's pixel budget."""
    check_request_pixels([header_pixels(io.BytesIO(data)) for data in raw], settings)
    return [decode_one(f, data, settings) for f, data in zip(files, raw, strict=True)]


def read_images(files: list[UploadFile], settings: Settings, *, max_files: int | None = None,
                keep_data: bool = True) -> list[DecodedImage]:
    """Check the files (count, names, bytes, the request's pixels from the headers), then read and decode them
    one at a time. ``keep_data=False``: the bytes are dropped once decoded (a route that stores nothing)."""
    check_file_count(files, settings, max_files=max_files)
    pixels = []
    for f in files:
        size = f.file.seek(0, 2)
        if size > settings.max_file_bytes:
            raise _too_large(f, settings)
        pixels.append(header_pixels(f.file))  # from the file's start
    check_request_pixels(pixels, settings)
    return [decode_one(f, read_one(f, settings), settings, keep_data=keep_data) for f in files]

