"""The API docs render with the internet cut off: Swagger UI at /docs and ReDoc at /redoc load their files from
the service, and every request off 127.0.0.1 / localhost is aborted (and would fail the test)."""

from __future__ import annotations

import httpx
import pytest
from service_fixtures import Stack

pytestmark = pytest.mark.slow


def operations(stack: Stack) -> list[tuple[str, str]]:
    spec = httpx.get(f"{stack.base_url}/openapi.json").json()
    return [(method.upper(), path) for path, item in spec["paths"].items() for method in item]


def test_swagger_ui_lists_every_operation_offline(page, stack: Stack, watch) -> None:
    page.goto("/docs")
    ops = operations(stack)
    assert ("POST", "/v1/exemplar-sets/{set_id}/localize") in ops and ("GET", "/v1/bundles") in ops
    page.wait_for_selector(".opblock-summary-path")
    page.wait_for_function(f"document.querySelectorAll('.opblock').length === {len(ops)}")
    shown = {(b.locator(".opblock-summary-method").inner_text().strip(),
              b.locator(".opblock-summary-path").get_attribute("data-path"))
             for b in page.locator(".opblock").all()}
    assert shown == set(ops)
    assert watch.external == []


def test_redoc_renders_offline(page, stack: Stack, watch) -> None:
    page.goto("/redoc")
    page.wait_for_selector("h1:has-text('qloc')")
    # each operation gets a section; its heading is the operation's summary
    page.wait_for_selector("h2:has-text('Create Exemplar Set')")
    assert page.locator("[data-section-id^='operation/']").count() == len(operations(stack))
    assert watch.external == []
