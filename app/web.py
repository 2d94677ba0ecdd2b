"""What people open in a browser: the search page at ``/`` and the API docs at ``/docs`` and ``/redoc``.

Everything is served by the app itself, with nothing fetched from the internet: the page is plain HTML, CSS
and JavaScript in ``app/static/``; Swagger UI (Apache-2.0) and ReDoc (MIT) are the minified bundles shipped
in the ``fastapi-offline`` wheel (MIT), which the docs pages point at instead of a CDN (ReDoc's with the one
image it would fetch by itself pointed here too).
"""

from __future__ import annotations

import functools
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent / "static"
"""The page: index.html, app.js, style.css."""

STATIC_URL = "/static"
DOCS_ASSETS_URL = "/docs-assets"


def docs_assets_dir() -> Path:
    """Swagger UI's and ReDoc's files, from the installed ``fastapi-offline`` package."""
    import fastapi_offline

    return Path(fastapi_offline.__file__).resolve().parent / "static"


REDOC_JS = "redoc.standalone.js"
REDOC_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"
"""The one URL ReDoc's bundle fetches by itself (its "API docs by Redocly" logo): served from here instead."""


@functools.cache
def redoc_js() -> bytes:
    text = (docs_assets_dir() / REDOC_JS).read_text(encoding="utf-8")
    return text.replace(REDOC_LOGO, f"{DOCS_ASSETS_URL}/favicon.png").encode()


def install(app: FastAPI) -> None:
    """Add the page and the offline docs to ``app`` (created with ``docs_url=None, redoc_url=None``)."""

    @app.get(f"{DOCS_ASSETS_URL}/{REDOC_JS}", include_in_schema=False)
    def redoc_bundle() -> Response:  # before the mount: the patched copy wins
        return Response(redoc_js(), media_type="text/javascript", headers={"Cache-Control": "public, max-age=3600"})

    app.mount(STATIC_URL, StaticFiles(directory=STATIC_DIR), name="static")
    app.mount(DOCS_ASSETS_URL, StaticFiles(directory=docs_assets_dir()), name="docs-assets")
    oauth2_redirect_url = app.swagger_ui_oauth2_redirect_url or "/docs/oauth2-redirect"

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/docs", include_in_schema=False)
    def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - API docs",
            oauth2_redirect_url=f"{root}{oauth2_redirect_url}",
            swagger_js_url=f"{root}{DOCS_ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{DOCS_ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{DOCS_ASSETS_URL}/favicon.png")

    @app.get(oauth2_redirect_url, include_in_schema=False)
    def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - API reference",
                              redoc_js_url=f"{root}{DOCS_ASSETS_URL}/redoc.standalone.js",
                              redoc_favicon_url=f"{root}{DOCS_ASSETS_URL}/favicon.png", with_google_fonts=False)
