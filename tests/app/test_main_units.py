"""``app.main`` by value, below HTTP: the body limits' middleware on a recording ASGI app, and what the error handlers
show of an invalid value. Through HTTP: ``test_app_upload_limits.py`` (uvicorn), ``test_app_strict.py``."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import pytest
from starlette.datastructures import Headers, UploadFile

from app.main import INPUT_SHOWN, BodyLimitMiddleware, BodyTooLarge, _encodable, _error, _shown

MULTIPART = "request body larger than 100 bytes"


def other_words(limit: int) -> str:
    return (f"a body that is not multipart/form-data (JSON, say) larger than {limit} bytes (the server's "
            "QLOC_MAX_JSON_BYTES)")


def exchange(middleware: BodyLimitMiddleware, headers: dict[str, str], chunks: list[bytes] | None = None,
             scope_type: str = "http") -> tuple[list[bytes] | None, list[dict[str, Any]]]:
    """One request through ``middleware`` -> (the body the app read, ``None`` where the app was not called; what
    was sent back). The app reads every message its ``receive`` gives until the last chunk, then answers 200."""
    chunks = chunks or [b""]
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict[str, Any]] = []
    read: list[bytes] | None = None

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def app(scope: dict[str, Any], receive_, send_) -> None:  # type: ignore[no-untyped-def]
        nonlocal read
        read = []
        while True:
            m = await receive_()
            read.append(m.get("body", b""))
            if not m.get("more_body"):
                break
        await send_({"type": "http.response.start", "status": 200, "headers": []})
        await send_({"type": "http.response.body", "body": b"ok"})

    middleware.app = app
    scope = {"type": scope_type, "method": "POST", "path": "/x", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(middleware(scope, receive, send))
    return read, sent


def answered(sent: list[dict[str, Any]]) -> tuple[int, str, str]:
    start, body = sent
    return start["status"], Headers(raw=start["headers"])["content-type"], json.loads(body["body"])["detail"]


def limits(max_body_size: int = 100, max_other_size: int | None = 10) -> BodyLimitMiddleware:
    return BodyLimitMiddleware(None, max_body_size, max_other_size)  # type: ignore[arg-type]


def test_a_declared_length_over_the_limit_is_a_json_413_before_the_body_is_read():
    form = {"content-type": "multipart/form-data; boundary=b"}
    read, sent = exchange(limits(), {**form, "content-length": "101"})
    assert read is None and answered(sent) == (413, "application/json", MULTIPART)
    read, sent = exchange(limits(), {"content-type": "Multipart/Form-Data; boundary=b", "content-length": "101"})
    assert read is None and answered(sent)[2] == MULTIPART  # the type in any case
    read, sent = exchange(limits(), {**form, "content-length": "100"}, [b"x" * 100])  # at the limit: read
    assert read == [b"x" * 100] and sent[0]["status"] == 200
    for body in ({"content-type": "application/json"}, {}):  # any other body (or none named): its own limit
        read, sent = exchange(limits(), {**body, "content-length": "11"})
        assert read is None and answered(sent) == (413, "application/json", other_words(10))
        read, sent = exchange(limits(), {**body, "content-length": "10"}, [b"x" * 10])
        assert read == [b"x" * 10] and sent[0]["status"] == 200
    # a length that is no number is left to the server; the body is still counted
    read, sent = exchange(limits(), {**form, "content-length": "-5"}, [b"x" * 50])
    assert read == [b"x" * 50] and sent[0]["status"] == 200


def test_the_other_limit_is_never_above_the_multipart_one_and_defaults_to_it():
    for other, expected in ((None, 100), (500, 100), (10, 10), (100, 100)):
        m = limits(100, other)
        assert m.other == (expected, other_words(expected)) and m.multipart == (100, MULTIPART)
        read, sent = exchange(m, {"content-type": "application/json", "content-length": str(expected + 1)})
        assert read is None and answered(sent)[2] == other_words(expected)


def test_a_body_growing_past_the_limit_raises_as_its_chunks_arrive_and_only_then():
    form = {"content-type": "multipart/form-data; boundary=b"}
    read, sent = exchange(limits(), form, [b"x" * 40, b"x" * 40, b"x" * 20])  # 100 in all: at the limit
    assert read == [b"x" * 40, b"x" * 40, b"x" * 20] and sent[0]["status"] == 200
    with pytest.raises(BodyTooLarge) as e:
        exchange(limits(), form, [b"x" * 40, b"x" * 40, b"x" * 21])
    assert (e.value.status_code, e.value.detail) == (413, MULTIPART)
    with pytest.raises(BodyTooLarge) as e:
        exchange(limits(), {"content-type": "application/json"}, [b"x" * 6, b"x" * 5])
    assert (e.value.status_code, e.value.detail) == (413, other_words(10))


def test_what_is_not_an_http_request_passes_untouched():
    read, sent = exchange(limits(), {"content-length": "1000"}, [b"x" * 1000], scope_type="websocket")
    assert read == [b"x" * 1000] and sent[0]["status"] == 200


def test_a_long_value_is_shown_cut_with_its_length_and_a_file_by_its_name_and_size():
    assert INPUT_SHOWN == 200
    assert _shown("k" * 200) == "k" * 200 and _shown(b"k" * 200) == b"k" * 200 and _shown(7) == 7
    assert _shown("k" * 201) == "k" * 200 + "... (201 characters)"
    assert _shown(b"k" * 201) == str(b"k" * 200) + "... (201 bytes)"
    assert _shown(UploadFile(io.BytesIO(b"abc"), filename="a.png", size=3)) == "a file (a.png, 3 bytes)"
    assert _shown(UploadFile(io.BytesIO(b""), size=0)) == "a file (no filename, 0 bytes)"


def test_an_error_says_what_to_send_for_a_file_in_a_text_field_and_text_in_a_file_field():
    plain = {"type": "int_parsing", "loc": ["query", "samples"], "msg": "not an int"}
    assert _error(plain) is plain  # no input: as it was
    assert _error({**plain, "input": "k" * 201}) == {**plain, "input": "k" * 200 + "... (201 characters)"}
    upload = UploadFile(io.BytesIO(b"[]"), filename="boxes.json", size=2)
    err = _error({"type": "string_type", "loc": ["body", "boxes"], "msg": "Input should be a valid string",
                  "input": upload})
    assert err["input"] == "a file (boxes.json, 2 bytes)"
    assert err["msg"] == ("boxes is a text field, not a file: send its value (curl -F 'boxes=<file' sends a file's "
                          "text as the value; -F 'boxes=@file' sends the file)")
    err = _error({"type": "string_type", "loc": ["query", "boxes"], "msg": "m", "input": upload})
    assert err["msg"] == "m"  # not a form field: the message as it was
    files = ("files takes files, not text: attach one (curl -F 'files=@image.png'); a part sent without a filename "
             "(or with an empty one) is read as text: give each file a filename")
    err = _error({"type": "value_error", "loc": ["body", "files", 0], "msg": "Value error, Expected UploadFile, "
                  "received: <class 'str'>", "input": "\x89PNG" + "x" * 300})
    assert err["msg"] == files and err["input"] == "text of 304 characters (not shown)"
    err = _error({"type": "value_error", "loc": ["body", "files", 0], "msg": "Expected UploadFile", "input": 5})
    assert err["msg"] == files and err["input"] == 5  # not text: shown as it is
    err = _error({"type": "value_error", "loc": ["body"], "msg": "Expected UploadFile", "input": "x"})
    assert err == {"type": "value_error", "loc": ["body"], "msg": "Expected UploadFile", "input": "x"}  # no field


def test_what_json_cannot_hold_is_echoed_as_text():
    value = {"threshold": float("nan"), "up": float("inf"), "down": float("-inf"), "k": ["\ud800", 1.5, [2, "a"]],
             "\udfff": None, "n": 3}
    assert _encodable(value) == {"threshold": "nan", "up": "inf", "down": "-inf", "k": ["\\ud800", 1.5, [2, "a"]],
                                 "\\udfff": None, "n": 3}
    json.dumps(_encodable(value), allow_nan=False).encode("utf-8")  # valid JSON, encodable
    assert _encodable("é") == "é" and _encodable(True) is True
