"""Form fields read as the text they are sent as.

Starlette decodes a multipart text field in the body's charset (UTF-8 unless the Content-Type names another) and,
where its bytes are not valid in it, silently as Latin-1: a set named with bytes from another encoding would be
stored as mojibake. ``TextCheckedParser`` keeps Starlette's reading but notes each such field in the form it
returns (``TextCheckedForm.not_text``); the v1 routes' strict check (``app.routes.strict``) refuses a text field
among them (422 naming it), where a file sent without a filename (its bytes a text part) is said so as before.
Filenames keep Starlette's fallback (a stored name only). ``install`` makes it the parser of every
``Request.form()`` (Starlette builds its parser by this module-level name).
"""

from __future__ import annotations

import codecs

from python_multipart.multipart import parse_options_header
from starlette import requests
from starlette.datastructures import FormData
from starlette.formparsers import MultiPartParser


class TextCheckedForm(FormData):
    """A parsed form, with the names of the text fields whose bytes were not valid in the body's charset, and the
    charset the body named if Python knows no such codec (Starlette then reads the text as Latin-1)."""

    def __init__(self, items: list, *, not_text: dict[str, str], unknown_charset: str | None = None):
        super().__init__(items)
        self.not_text = not_text
        """Field name -> what was wrong (the charset, the first bad byte's offset)."""
        self.unknown_charset = unknown_charset


class TextCheckedParser(MultiPartParser):
    """Starlette's multipart parser, noting the text fields that are not valid in the body's charset."""

    async def parse(self) -> FormData:
        self._not_text: dict[str, str] = {}
        form = await super().parse()
        unknown = None
        if self._charset == "latin-1":  # named so, or Starlette's fallback for a charset no codec reads
            named = parse_options_header(self.headers.get("Content-Type", ""))[1].get(b"charset", b"").decode("latin-1")
            try:
                codecs.lookup(named)
            except LookupError:
                unknown = named
        return TextCheckedForm(form.multi_items(), not_text=self._not_text, unknown_charset=unknown)

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is None:
            try:
                part.data.decode(self._charset)
            except UnicodeDecodeError as e:
                self._not_text.setdefault(part.field_name, f"not valid {self._charset} text (byte {e.start})")
        super().on_part_end()


def install() -> None:
    """Every multipart form the app reads is parsed by ``TextCheckedParser`` (idempotent)."""
    requests.MultiPartParser = TextCheckedParser
