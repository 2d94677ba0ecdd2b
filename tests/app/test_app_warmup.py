"""The API compiles its bundles' one-image episode in the background (``QLOC_COMPILE_EPISODE``, ``app.warmup``).

Through real HTTP on the embedded default: the answers before and after the compile are the same, the compile
is counted in ``/metrics``, its cache lands in the storage directory, and a compile that fails leaves the eager
episode serving. The localize worker (``QLOC_INFERENCE=workers``) compiles its bundles' episode too.
"""

from __future__ import annotations

import os

from fastapi.testclient import TestClient
from service_fixtures import TEST_BUNDLES, files, make_test_settings, migrate, png_bytes

from app import warmup
from app.inference import BundleRegistry
from app.main import create_app
from models.compiled import compiled_steer
from worker import localize as on_worker
from worker.context import WorkerContext


def localize(c: TestClient, set_id: str, seed: int) -> dict:
    r = c.post(f"/v1/exemplar-sets/{set_id}/localize", files=files(png_bytes(seed=seed)))
    assert r.status_code == 200, r.text
    return r.json()["results"][0]


def test_the_api_compiles_the_one_image_episode_in_the_background_and_answers_the_same(
        tmp_path, bundle_dir, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset below")  # restored after the test
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    cache_dir()  # inductor looked already (an import may have): it set the variable to its default
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
            m.setattr("models.inference.fast_steer", lambda device: None)  # the eager episode
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
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache")  # a place the deployment set stays
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


def test_install_compiles_what_is_loaded_and_what_loads_later_and_the_localize_worker_installs_it(
        tmp_path, bundle_dir, monkeypatch):
    compiled = []
    monkeypatch.setattr("models.inference.Localizer.compile_episode", lambda self: compiled.append(self) or 1.0)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    settings = make_test_settings(tmp_path, bundle_dir, compile_episode=True)
    bundles = BundleRegistry(bundle_dir, "cpu")
    first = bundles.get(TEST_BUNDLES[0])
    assert warmup.install(bundles, settings.model_copy(update={"compile_episode": False})) is None
    installed = warmup.install(bundles, settings)
    assert installed.wait(30) and compiled == [first.localizer]  # the bundle loaded before
    second = bundles.get(TEST_BUNDLES[1])
    assert installed.wait(30) and compiled == [first.localizer, second.localizer]  # and one loaded after

    ctx = WorkerContext.create(settings)
    monkeypatch.setattr(on_worker, "_backends", {})
    backend = on_worker.inference(ctx)
    try:
        assert isinstance(ctx.bundles.on_load, warmup.EpisodeWarmup)
    finally:
        backend.close()
        ctx.engine.dispose()
