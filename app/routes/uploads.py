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


def check_file_count(files: list[UploadFile], settings: Settings, *, max_files: int | None = None) -> None:
    limit = min(settings.max_files_per_request, max_files or settings.max_files_per_request)
    if not files:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "at least one file is required")
    if len(files) > limit:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, f"{len(files)} files; at most {limit} per request")


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
