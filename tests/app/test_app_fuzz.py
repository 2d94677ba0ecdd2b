"""Schema-driven fuzzing of the served OpenAPI spec (schemathesis): every response matches the spec.

Each response is checked for: no 5xx, a status code the operation documents, a documented content type,
and a body that validates against the documented schema of that status (errors included: every error
is a JSON ``{"detail": ...}``). Path ids are mostly real ones (an existing set, its checkpoint and a
job), and half the generated uploads are replaced by real PNGs, so the fuzzed bodies and queries reach
the handlers and their success responses instead of stopping at 404 or 400.

Both tests run on SQLite and on PostgreSQL (a database for the module, shared by its apps).
"""

import collections
import os
import random
import secrets
import uuid

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from service_fixtures import files, make_test_settings, migrate, png_bytes

from app.main import create_app

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES = int(os.environ.get("QLOC_FUZZ_EXAMPLES", "25"))
"""Examples per operation and database (CI: 25; ``QLOC_FUZZ_EXAMPLES=500`` for a deep run)."""
UPLOADS = ("POST /v1/exemplar-sets", "POST /v1/exemplar-sets/{set_id}/localize",
           "POST /v1/exemplar-sets/{set_id}/adaptations")


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def database(request):
    return request.param


def settings_on(database, request, root, bundle_dir, **overrides):
    """Test settings under ``root`` on ``database`` (SQLite in ``root``, or the module's PostgreSQL), migrated."""
    if database == "postgresql":
        overrides["database_url"] = request.getfixturevalue("module_postgres_url")
    s = make_test_settings(root, bundle_dir, **overrides)
    migrate(s.database_url)
    return s


@pytest.fixture(scope="module")
def fuzz_app(request, database, tmp_path_factory, bundle_dir):
    app = create_app(settings_on(database, request, tmp_path_factory.mktemp("fuzz"), bundle_dir))
    with TestClient(app) as c:
        es = c.post("/v1/exemplar-sets", files=files(png_bytes(28, 28))).json()
        job = c.post(f"/v1/exemplar-sets/{es['id']}/adaptations", files=files(png_bytes())).json()
        app.state.fuzz_ids = {"set_id": es["id"], "checkpoint_id": es["active_checkpoint_id"], "job_id": job["id"]}
        yield app


def operations(app) -> dict:
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    return {op.label: op for op in (result.ok() for result in schema.get_all_operations())}


def real_pngs(rng: random.Random) -> list[bytes]:
    return [png_bytes(rng.randint(8, 120), rng.randint(8, 120), rng.choice(["L", "RGB"]), seed=rng.randint(0, 99))
            for _ in range(rng.randint(1, 3))]


def test_responses_match_the_spec(fuzz_app):
    ids = fuzz_app.state.fuzz_ids
    ops = operations(fuzz_app)
    assert len(ops) >= 14
    statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    for operation in ops.values():
        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        def check(case):
            rng = random.Random(repr(case.path_parameters) + repr(case.query))
            if case.path_parameters and case.method.upper() != "DELETE":
                for name in case.path_parameters:
                    if name in ids and rng.random() < 0.8:
                        case.path_parameters[name] = ids[name]
            if isinstance(case.body, dict) and "files" in case.body and rng.random() < 0.5:
                case.body["files"] = real_pngs(rng)
            response = case.call_and_validate(checks=CHECKS)
            statuses[case.operation.label][response.status_code] += 1

        check()

    # The fuzz reached the handlers: each upload answered with success and with errors, each validated.
    for label in UPLOADS:
        codes = statuses[label]
        assert any(200 <= c < 300 for c in codes) and any(c >= 400 for c in codes), (label, codes)
    assert statuses["GET /v1/exemplar-sets/{set_id}"][200] > 0
    assert statuses["GET /v1/checkpoints/{checkpoint_id}"][200] > 0


def test_error_responses_match_the_spec(request, database, tmp_path, bundle_dir):
    """Each error the fuzz may miss, requested on purpose: documented status, JSON ``{"detail": ...}`` body."""
    key = secrets.token_hex(16)
    s = settings_on(database, request, tmp_path, bundle_dir, max_files_per_request=2, max_file_bytes=20_000)
    cases = []  # (app, label, case kwargs, expected status)
    with TestClient(create_app(s)) as c:
        es = c.post("/v1/exemplar-sets", files=files(png_bytes(28, 28))).json()
        job = c.post(f"/v1/exemplar-sets/{es['id']}/adaptations", files=files(png_bytes())).json()
    set_id, job_id = {"set_id": es["id"]}, {"job_id": job["id"]}
    good = {"files": [png_bytes()]}
    plain = create_app(s)
    cases += [
        (plain, "POST /v1/exemplar-sets", dict(body={"files": [png_bytes()], "bundle": "no-such-bundle"}), 422),
        (plain, "POST /v1/exemplar-sets", dict(body={"files": [b"\x89PNG" + b"\x00" * s.max_request_bytes]}), 413),
        (plain, "POST /v1/exemplar-sets", dict(body={"files": [b"\x00" * 30_000]}), 413),
        (plain, "POST /v1/exemplar-sets", dict(body={"files": [png_bytes()] * 3}), 413),
        (plain, "POST /v1/exemplar-sets", dict(body={"files": [b"not an image"]}), 415),
        (plain, "POST /v1/exemplar-sets", dict(body={"files": [b"GIF89a" + b"\x00" * 20]}), 415),
        (plain, "POST /v1/exemplar-sets/{set_id}/adaptations",
         dict(path_parameters=set_id, body={**good, "iterations": s.max_iterations + 1}), 422),
        (plain, "POST /v1/exemplar-sets/{set_id}/localize",
         dict(path_parameters=set_id, body=good, query={"checkpoint": "base", "samples": 99}), 422),
        (plain, "POST /v1/exemplar-sets/{set_id}/localize",
         dict(path_parameters=set_id, body=good, query={"checkpoint": str(job["id"])}), 404),
        (plain, "DELETE /v1/exemplar-sets/{set_id}", dict(path_parameters=set_id), 409),
        (plain, "POST /v1/adaptations/{job_id}/cancel", dict(path_parameters=job_id), 202),
        (plain, "POST /v1/adaptations/{job_id}/cancel", dict(path_parameters=job_id), 409),
        (plain, "GET /v1/adaptations/{job_id}", dict(path_parameters={"job_id": es["id"]}), 404),
    ]
    # No default bundle: 503 from the routes that need it, and from /readyz.
    no_bundle = create_app(settings_on(database, request, tmp_path / "nb", bundle_dir, default_bundle="missing"))
    cases += [(no_bundle, "POST /v1/exemplar-sets", dict(body=good), 503), (no_bundle, "GET /readyz", {}, 503)]
    # API keys on: 401 without one, on every /v1 operation.
    keyed = create_app(settings_on(database, request, tmp_path / "auth", bundle_dir, api_keys=[key]))
    cases += [(keyed, label, dict(path_parameters={**set_id, **job_id, "checkpoint_id": es["active_checkpoint_id"]},
                                  body=good if label in UPLOADS else None), 401)
              for label in operations(keyed) if label.split()[1].startswith("/v1")]
    assert sum(expected == 401 for *_, expected in cases) >= 12

    by_app = {}
    for app, label, kwargs, expected in cases:
        ops = by_app.setdefault(id(app), operations(app))
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        if "path_parameters" in kwargs:  # the operation's own; an id no case names is an unknown one
            given_ids = kwargs["path_parameters"]
            kwargs["path_parameters"] = {p.name: given_ids.get(p.name, str(uuid.uuid4()))
                                         for p in ops[label].path_parameters}
        if "body" in kwargs:
            kwargs["media_type"] = "multipart/form-data"
        checks = CHECKS if expected < 500 else CHECKS[1:]  # a documented 503 is not a server error here
        response = ops[label].Case(**kwargs).call_and_validate(checks=checks)
        assert response.status_code == expected, (label, kwargs.get("query"), response.text)
        if expected >= 400 and label != "GET /readyz":  # /readyz answers its checks, documented as such
            assert isinstance(response.json()["detail"], str | list), response.text
