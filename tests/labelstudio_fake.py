"""A stand-in for Label Studio and for any image host, for the ML backend's tests: a local HTTP server."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from service_fixtures import png_bytes


class FakeLabelStudio:
    """A local HTTP server: images under ``/data/upload/3/<name>`` (and anywhere else by name), Label Studio's
    task list (``/api/tasks/?project=3``), its token exchange (``/api/token/refresh/``), redirects
    (``/redirect/<n>/<name>``: n hops, then the image), a slow answer (``/slow/<name>``: after 2 s); records each
    request's path and Authorization header, and its User-Agent."""

    def __init__(self, images: dict[str, bytes]):
        self.images = images
        self.seen: list[tuple[str, str | None]] = []
        self.agents: list[str | None] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                fake.seen.append((self.path, self.headers.get("Authorization")))
                fake.agents.append(self.headers.get("User-Agent"))
                if self.path.startswith("/redirect/"):
                    hops, name = self.path.split("/")[2:4]
                    self.send_response(302)
                    self.send_header("Location", f"/redirect/{int(hops) - 1}/{name}" if int(hops) > 1 else f"/{name}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path.startswith("/slow/"):
                    time.sleep(2.0)
                if self.path.startswith("/api/tasks/"):
                    tasks = [{"id": k + 1, "data": {"picture": f"/data/upload/3/{n}"}, "project": 3}
                             for k, n in enumerate(fake.images)]
                    tasks.append({"id": 99, "data": {"picture": "/data/upload/3/missing.png"}, "project": 3})
                    self._send(200, json.dumps({"tasks": tasks, "total": len(tasks)}).encode(), "application/json")
                    return
                name = self.path.rsplit("/", 1)[-1]
                if self.path.startswith("/tasks/"):  # the resolver of cloud storage URIs: ?fileuri=<base64 URI>
                    uri = base64.urlsafe_b64decode(self.path.split("fileuri=", 1)[1]).decode()
                    name = uri.rsplit("/", 1)[-1]
                if name in fake.images:
                    self._send(200, fake.images[name], "image/png")
                else:
                    self._send(404, b"not found", "text/plain")

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                fake.seen.append((self.path, self.headers.get("Authorization")))
                if self.path == "/api/token/refresh/" and json.loads(body).get("refresh") == JWT:
                    self._send(200, json.dumps({"access": "short-lived"}).encode(), "application/json")
                else:
                    self._send(401, b"{}", "application/json")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeLabelStudio:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


JWT = "eyJhbGciOiJIUzI1NiJ9.eyJ0b2tlbl90eXBlIjoicmVmcmVzaCJ9.c2ln"

IMAGES = {"a.png": png_bytes(seed=1), "b.png": png_bytes(120, 90, seed=2), "c.png": png_bytes(64, 100, seed=3)}


@pytest.fixture
def fake_ls() -> Iterator[FakeLabelStudio]:
    with FakeLabelStudio(dict(IMAGES)) as f:
        yield f
