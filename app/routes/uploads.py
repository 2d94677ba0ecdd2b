"""Reading multipart image uploads in the routes: every file is checked before anything is stored."""

from __future__ import annotations

from fastapi import HTTPException, UploadFile, status

from app.config import Settings
from app.images import DecodedImage, ImageRejected, UploadLimits, decode_image

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


def read_raw(files: list[UploadFile], settings: Settings) -> list[bytes]:
    """Each file's bytes, refusing one larger than the limit without reading all of it."""
    out = []
    for f in files:
        data = f.file.read(settings.max_file_bytes + 1)
        if len(data) > settings.max_file_bytes:
            raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE,
                                f"{f.filename or 'upload'}: larger than {settings.max_file_bytes} bytes")
        out.append(data)
    return out


def decode_all(files: list[UploadFile], raw: list[bytes], settings: Settings) -> list[DecodedImage]:
    limits = UploadLimits(settings.max_file_bytes, settings.max_image_pixels)
    images = []
    for f, data in zip(files, raw, strict=True):
        try:
            images.append(decode_image(data, filename=f.filename, declared_type=f.content_type, limits=limits))
        except ImageRejected as e:
            raise HTTPException(REJECTION_STATUS[e.reason], e.detail) from e
    return images


def read_images(files: list[UploadFile], settings: Settings, *, max_files: int | None = None) -> list[DecodedImage]:
    check_file_count(files, settings, max_files=max_files)
    return decode_all(files, read_raw(files, settings), settings)
