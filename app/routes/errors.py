"""The error responses the routes declare in the OpenAPI spec: every error is a JSON ``{"detail": ...}``."""

from __future__ import annotations

from typing import Any

from app.schemas import ErrorDetail, ValidationErrorDetail


def error(description: str) -> dict[str, Any]:
    """An error response with a message: ``{"detail": "..."}``."""
    return {"model": ErrorDetail, "description": description}


RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying (on a 503 of a busy model or of no "
                                               "localize worker)", "schema": {"type": "integer"}}}


def unavailable(description: str) -> dict[str, Any]:
    """A 503 that may carry ``Retry-After``."""
    return {**error(description), "headers": RETRY_AFTER}


def invalid(description: str) -> dict[str, Any]:
    """422 from a route that also refuses values itself: FastAPI's list of issues, or a message."""
    return {"model": ValidationErrorDetail, "description": description}


UNAUTHORIZED = {401: error("Missing or invalid API key (only when the server has API keys)")}

JSON_TOO_LARGE = {413: error("A body that is not multipart/form-data larger than QLOC_MAX_JSON_BYTES (4 MiB)")}

UPLOAD_ERRORS = {
    400: error("A PNG, JPEG or WebP that cannot be decoded (truncated, corrupt) or an empty file"),
    413: error("Too many files, a file or image too large, more pixels in all than the request's budget "
               "(QLOC_MAX_REQUEST_PIXELS, from the headers, before decoding), or the request body too large"),
    415: error("Not a PNG, JPEG or WebP (whatever its name or declared type), or an animated PNG or WebP (send "
               "the frame to use as a still image), or a "
               "body that is not multipart/form-data (JSON, say)"),
}
