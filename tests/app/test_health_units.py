"""``/readyz`` when a part is missing, with real parts: a PostgreSQL database that is not there, a default bundle the
bundle folder lacks. Each is a 503 (``GET`` and ``HEAD``, what probes send) naming the part that failed and saying the
others are fine; all there is a 200 (``test_app_exemplar_sets.py``). The broker down: ``test_app_adaptations.py``;
the localize workers' checks: ``tests/worker/test_worker_remote_inference.py``, and by value below."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from service_fixtures import PG_ADMIN_URL, TEST_BUNDLES, make_test_settings, migrate
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from app.main import create_app
from app.routes.health import readiness


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


class Remote:
    """What ``readiness`` reads of the workers' backend (``app.remote.WorkerInference``): its ping and the localize
    queue's consumers, as last checked (the real ones: ``tests/worker/test_worker_remote_inference.py``)."""

    def __init__(self, workers: str, ping_error: Exception | None = None):
        self.consumers = SimpleNamespace(readiness=lambda: workers)
        self.ping_error = ping_error

    def ping(self) -> None:
        if self.ping_error is not None:
            raise self.ping_error


class Queue:
    def __init__(self, error: Exception | None = None):
        self.error = error

    def ping(self) -> None:
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize(("remote", "queue", "want"), [
    (Remote("ok"), Queue(), ("ok", {"result_backend": "ok", "localize_workers": "ok"})),
    # cannot be told (no check yet): not a failure
    (Remote("unknown: not checked yet"), Queue(),
     ("ok", {"result_backend": "ok", "localize_workers": "unknown: not checked yet"})),
    (Remote("no worker seen on queue localize"), Queue(),
     ("unavailable", {"result_backend": "ok", "localize_workers": "no worker seen on queue localize"})),
    (Remote("ok", ConnectionError("redis down")), Queue(), ("unavailable", {"result_backend": "error: redis down"})),
    (Remote("ok"), Queue(OSError("refused")), ("unavailable", {"result_backend": "ok", "localize_workers": "ok"})),
])
def test_with_localize_workers_readiness_checks_the_result_backend_and_the_workers_not_a_bundle(remote, queue, want):
    engine = create_engine("sqlite://")
    try:
        with Session(engine) as session:
            got = readiness(session, None, queue, None, remote)  # type: ignore[arg-type]  # no bundle is read
    finally:
        engine.dispose()
    status, parts = want
    broker = "ok" if queue.error is None else f"error: {type(queue.error).__name__}"
    assert (got.status, got.checks) == (status, {"database": "ok", "broker": broker, **parts})
