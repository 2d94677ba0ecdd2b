"""Text that one database stores and the other refuses (a NUL byte: PostgreSQL rejects it, SQLite keeps it) is
a 422 on both, before anything is written; so is a filename longer than its column."""

import pytest
from fastapi.testclient import TestClient
from service_fixtures import files, png_bytes

from app.main import create_app


@pytest.fixture
def api(db_settings):
    app = create_app(db_settings)
    with TestClient(app) as c:
        yield c
    app.state.engine.dispose()


def raw_multipart(filename: bytes, data: bytes) -> tuple[bytes, dict]:
    """A multipart body written by hand, so the filename's bytes reach the server as they are (a client
    library may escape a NUL)."""
    b = b"qlocboundary"
    body = (b"--" + b + b'\r\nContent-Disposition: form-data; name="files"; filename="' + filename
            + b'"\r\nContent-Type: image/png\r\n\r\n' + data + b"\r\n--" + b + b"--\r\n")
    return body, {"content-type": "multipart/form-data; boundary=qlocboundary"}


def blob_files(settings) -> set:
    return {p for p in settings.storage_dir.rglob("*") if p.is_file()}


@pytest.mark.parametrize("where", ["name", "filename", "long filename"])
def test_unstorable_text_is_a_422_on_both_databases_and_nothing_is_written(api, db_settings, where):
    before = blob_files(db_settings)
    if where == "name":
        r = api.post("/v1/exemplar-sets", files=files(png_bytes(28, 28)), data={"name": "fo\x00ur"})
    elif where == "filename":
        body, headers = raw_multipart(b"crop\x00.png", png_bytes(28, 28))
        r = api.post("/v1/exemplar-sets", content=body, headers=headers)
    else:
        r = api.post("/v1/exemplar-sets", files=[("files", ("c" * 300 + ".png", png_bytes(28, 28), "image/png"))])
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert ("NUL" in detail) if where != "long filename" else ("at most 255" in detail)
    assert api.get("/v1/exemplar-sets").json()["data"] == [] and blob_files(db_settings) == before
    # an adaptation upload with such a filename is refused the same way
    ok = api.post("/v1/exemplar-sets", files=files(png_bytes(28, 28))).json()
    body, headers = raw_multipart(b"u\x00.png", png_bytes())
    r = api.post(f"/v1/exemplar-sets/{ok['id']}/adaptations", content=body, headers=headers)
    assert r.status_code == 422 and "NUL" in r.json()["detail"]
    assert api.get(f"/v1/exemplar-sets/{ok['id']}/adaptations").json()["data"] == []


def raw_text_field(name: str, value: bytes, charset: str | None = None) -> tuple[bytes, dict]:
    """A crop and one text field whose bytes reach the server as they are."""
    b = b"qlocboundary"
    body = (b"--" + b + b'\r\nContent-Disposition: form-data; name="files"; filename="a.png"\r\nContent-Type: '
            b"image/png\r\n\r\n" + png_bytes(28, 28) + b"\r\n--" + b + b'\r\nContent-Disposition: form-data; name="'
            + name.encode() + b'"\r\n\r\n' + value + b"\r\n--" + b + b"--\r\n")
    ctype = "multipart/form-data; boundary=qlocboundary" + (f"; charset={charset}" if charset else "")
    return body, {"content-type": ctype}


def test_a_text_field_that_is_not_utf8_is_a_422_naming_it_and_nothing_is_written(api, db_settings):
    before = blob_files(db_settings)
    body, headers = raw_text_field("name", b"caf\xe9")  # Latin-1 bytes, sent as UTF-8 (the default)
    r = api.post("/v1/exemplar-sets", content=body, headers=headers)
    assert r.status_code == 422 and "'name'" in r.json()["detail"] and "UTF-8" in r.json()["detail"], r.text
    assert api.get("/v1/exemplar-sets").json()["data"] == [] and blob_files(db_settings) == before
    body, headers = raw_text_field("name", "café ∑".encode())  # valid UTF-8: stored as sent
    r = api.post("/v1/exemplar-sets", content=body, headers=headers)
    assert r.status_code == 201 and r.json()["name"] == "café ∑", r.text
    body, headers = raw_text_field("name", b"caf\xe9", charset="latin-1")  # a charset named: read in it
    r = api.post("/v1/exemplar-sets", content=body, headers=headers)
    assert r.status_code == 201 and r.json()["name"] == "café", r.text
    body, headers = raw_text_field("name", b"four", charset="no-such-charset")  # a charset Python does not know
    r = api.post("/v1/exemplar-sets", content=body, headers=headers)
    assert r.status_code == 422 and "no-such-charset" in r.json()["detail"] and "'name'" in r.json()["detail"], r.text
    assert len(api.get("/v1/exemplar-sets").json()["data"]) == 2  # the two taken above, nothing more
    crop_only = (body.split(b'\r\n--qlocboundary\r\nContent-Disposition: form-data; name="name"')[0]
                 + b"\r\n--qlocboundary--\r\n")
    r = api.post("/v1/exemplar-sets", content=crop_only, headers=headers)  # no text field to misread: taken
    assert r.status_code == 201, r.text
