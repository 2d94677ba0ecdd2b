"""``/readyz`` when a part is missing, with real parts: a PostgreSQL database that is not there, a default bundle the
bundle folder lacks. Each is a 503 (``GET`` and ``HEAD``, what probes send) naming the part that failed and saying the
others are fine; all there is a 200 (``test_app_exemplar_sets.py``). The broker down: ``test_app_adaptations.py``;
the localize workers' checks: ``tests/worker/test_worker_remote_inference.py``."""

from __future__ import annotations

from fastapi.testclient import TestClient
from service_fixtures import PG_ADMIN_URL, TEST_BUNDLES, make_test_settings, migrate

from app.main import create_app


def ready(settings) -> tuple[int, int, dict]:  # type: ignore[no-untyped-def]
    app = create_app(settings)
    with TestClient(app) as c:
        r = c.get("/readyz")
        head = c.head("/readyz").status_code
    app.state.engine.dispose()
    return r.status_code, head, r.json()


def test_a_database_that_does_not_answer_makes_the_service_unready_naming_it(tmp_path, bundle_dir):
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/qloc_no_such_database"
    s = make_test_settings(tmp_path, bundle_dir, database_url=url)
    assert ready(s) == (503, 503, {"status": "unavailable", "checks": {
        "database": "error: OperationalError", "broker": "ok", "bundle": "ok"}})


def test_a_default_bundle_the_folder_lacks_makes_the_service_unready_naming_the_ones_there(tmp_path, bundle_dir):
    s = make_test_settings(tmp_path, bundle_dir, default_bundle="no-such-bundle")
    migrate(s.database_url)
    there = sorted(TEST_BUNDLES)
    assert ready(s) == (503, 503, {"status": "unavailable", "checks": {
        "database": "ok", "broker": "ok", "bundle": f"error: unknown bundle 'no-such-bundle'; available: {there}"}})
