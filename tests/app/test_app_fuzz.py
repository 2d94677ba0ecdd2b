"""Schema-driven fuzzing of the served OpenAPI spec (schemathesis): no input produces a 5xx.

Path ids are mostly real ones (an existing set, its checkpoint and a job), so the fuzzed bodies and
queries reach the handlers instead of stopping at 404.
"""

import random

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from service_fixtures import files, make_test_settings, migrate, png_bytes

from app.main import create_app


@pytest.fixture(scope="module")
def fuzz_app(tmp_path_factory, bundle_dir):
    s = make_test_settings(tmp_path_factory.mktemp("fuzz"), bundle_dir)
    migrate(s.database_url)
    app = create_app(s)
    with TestClient(app) as c:
        es = c.post("/v1/exemplar-sets", files=files(png_bytes(28, 28))).json()
        job = c.post(f"/v1/exemplar-sets/{es['id']}/adaptations", files=files(png_bytes())).json()
        app.state.fuzz_ids = {"set_id": es["id"], "checkpoint_id": es["active_checkpoint_id"], "job_id": job["id"]}
        yield app


def test_no_server_errors(fuzz_app):
    ids = fuzz_app.state.fuzz_ids
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 14

    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        def check(case):
            rng = random.Random(repr(case.path_parameters))
            if case.path_parameters and case.method.upper() != "DELETE":
                for name in case.path_parameters:
                    if name in ids and rng.random() < 0.8:
                        case.path_parameters[name] = ids[name]
            case.call_and_validate(checks=[not_a_server_error])

        check()
