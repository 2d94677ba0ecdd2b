"""API keys: with keys on, every call needs one, and each key sees only its own sets, jobs and checkpoints."""

import pytest
from fastapi.testclient import TestClient
from service_fixtures import files, make_test_settings, migrate, png_bytes

from app.main import create_app
from app.routes.exemplar_sets import NOT_FOUND

KEY_A, KEY_B = "key-a-0123456789abcdef", "key-b-0123456789abcdef"


@pytest.fixture
def keyed(tmp_path, bundle_dir):
    settings = make_test_settings(tmp_path, bundle_dir, api_keys=[KEY_A, KEY_B])
    migrate(settings.database_url)
    with TestClient(create_app(settings)) as c:
        yield c


def test_keys_are_required(keyed):
    assert keyed.get("/v1/exemplar-sets").status_code == 401
    r = keyed.get("/v1/exemplar-sets", headers={"X-API-Key": "wrong-key-0123456789"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert keyed.get("/v1/exemplar-sets", headers={"X-API-Key": KEY_A}).status_code == 200
    assert keyed.get("/v1/exemplar-sets", headers={"Authorization": f"Bearer {KEY_B}"}).status_code == 200
    both = {"X-API-Key": KEY_A, "Authorization": f"Bearer {KEY_B}"}  # two tenants: not one silently
    r = keyed.get("/v1/exemplar-sets", headers=both)
    assert r.status_code == 401 and "two different API keys" in r.json()["detail"]
    assert keyed.get("/v1/exemplar-sets", headers={**both, "Authorization": f"Bearer {KEY_A}"}).status_code == 200
    # liveness and readiness stay open; metrics need a key too
    assert keyed.get("/healthz").status_code == 200
    assert keyed.get("/readyz").status_code == 200
    assert keyed.get("/metrics").status_code == 401


def test_metrics_need_a_key_when_keys_are_set(keyed, tmp_path, bundle_dir):
    r = keyed.get("/metrics")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer" and r.json()["detail"]
    assert keyed.get("/metrics", headers={"X-API-Key": "wrong-key-0123456789"}).status_code == 401
    for headers in ({"X-API-Key": KEY_A}, {"Authorization": f"Bearer {KEY_B}"}):
        r = keyed.get("/metrics", headers=headers)
        assert r.status_code == 200 and "qloc_jobs{" in r.text, r.text
    # without keys, open as before; with keys and QLOC_METRICS_AUTH=false, open to any scraper
    for name, overrides in (("open", {}), ("scrape", {"api_keys": [KEY_A], "metrics_auth": False})):
        s = make_test_settings(tmp_path / name, bundle_dir, **overrides)
        migrate(s.database_url)
        with TestClient(create_app(s)) as c:
            r = c.get("/metrics")
            assert r.status_code == 200 and "qloc_jobs{" in r.text, (name, r.text)
            assert c.get("/v1/exemplar-sets").status_code == (401 if s.api_keys else 200)


def test_another_keys_ids_answer_404(keyed):
    a = {"X-API-Key": KEY_A}
    b = {"Authorization": f"Bearer {KEY_B}"}
    es = keyed.post("/v1/exemplar-sets", files=files(png_bytes(28, 28)), headers=a).json()
    set_id, ckpt_id = es["id"], es["active_checkpoint_id"]
    job = keyed.post(f"/v1/exemplar-sets/{set_id}/adaptations", files=files(png_bytes()), headers=a,
                     data={"iterations": "2"}, params={}).json()
    job_id = job["id"]

    calls = [("get", f"/v1/exemplar-sets/{set_id}", {}), ("get", f"/v1/exemplar-sets/{set_id}/checkpoints", {}),
             ("get", f"/v1/exemplar-sets/{set_id}/adaptations", {}), ("get", f"/v1/adaptations/{job_id}", {}),
             ("get", f"/v1/checkpoints/{ckpt_id}", {}),
             ("post", f"/v1/exemplar-sets/{set_id}/localize", {"files": files(png_bytes())}),
             ("post", f"/v1/exemplar-sets/{set_id}/adaptations", {"files": files(png_bytes())}),
             ("post", f"/v1/checkpoints/{ckpt_id}/activate", {}),
             ("post", f"/v1/adaptations/{job_id}/cancel", {}),
             ("delete", f"/v1/exemplar-sets/{set_id}", {})]
    for method, url, kw in calls:
        r = keyed.request(method, url, headers=b, **kw)
        assert r.status_code == 404, (method, url, r.status_code, r.text)
    assert keyed.get("/v1/exemplar-sets", headers=b).json()["count"] == 0
    r = keyed.post(f"/v1/exemplar-sets/{set_id}/localize", files=files(png_bytes()), headers=b)
    assert r.json() == {"detail": NOT_FOUND}  # as for a set that does not exist: nothing says it does

    # the owner still sees everything, untouched
    assert keyed.get(f"/v1/adaptations/{job_id}", headers=a).json()["status"] == "queued"
    assert keyed.get("/v1/exemplar-sets", headers=a).json()["count"] == 1
    assert keyed.post(f"/v1/exemplar-sets/{set_id}/localize", files=files(png_bytes()), headers=a).status_code == 200


def test_idempotency_keys_are_per_api_key(keyed):
    a, b = {"X-API-Key": KEY_A}, {"X-API-Key": KEY_B}
    set_a = keyed.post("/v1/exemplar-sets", files=files(png_bytes(28, 28)), headers=a).json()["id"]
    set_b = keyed.post("/v1/exemplar-sets", files=files(png_bytes(28, 28)), headers=b).json()["id"]
    ja = keyed.post(f"/v1/exemplar-sets/{set_a}/adaptations", files=files(png_bytes()),
                    headers={**a, "Idempotency-Key": "same"})
    jb = keyed.post(f"/v1/exemplar-sets/{set_b}/adaptations", files=files(png_bytes()),
                    headers={**b, "Idempotency-Key": "same"})
    assert ja.status_code == jb.status_code == 202 and ja.json()["id"] != jb.json()["id"]
