"""The v1 routes' strict check (``app.routes.strict``) and the form parser it reads (``app.forms``), by value, on a
small FastAPI app of their own: the names each kind of route declares, every refusal's status and whole message,
and what passes. Sub-second; the v1 routes themselves are checked in ``test_app_strict.py`` and
``test_app_text_fields.py``."""

from __future__ import annotations

import asyncio
from typing import Annotated

import pytest
from fastapi import APIRouter, Depends, FastAPI, File, Form, Query, UploadFile
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from pydantic import BaseModel
from starlette.requests import Request

from app import forms
from app.routes.strict import _declared, _has_body, known_parameters


class Change(BaseModel):
    name: str | None = None


def paging(limit: Annotated[int, Query()] = 10, offset: Annotated[int, Query()] = 0) -> tuple[int, int]:
    return limit, offset


def label(label: Annotated[str | None, Form()] = None) -> str | None:
    return label


router = APIRouter()


@router.get("/items")
def items(page: Annotated[tuple[int, int], Depends(paging)], tag: Annotated[list[str], Query()] = []) -> dict:  # noqa: B006
    return {"page": list(page), "tag": tag}


@router.get("/plain")
def plain() -> dict:
    return {}


@router.post("/cancel")
def cancel() -> dict:
    return {}


@router.post("/upload")
def upload(files: Annotated[list[UploadFile], File()], name: Annotated[str | None, Form()] = None,
           lr: Annotated[float, Form()] = 0.1, tagged: Annotated[str | None, Depends(label)] = None) -> dict:
    return {"files": len(files), "name": name, "lr": lr, "label": tagged}


@router.post("/job")
def job(files: Annotated[list[UploadFile] | None, File()] = None, iterations: Annotated[int, Form()] = 200) -> dict:
    return {"files": len(files or []), "iterations": iterations}


@router.patch("/thing")
def thing(change: Change) -> dict:
    return change.model_dump()


@pytest.fixture(scope="module")
def api():
    forms.install()
    app = FastAPI()
    app.include_router(router, dependencies=[Depends(known_parameters)])
    with TestClient(app) as c:
        yield c


def route(path: str) -> APIRoute:
    return next(r for r in router.routes if isinstance(r, APIRoute) and r.path == path)


def png() -> list:
    return [("files", ("a.png", b"\x89PNG", "image/png"))]


def multipart(*parts: tuple[str, bytes, bool], charset: str | None = None) -> tuple[bytes, dict]:
    """A multipart body written by hand: ``(name, bytes, is_file)`` parts, sent as they are."""
    b = b"qlocboundary"
    body = b""
    for name, value, is_file in parts:
        disp = f'form-data; name="{name}"' + ('; filename="a.png"' if is_file else "")
        body += b"--" + b + f"\r\nContent-Disposition: {disp}\r\n\r\n".encode() + value + b"\r\n"
    ctype = "multipart/form-data; boundary=qlocboundary" + (f"; charset={charset}" if charset else "")
    return body + b"--" + b + b"--\r\n", {"content-type": ctype}


def detail(r) -> str:  # type: ignore[no-untyped-def]
    return r.json()["detail"]


def test_each_route_declares_its_query_parameters_and_form_fields_with_those_of_its_dependencies():
    assert _declared(route("/items")) == ({"limit", "offset", "tag"}, set(), {"tag"})
    assert _declared(route("/plain")) == (set(), set(), set())
    assert _declared(route("/upload")) == (set(), {"files", "name", "lr", "label"}, {"files"})
    assert _declared(route("/job")) == (set(), {"files", "iterations"}, {"files"})
    assert _declared(route("/thing")) == (set(), {"change"}, set())


@pytest.mark.parametrize(("headers", "has"), [
    ([], False), ([(b"content-length", b"0")], False), ([(b"content-length", b"")], False),
    ([(b"content-length", b"5")], True), ([(b"transfer-encoding", b"chunked")], True),
])
def test_a_body_is_one_with_a_length_above_zero_or_sent_in_chunks(headers, has):
    assert _has_body(Request({"type": "http", "method": "POST", "headers": headers})) is has


def test_unknown_query_parameters_are_named_with_the_ones_the_route_takes(api):
    r = api.get("/items", params={"limt": 1, "x": 2})
    assert r.status_code == 422 and detail(r) == (
        "unknown query parameters 'limt', 'x': GET /items takes query parameters: limit, offset, tag")
    r = api.get("/items", params={"x": 2})
    assert detail(r) == "unknown query parameter 'x': GET /items takes query parameters: limit, offset, tag"
    r = api.get("/plain", params={"x": 2})
    assert r.status_code == 422 and detail(r) == "unknown query parameter 'x': GET /plain takes query parameters: none"
    assert api.get("/items", params={"limit": 3, "offset": 1}).json() == {"page": [3, 1], "tag": []}


def test_a_parameter_sent_twice_is_refused_unless_it_takes_several(api):
    r = api.get("/items?limit=1&limit=2")
    assert r.status_code == 422 and detail(r) == (
        "query parameter 'limit' given more than once: it takes one value (send it once)")
    assert api.get("/items?tag=a&tag=b&limit=2").json() == {"page": [2, 0], "tag": ["a", "b"]}


def test_a_form_route_refuses_a_body_of_another_type_naming_what_it_got(api):
    r = api.post("/upload", json={"name": "x"})
    assert r.status_code == 415 and detail(r) == (
        "POST /upload takes multipart/form-data (curl -F files=@image.png -F name=value), got application/json")
    r = api.post("/upload", content=b"{}", headers={"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 415 and detail(r).endswith(", got application/json")
    r = api.post("/upload", content=b"{}")  # no Content-Type at all
    assert r.status_code == 415 and detail(r).endswith(", got a body without a Content-Type")
    r = api.post("/upload", content=iter([b"{", b"}"]), headers={"content-type": "application/json"})  # chunked
    assert r.status_code == 415 and "transfer-encoding" in r.request.headers
    r = api.post("/upload")  # no body: FastAPI's own 422 for the missing files, not a 415
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "files"]


def test_a_json_route_refuses_a_body_of_another_type_naming_what_it_got(api):
    r = api.patch("/thing", files=png())
    assert r.status_code == 415 and detail(r) == (
        "PATCH /thing takes a JSON body (Content-Type: application/json; curl -H 'Content-Type: application/json' "
        "-d '{...}'), got multipart/form-data")
    r = api.patch("/thing", content=b'{"name": "x"}')
    assert r.status_code == 415 and detail(r).endswith(", got no Content-Type")
    r = api.patch("/thing", content=iter([b'{"name": ', b'"x"}']), headers={"content-type": "text/plain"})
    assert r.status_code == 415 and detail(r).endswith(", got text/plain")
    assert api.patch("/thing", json={"name": "x"}).json() == {"name": "x"}


def test_an_urlencoded_form_is_refused_only_where_files_are_required(api):
    r = api.post("/upload", data={"name": "x"})
    assert r.status_code == 415 and detail(r) == (
        "POST /upload takes files: send multipart/form-data (curl -F files=@image.png -F name=value), not an "
        "urlencoded form (curl -d), which cannot carry files")
    assert api.post("/job", data={"iterations": "5"}).json() == {"files": 0, "iterations": 5}


def test_a_form_sent_to_a_route_that_takes_no_body_is_not_read(api):
    assert api.post("/cancel", data={"reason": "x"}).json() == {}
    assert api.post("/cancel", files=png()).json() == {}


def test_unknown_repeated_and_empty_form_fields_are_named(api):
    r = api.post("/upload", files=png(), data={"nme": "x", "lf": "1"})
    assert r.status_code == 422 and detail(r) == (
        "unknown form fields 'lf', 'nme': POST /upload takes form fields: files, label, lr, name")
    r = api.post("/upload", files=[*png(), ("name", (None, b"a")), ("name", (None, b"b"))])
    assert r.status_code == 422 and detail(r) == (
        "form field 'name' given more than once: it takes one value (send it once)")
    r = api.post("/upload", files=png(), data={"lr": " "})
    assert r.status_code == 422 and detail(r) == (
        "form field 'lr' is empty: give it a value, or leave it out for its default")
    body, headers = multipart(("files", b"", False))
    r = api.post("/upload", content=body, headers=headers)
    assert r.status_code == 422 and detail(r) == (
        "form field 'files' is empty: attach a file (curl -F 'files=@image.png')")
    r = api.post("/upload", files=[*png(), *png()], data={"name": "x", "label": "y"})  # files take several
    assert r.json() == {"files": 2, "name": "x", "lr": 0.1, "label": "y"}


def test_text_not_in_the_bodys_charset_is_refused_naming_the_field(api):
    body, headers = multipart(("files", b"\x89PNG\xff", True), ("name", b"caf\xe9", False))
    r = api.post("/upload", content=body, headers=headers)
    assert r.status_code == 422 and detail(r) == (
        "form field 'name' is not valid utf-8 text (byte 3): send it UTF-8 encoded")
    body, headers = multipart(("files", b"\x89PNG\xff", True), ("name", b"caf\xe9", False), charset="latin-1")
    assert api.post("/upload", content=body, headers=headers).json()["name"] == "café"  # a charset named: read in it


def test_a_charset_python_does_not_know_is_refused_where_there_is_text_to_read(api):
    body, headers = multipart(("files", b"\x89PNG", True), ("lr", b"0.5", False), ("name", b"x", False),
                              charset="no-such-charset")
    r = api.post("/upload", content=body, headers=headers)
    assert r.status_code == 422 and detail(r) == (
        "the body's Content-Type names charset 'no-such-charset', which is not known, so form field 'lr' cannot be "
        "read: send the form as UTF-8 (leave the charset parameter out)")
    body, headers = multipart(("files", b"\x89PNG", True), charset="no-such-charset")  # files only: nothing to read
    assert api.post("/upload", content=body, headers=headers).json()["files"] == 1
    # a file sent under a text field's name is no text to read: FastAPI says the field wants text
    body, headers = multipart(("files", b"\x89PNG", True), ("name", b"\x89PNG", True), charset="no-such-charset")
    r = api.post("/upload", content=body, headers=headers)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "name"], r.text


@pytest.mark.parametrize(("charset", "unknown"), [(None, None), ("latin-1", None), ("utf-8", None),
                                                  ("no-such-charset", "no-such-charset")])
def test_the_parser_names_a_charset_no_codec_reads_and_notes_each_field_not_in_it(charset, unknown):
    body, headers = multipart(("a", b"ok", False), ("b", b"\xff\xfe", False), ("b", b"\xfe", False),
                              ("f", b"\xff", True), charset=charset)
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "headers": [(b"content-type", headers["content-type"].encode())]}
    forms.install()

    async def parse() -> object:
        return await Request(scope, receive).form()

    form = asyncio.run(parse())
    assert isinstance(form, forms.TextCheckedForm) and form.unknown_charset == unknown
    expected = {"b": "not valid utf-8 text (byte 0)"} if charset in (None, "utf-8") else {}
    assert form.not_text == expected  # the first of a field's bad parts; never a file's bytes
    assert form.getlist("a") == ["ok"] and len(form.getlist("b")) == 2
