"""Every limit on an upload answers a JSON ``detail``, through real HTTP (uvicorn in a subprocess), before
anything is decoded or written: the request's pixel budget, the whole-body limit (declared, or a chunked body
growing past it), and the multipart parser's own limits."""

import io
import json
import socket

import httpx
import pytest
from PIL import Image
from service_fixtures import Stack, make_test_settings, migrate, png_bytes, row_counts, stored_files

URL = "/v1/exemplar-sets"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, bundle_dir):
    root = tmp_path_factory.mktemp("limits")
    # 2 files of 100 kB (a body of at most 2 x 100 kB + 1 MiB), 60,000 pixels in all per request
    s = make_test_settings(root, bundle_dir, max_files_per_request=2, max_file_bytes=100_000,
                           max_request_pixels=60_000, decode_max_side=64, max_json_bytes=4096)
    migrate(s.database_url)
    st = Stack(s, root)
    st.start_api()
    try:
        st.wait_ready()
        yield st
    finally:
        st.stop()


def snapshot(stack):
    return row_counts(stack.settings.database_url), stored_files(stack.settings.storage_dir)


def jpeg(width, height):
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (90, 20, 200)).save(buf, "JPEG")
    return buf.getvalue()


def raw_exchange(stack, head: bytes, body: list[bytes] = ()) -> tuple[int, dict[str, str], bytes]:
    """Send ``head`` then each piece of ``body`` on one connection; -> the response's status, headers, body."""
    with socket.create_connection(("127.0.0.1", stack.port), timeout=30) as c:
        c.sendall(head)
        for piece in body:
            try:
                c.sendall(piece)
            except OSError:  # the server answered and closed before reading it all
                break
        data = b""
        while b"\r\n\r\n" not in data:
            data += c.recv(65536)
        header, _, rest = data.partition(b"\r\n\r\n")
        lines = header.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        while len(rest) < int(headers.get("content-length", 0)):
            rest += c.recv(65536)
    return int(lines[0].split()[1]), headers, rest


def multipart_head(stack, extra: str) -> bytes:
    return (f"POST {URL} HTTP/1.1\r\nHost: 127.0.0.1:{stack.port}\r\n"
            f"Content-Type: multipart/form-data; boundary=b\r\n{extra}\r\n").encode()


def json_detail(status: int, headers: dict[str, str], body: bytes) -> str:
    assert headers["content-type"] == "application/json", (status, headers, body)
    detail = json.loads(body)["detail"]
    assert isinstance(detail, str) and detail
    return detail


def test_declared_body_over_the_limit_is_a_json_413_before_the_body_is_read(stack):
    limit = stack.settings.max_request_bytes
    before = snapshot(stack)
    status, headers, body = raw_exchange(stack, multipart_head(stack, f"Content-Length: {limit + 1}\r\n"))
    assert status == 413 and str(limit) in json_detail(status, headers, body)
    assert snapshot(stack) == before


def test_chunked_body_growing_past_the_limit_is_a_json_413(stack):
    limit = stack.settings.max_request_bytes
    part = b'--b\r\nContent-Disposition: form-data; name="files"; filename="a.png"\r\nContent-Type: image/png\r\n\r\n'
    chunk = b"\x00" * 65536
    pieces = [part] + [chunk] * (limit // len(chunk) + 2)
    body = [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces] + [b"0\r\n\r\n"]
    before = snapshot(stack)
    status, headers, answer = raw_exchange(stack, multipart_head(stack, "Transfer-Encoding: chunked\r\n"), body)
    assert status == 413 and str(limit) in json_detail(status, headers, answer)
    assert snapshot(stack) == before


def test_a_json_body_has_a_limit_of_its_own_declared_or_chunked_and_nothing_changes(stack):
    r = httpx.post(f"{stack.base_url}{URL}", files=[("files", ("a.png", png_bytes(28, 28)))], data={"name": "n"})
    assert r.status_code == 201, r.text  # a multipart body over the JSON limit (the PNG alone) is taken
    sid = r.json()["id"]
    before = snapshot(stack)
    big = json.dumps({"name": "x" * 5000}).encode()
    r = httpx.patch(f"{stack.base_url}{URL}/{sid}", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "4096" in r.json()["detail"] and "multipart" in r.json()["detail"]
    head = (f"PATCH {URL}/{sid} HTTP/1.1\r\nHost: 127.0.0.1:{stack.port}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    pieces = [big[i:i + 1000] for i in range(0, len(big), 1000)]
    status, headers, answer = raw_exchange(stack, head, [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces]
                                           + [b"0\r\n\r\n"])
    assert status == 413 and "4096" in json_detail(status, headers, answer)
    assert snapshot(stack) == before
    assert httpx.get(f"{stack.base_url}{URL}/{sid}").json()["name"] == "n"
    r = httpx.patch(f"{stack.base_url}{URL}/{sid}", json={"name": "y" * 200})  # within the limit: taken
    assert r.status_code == 200 and r.json()["name"] == "y" * 200


def test_a_body_sent_whole_over_the_limit_is_a_json_413(stack):
    r = httpx.post(f"{stack.base_url}{URL}", files=[("files", ("a.png", b"\x89PNG" + b"\x00" * 1_300_000))])
    assert r.status_code == 413 and r.headers["content-type"] == "application/json" and r.json()["detail"]


@pytest.mark.parametrize("case,expected,words", [
    # 2 x 200x200 = 80,000 pixels: over the request's 60,000 (each image alone is within every limit)
    ("pixels", 413, ["80,000 pixels", "60,000"]),
    ("files", 413, ["3 files", "at most 2"]),
    ("file_bytes", 413, ["100000 bytes"]),
    ("animated", 415, ["animated"]),
])
def test_upload_limits_are_json_through_http(stack, case, expected, words):
    frames = [Image.new("RGB", (20, 20), (i * 80, 0, 0)) for i in range(3)]
    apng = io.BytesIO()
    frames[0].save(apng, "PNG", save_all=True, append_images=frames[1:])
    blobs = {"pixels": [jpeg(200, 200), jpeg(200, 200)], "files": [png_bytes(28, 28)] * 3,
             "file_bytes": [png_bytes(28, 28) + b"\x00" * 100_001], "animated": [apng.getvalue()]}[case]
    before = snapshot(stack)
    r = httpx.post(f"{stack.base_url}{URL}", files=[("files", (f"{i}.img", b, "image/png"))
                                                   for i, b in enumerate(blobs)], timeout=60)
    assert r.status_code == expected and r.headers["content-type"] == "application/json", r.text
    assert all(w in r.json()["detail"] for w in words), r.text
    assert snapshot(stack) == before
    assert httpx.post(f"{stack.base_url}{URL}", files=[("files", ("ok.jpg", jpeg(200, 200), "image/jpeg"))],
                      timeout=60).status_code == 201  # one of them alone is fine


@pytest.mark.parametrize("case,words", [
    ("fields", "Too many fields"),  # the multipart parser's own limits (Starlette: 1000 fields, 1000 files,
    ("files", "Too many files"),    # 1 MiB per text field), met before the route's: a JSON 400 naming the limit
    ("field_bytes", "maximum size"),
])
def test_the_multipart_parsers_own_limits_are_json(stack, case, words):
    if case == "fields":
        body = b"".join(b'--b\r\nContent-Disposition: form-data; name="f%d"\r\n\r\nx\r\n' % i for i in range(1001))
    elif case == "files":
        body = b"".join(b'--b\r\nContent-Disposition: form-data; name="files"; filename="a.png"\r\n\r\nx\r\n'
                        for _ in range(1001))
    else:
        body = b'--b\r\nContent-Disposition: form-data; name="boxes"\r\n\r\n' + b"[" * (1024 * 1024 + 1) + b"\r\n"
    r = httpx.post(f"{stack.base_url}{URL}", content=body + b"--b--\r\n",
                   headers={"content-type": "multipart/form-data; boundary=b"}, timeout=60)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    assert words in r.json()["detail"]


@pytest.mark.parametrize("endpoint", ["localize", "adaptations"])
def test_the_pixel_budget_holds_on_every_upload_route(stack, endpoint):
    r = httpx.post(f"{stack.base_url}{URL}", files=[("files", ("c.png", png_bytes(28, 28), "image/png"))])
    assert r.status_code == 201, r.text
    url = f"{stack.base_url}{URL}/{r.json()['id']}/{endpoint}"
    before = snapshot(stack)
    r = httpx.post(url, files=[("files", (f"{i}.jpg", jpeg(200, 200), "image/jpeg")) for i in range(2)], timeout=60)
    assert r.status_code == 413 and "80,000 pixels" in r.json()["detail"], r.text
    assert snapshot(stack) == before
