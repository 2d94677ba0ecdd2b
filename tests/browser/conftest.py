"""A real browser (Debian's Chromium, driven by Playwright) on the real service: uvicorn and a Celery worker on
the embedded default (SQLite, SQLAlchemy broker), started once for the directory.

Needs ``/usr/bin/chromium`` (``apt-get install -y chromium``; ``scripts/test`` installs it when it runs as root
through ``scripts/browser-deps``) and the ``playwright`` package (the dev extra, ``scripts/bootstrap``). Playwright
never downloads a browser here: it launches the system one. Without them the tests skip, saying how to enable
them; on CI (``CI`` set) a missing browser fails instead.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from service_fixtures import Stack, bundle_dir, make_test_settings, migrate, started  # noqa: F401

CHROMIUM = os.environ.get("QLOC_CHROMIUM", "/usr/bin/chromium")
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ENABLE = ("enable them with `apt-get install -y chromium` (or run ./scripts/test as root: scripts/browser-deps "
          "installs it) and ./scripts/bootstrap (the playwright package); QLOC_CHROMIUM names another binary")
LOCAL_HOSTS = {"127.0.0.1", "localhost"}


def _unavailable(why: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"browser tests cannot run on CI: {why}; {ENABLE}")
    pytest.skip(f"browser tests skipped: {why}; {ENABLE}")


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, bundle_dir: Path) -> Iterator[Stack]:  # noqa: F811
    root = tmp_path_factory.mktemp("browser-stack")
    # a photo default installed: the page offers "auto" (no bundle sent) first
    settings = make_test_settings(root, bundle_dir, synthetic_probes=8, default_photo_bundle="test-other")
    migrate(settings.database_url)
    with started(settings, root) as st:
        yield st


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    if not (os.path.isfile(CHROMIUM) or shutil.which(CHROMIUM)):
        _unavailable(f"no Chromium at {CHROMIUM}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is not installed")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        yield b
        b.close()


class PageWatch:
    """What a page did wrong: requests to anywhere but the service (aborted), JavaScript errors."""

    def __init__(self) -> None:
        self.external: list[str] = []
        self.js_errors: list[str] = []


@pytest.fixture
def watch() -> PageWatch:
    return PageWatch()


@pytest.fixture
def page(browser, stack: Stack, watch: PageWatch):  # type: ignore[no-untyped-def]
    """A fresh laptop-sized page on the service; any request off 127.0.0.1/localhost is aborted and recorded,
    and an uncaught JavaScript error fails the test."""
    context = browser.new_context(viewport={"width": 1366, "height": 800}, base_url=stack.base_url)

    def gate(route) -> None:  # type: ignore[no-untyped-def]
        url = urlsplit(route.request.url)
        if url.scheme in ("http", "https", "ws", "wss") and url.hostname not in LOCAL_HOSTS:
            watch.external.append(route.request.url)
            route.abort()
        else:
            route.continue_()

    context.route("**/*", gate)
    pg = context.new_page()
    pg.set_default_timeout(20_000)
    pg.on("pageerror", lambda e: watch.js_errors.append(str(e)))
    yield pg
    context.close()
    assert watch.js_errors == [], f"JavaScript errors: {watch.js_errors}\n{stack.logs()}"
