"""One preprocessing for training and serving: an upload is the same network input whether an adaptation
job learns on it (the worker) or a localize request searches it (the API)."""

import io
import uuid

import numpy as np
import torch
from fastapi.testclient import TestClient
from PIL import Image
from service_fixtures import FAST_JOB, files, make_test_settings, migrate, png_bytes

from app.main import create_app
from models.bundle import new_bundle, save_bundle
from models.inference import Localizer
from models.presets import mnist_config
from worker import jobs
from worker.context import WorkerContext
from worker.jobs import run_adaptation_job

FILL = 0.6
"""The test bundle's background: transparent pixels must land on it, not on black."""


def transparent_pngs() -> list[bytes]:
    """An ``LA`` image at the input size (left half transparent) and a smaller ``RGBA`` one (resized)."""
    la = np.zeros((84, 84, 2), np.uint8)
    la[..., 0] = 200
    la[:, 42:, 1] = 255
    rgba = np.zeros((40, 60, 4), np.uint8)
    rgba[..., :3] = (250, 30, 90)
    rgba[..., 3] = np.linspace(0, 255, 60, dtype=np.uint8)[None, :]
    out = []
    for arr, mode in ((la, "LA"), (rgba, "RGBA")):
        buf = io.BytesIO()
        Image.fromarray(arr, mode).save(buf, "PNG")
        out.append(buf.getvalue())
    return out


def test_a_transparent_upload_is_the_same_input_for_adaptation_and_localization(tmp_path, monkeypatch):
    bundle_dir = tmp_path / "bundles"
    bundle_dir.mkdir()
    config = mnist_config()
    config.input.fill = (FILL,)
    save_bundle(bundle_dir / "test-fill.pt", new_bundle("test-fill", config, seed=0))
    settings = make_test_settings(tmp_path, bundle_dir, default_bundle="test-fill", **FAST_JOB)
    migrate(settings.database_url)
    uploads = transparent_pngs()
    seen = {}

    real_run, real_adapt = Localizer.localize_batch, jobs.adapt

    def run(self, batch01, *args, **kw):  # what the API's engine runs for localize
        seen["localize"] = batch01.clone()
        return real_run(self, batch01, *args, **kw)

    def adapt(bundle, prototype, images01, cfg, **kw):
        seen["adapt"] = images01.clone()
        return real_adapt(bundle, prototype, images01, cfg, **kw)

    monkeypatch.setattr(Localizer, "localize_batch", run)
    monkeypatch.setattr(jobs, "adapt", adapt)
    ctx = WorkerContext.create(settings)
    try:
        with TestClient(create_app(settings)) as client:
            set_id = client.post("/v1/exemplar-sets", files=files(png_bytes(28, 28, seed=9))).json()["id"]
            r = client.post(f"/v1/exemplar-sets/{set_id}/localize", files=files(*uploads))
            assert r.status_code == 200, r.text
            r = client.post(f"/v1/exemplar-sets/{set_id}/adaptations", data={"iterations": "1"},
                            files=files(*uploads))
            assert r.status_code == 202, r.text
            assert run_adaptation_job(ctx, uuid.UUID(r.json()["id"]), worker="w") == "succeeded"
    finally:
        ctx.engine.dispose()

    assert seen["adapt"].shape == seen["localize"].shape == (2, 1, 84, 84)
    assert torch.equal(seen["adapt"], seen["localize"])
    first = seen["adapt"][0, 0]  # at the input size: no resampling, exact values
    assert torch.all(first[:, :42] == round(255 * FILL) / 255)  # the bundle's fill, not black
    assert torch.all(first[:, 42:] == 200 / 255)
