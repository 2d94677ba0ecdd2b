"""The API compiles its bundles' one-image episode in the background (``QLOC_COMPILE_EPISODE``, ``app.warmup``).

Through real HTTP on the embedded default: the answers before and after the compile are the same, the compile
is counted in ``/metrics``, its cache lands in the storage directory, and a compile that fails leaves the eager
episode serving.
"""

from __future__ import annotations

import os

from fastapi.testclient import TestClient
from service_fixtures import files, make_test_settings, migrate, png_bytes

from app.main import create_app
from models.compiled import compiled_steer


def localize(c: TestClient, set_id: str, seed: int) -> dict:
    r = c.post(f"/v1/exemplar-sets/{set_id}/localize", files=files(png_bytes(seed=seed)))
    assert r.status_code == 200, r.text
    return r.json()["results"][0]


def test_the_api_compiles_the_one_image_episode_in_the_background_and_answers_the_same(
        tmp_path, bundle_dir, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset below")  # restored after the test
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    settings = make_test_settings(tmp_path, bundle_dir, compile_episode=True)
    migrate(settings.database_url)
    app = create_app(settings)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((settings.storage_dir / "compile-cache").resolve())
    with TestClient(app) as c:
        set_id = c.post("/v1/exemplar-sets", files=files(png_bytes(28, 28))).json()["id"]
        assert app.state.warmup.wait(300), "the compile did not finish"
        calls = compiled_steer().calls
        compiled = [localize(c, set_id, seed) for seed in range(4)]
        assert compiled_steer().calls == calls + 4
        with monkeypatch.context() as m:
            m.setattr("models.inference.warmed_steer", lambda: None)  # the eager episode
            eager = [localize(c, set_id, seed) for seed in range(4)]
        text = c.get("/metrics").text
    assert [r["box"] for r in compiled] == [r["box"] for r in eager]
    assert [r["score"] for r in compiled] == [r["score"] for r in eager]
    assert 'qloc_episode_compiles_total{outcome="compiled"} 1.0' in text
    assert any((settings.storage_dir / "compile-cache").iterdir())


def test_a_compile_that_fails_leaves_the_eager_episode_serving(tmp_path, bundle_dir, monkeypatch):
    def fail(self):  # type: ignore[no-untyped-def]
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr("models.inference.Localizer.compile_episode", fail)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    settings = make_test_settings(tmp_path, bundle_dir, compile_episode=True)
    migrate(settings.database_url)
    app = create_app(settings)
    with TestClient(app) as c:
        assert app.state.warmup.wait(60)
        set_id = c.post("/v1/exemplar-sets", files=files(png_bytes(28, 28))).json()["id"]
        assert localize(c, set_id, 0)["box"]
        text = c.get("/metrics").text
    assert 'qloc_episode_compiles_total{outcome="failed"} 1.0' in text


def test_no_compile_when_turned_off(settings):
    assert settings.compile_episode is False  # the test suite's settings: the other API tests run eager
    app = create_app(settings)
    with TestClient(app):
        assert app.state.warmup is None
