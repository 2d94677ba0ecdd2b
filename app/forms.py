"""Form fields read as the text they are sent as.

Starlette decodes a multipart text field in the body's charset (UTF-8 unless the Content-Type names another) and,
where its bytes are not valid in it, silently as Latin-1: a set named with bytes from another encoding would be
stored as mojibake. ``StrictFormParser`` refuses such a field instead (422 naming it), before any route runs;
filenames keep Starlette's fallback (a stored name only, never read back as the set's data). ``install`` makes it
the parser of every ``Request.form()`` (Starlette builds its parser by this module-level name).
"""

from __future__ import annotations

from fastapi import HTTPException, status
from starlette import requests
from starlette.formparsers import MultiPartParser


class StrictFormParser(MultiPartParser):
    """Starlette's multipart parser, but a text field whose bytes are not valid in the body's charset is a 422."""

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is None:
            try:
                part.data.decode(self._charset)
            except UnicodeDecodeError as e:
                raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, (
                    f"form field {part.field_name!r} is not valid {self._charset} text (byte {e.start} of its "
                    "value): send it UTF-8 encoded")) from e
        super().on_part_end()


def install() -> None:
    """Every form the app reads is parsed by ``StrictFormParser`` (idempotent)."""
    requests.MultiPartParser = StrictFormParser
