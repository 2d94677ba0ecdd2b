"""Bad input gets the right 4xx and loses nothing: no row and no file is written.

Every test runs on SQLite and on PostgreSQL (one database for the module: the tests compare row counts
before and after, never expect an empty database).
"""

import io
import struct
import uuid
import zlib

import pytest
from PIL import Image
from service_fixtures import files, make_test_settings, migrate, png_bytes, snapshot


def bomb_png(width: int = 20_000, height: int = 20_000) -> bytes:
    """A valid PNG header claiming a huge image, with a tiny compressed body (decompression bomb)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    body = zlib.compress(b"\x00" * (width + 1) * 64, 9)  # the first rows only
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


def gif_bytes() -> bytes:
    buf = io.BytesIO()
    Image.new("L", (10, 10)).save(buf, "GIF")
    return buf.getvalue()


def apng_bytes(frames: int = 3) -> bytes:
    """An animated PNG: refused (415), not cut to its first frame."""
    imgs = [Image.new("L", (10, 10), 60 * i) for i in range(frames)]
    buf = io.BytesIO()
    imgs[0].save(buf, "PNG", save_all=True, append_images=imgs[1:])
    return buf.getvalue()


def awebp_bytes(frames: int = 3) -> bytes:
    """An animated WebP: refused (415) like an animated PNG."""
    imgs = [Image.new("RGB", (10, 10), (60 * i, 0, 0)) for i in range(frames)]
    buf = io.BytesIO()
    imgs[0].save(buf, "WEBP", save_all=True, append_images=imgs[1:])
    return buf.getvalue()


GOOD = png_bytes(40, 40)
# (case, multipart files, expected status); the settings allow 8 files of 200 kB, 1 Mpx each
CASES = {
    "not_an_image": (files(b"hello, I am text, not an image"), 415),
    "truncated_png": (files(GOOD[: len(GOOD) // 2]), 400),
    "truncated_jpeg_header": (files(b"\xff\xd8\xff\xe0\x00\x10JFIF"), 400),
    "empty": (files(b""), 400),
    "one_bad_among_good": (files(GOOD, GOOD, b"\x89PNG\r\n\x1a\ngarbage"), 400),
    "decompression_bomb": (files(bomb_png()), 413),
    "too_many_pixels": (files(png_bytes(1100, 1000, square=False)), 413),
    "too_many_files": (files(*[GOOD] * 9), 413),
    "file_too_large": (files(GOOD + b"\x00" * 200_001), 413),
    "gif": (files(gif_bytes(), content_type="image/gif"), 415),
    "gif_declared_png": (files(gif_bytes()), 415),
    "declared_text": (files(GOOD, content_type="text/plain"), 415),
    "animated_png": (files(GOOD, apng_bytes()), 415),
    "animated_webp": (files(GOOD, awebp_bytes(), content_type="image/webp"), 415),
    "riff_not_webp": (files(b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\x00" * 32), 415),
    "no_files": ([], 422),
    "wrong_field_name": (files(GOOD, field="file"), 422),
}


@pytest.fixture(params=["sqlite", "postgresql"])
def settings(request, tmp_path, bundle_dir):
    """The service's settings (``client`` follows them) on SQLite, then on PostgreSQL."""
    if request.param == "sqlite":
        s = make_test_settings(tmp_path, bundle_dir)
        migrate(s.database_url)
        return s
    return make_test_settings(tmp_path, bundle_dir, database_url=request.getfixturevalue("module_postgres_url"))


@pytest.fixture
def exemplar_set(client):
    r = client.post("/v1/exemplar-sets", files=files(png_bytes(28, 28)))
    assert r.status_code == 201
    return r.json()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("endpoint", ["create", "localize", "adapt"])
def test_bad_uploads_are_refused_and_nothing_is_written(client, settings, exemplar_set, endpoint, case):
    upload, expected = CASES[case]
    url = {"create": "/v1/exemplar-sets", "localize": f"/v1/exemplar-sets/{exemplar_set['id']}/localize",
           "adapt": f"/v1/exemplar-sets/{exemplar_set['id']}/adaptations"}[endpoint]
    before = snapshot(settings)
    # no file: a multipart form of one text field (an urlencoded one is a 415: test_app_strict.py)
    r = client.post(url, files=upload or [("name", (None, b"x"))])
    assert r.status_code == expected, r.text
    assert isinstance(r.json()["detail"], str | list)
    assert snapshot(settings) == before


@pytest.mark.parametrize("side", [5_000, 12_000, 20_000])
def test_an_image_over_the_pixel_limit_is_413_naming_that_limit_whatever_its_size(client, settings, side):
    """Under Pillow's own decompression-bomb bound and over it (12,000 and 20,000 px a side), the message names the
    service's limit (``QLOC_MAX_IMAGE_PIXELS``), not Pillow's."""
    r = client.post("/v1/exemplar-sets", files=files(bomb_png(side, side)))
    assert r.status_code == 413, r.text
    detail = r.json()["detail"]
    assert detail.endswith(f" pixels, the limit is {settings.max_image_pixels}") and "attack" not in detail, detail
    assert f"{side}x{side} pixels" in detail or f"{side * side} pixels" in detail, detail


def test_body_larger_than_all_files_allowed_is_413(client, settings):
    before = snapshot(settings)
    big = b"\x89PNG" + b"\x00" * (settings.max_request_bytes + 10)
    r = client.post("/v1/exemplar-sets", files=files(big))
    assert r.status_code == 413
    assert snapshot(settings) == before


@pytest.mark.parametrize("data", [{"iterations": "0"}, {"iterations": "51"}, {"iterations": "many"},
                                  {"learning_rate": "-1"}, {"learning_rate": "nan"}, {"seed": "-3"},
                                  {"activate": "perhaps"}])
def test_bad_job_parameters_are_422(client, settings, exemplar_set, data):
    before = snapshot(settings)
    r = client.post(f"/v1/exemplar-sets/{exemplar_set['id']}/adaptations", files=files(GOOD), data=data)
    assert r.status_code == 422, r.text
    if data.get("learning_rate") == "nan":
        assert r.json()["detail"][0]["msg"] == "Input should be a finite number", r.text
    assert snapshot(settings) == before


def test_unknown_ids_are_404(client, settings):
    before = snapshot(settings)
    unknown = uuid.uuid4()
    for method, url in [("get", f"/v1/exemplar-sets/{unknown}"), ("delete", f"/v1/exemplar-sets/{unknown}"),
                        ("get", f"/v1/exemplar-sets/{unknown}/checkpoints"),
                        ("get", f"/v1/exemplar-sets/{unknown}/adaptations"),
                        ("get", f"/v1/adaptations/{unknown}"), ("post", f"/v1/adaptations/{unknown}/cancel"),
                        ("get", f"/v1/checkpoints/{unknown}"), ("post", f"/v1/checkpoints/{unknown}/activate")]:
        r = client.request(method, url)
        assert r.status_code == 404, (method, url, r.text)
    for url in [f"/v1/exemplar-sets/{unknown}/localize", f"/v1/exemplar-sets/{unknown}/adaptations"]:
        assert client.post(url, files=files(GOOD)).status_code == 404
    assert client.get("/v1/exemplar-sets/not-a-uuid").status_code == 422
    assert snapshot(settings) == before


def test_jobs_in_the_wrong_state_are_409(client, settings, exemplar_set):
    set_id = exemplar_set["id"]
    job = client.post(f"/v1/exemplar-sets/{set_id}/adaptations", files=files(GOOD), data={"iterations": "2"})
    assert job.status_code == 202
    job_id = job.json()["id"]
    # a queued job blocks deleting its set
    assert client.delete(f"/v1/exemplar-sets/{set_id}").status_code == 409
    r = client.post(f"/v1/adaptations/{job_id}/cancel")
    assert r.status_code == 202 and r.json()["status"] == "canceled" and r.json()["finished_at"]
    before = snapshot(settings)
    r = client.post(f"/v1/adaptations/{job_id}/cancel")
    assert r.status_code == 409 and "canceled" in r.json()["detail"]
    assert snapshot(settings) == before
    assert client.delete(f"/v1/exemplar-sets/{set_id}").status_code == 204
