"""What the app serves to browsers, without a browser: the page's files, the docs pages with every asset from
the app (no CDN), and the bundle list the page offers. tests/browser renders them in Chromium."""

from __future__ import annotations

import re
import shutil

from service_fixtures import make_test_settings, migrate

EXTERNAL = re.compile(r"""(?:src|href)=["']?(?:https?:)?//""")


def test_the_page_and_its_assets(client) -> None:
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/static/app.js"' in page.text and not EXTERNAL.search(page.text)
    for path, kind in (("/static/app.js", "javascript"), ("/static/style.css", "text/css")):
        r = client.get(path)
        assert r.status_code == 200 and kind in r.headers["content-type"] and len(r.content) > 1000
    assert client.get("/static/nothing.js").status_code == 404
    assert "/" not in client.get("/openapi.json").json()["paths"]  # the page is not an API operation


def test_docs_load_everything_from_the_app(client) -> None:
    for path in ("/docs", "/redoc"):
        html = client.get(path).text
        assert not EXTERNAL.search(html) and "fonts.googleapis" not in html, html
        assets = re.findall(r"""(?:src|href)=["']?(/docs-assets/[^"'\s>]+)""", html)
        assert assets, html
        for asset in assets:
            assert client.get(asset).status_code == 200, asset
    redoc = client.get("/docs-assets/redoc.standalone.js").text
    assert "cdn.redoc.ly" not in redoc and "/docs-assets/favicon.png" in redoc
    assert client.get("/docs/oauth2-redirect").status_code == 200


def test_bundles_lists_the_installed_files_and_the_default(tmp_path, bundle_dir) -> None:
    from fastapi.testclient import TestClient

    from app.main import create_app

    installed = tmp_path / "bundles"
    installed.mkdir()
    shutil.copy(bundle_dir / "test-digits.pt", installed / "test-digits.pt")
    settings = make_test_settings(tmp_path, installed, default_bundle="test-digits", default_photo_bundle="test-other",
                                  api_keys=["k" * 16])
    migrate(settings.database_url)
    with TestClient(create_app(settings)) as c:
        assert c.get("/v1/bundles").status_code == 401
        key = {"X-API-Key": "k" * 16}
        assert c.get("/v1/bundles", headers=key).json() == {
            "data": [{"name": "test-digits", "default": True}], "default": "test-digits", "default_photo": None}
        shutil.copy(bundle_dir / "test-other.pt", installed / "test-other.pt")  # seen at the next request
        (installed / "notes.txt").write_text("not a bundle")
        listed = c.get("/v1/bundles", headers=key).json()
        assert [b["name"] for b in listed["data"]] == ["test-digits", "test-other"]
        assert listed["default_photo"] == "test-other"  # installed now: color photos get it
