"""An adaptation job refreshes the calibration of the checkpoints it may serve, and localize uses it."""

import io
import uuid

import pytest
import torch
from PIL import Image
from service_fixtures import FAST_JOB, files, png_bytes, square_verifier
from sqlalchemy import select

from app.tables import Checkpoint, ExemplarSet
from models.inference import pil_to_tensor
from models.verifier import KindCheck
from worker.context import WorkerContext
from worker.jobs import run_adaptation_job


@pytest.fixture
def settings(settings):
    """The service's settings with a job's guard on 16 probes (``FAST_JOB``'s): the calibration on its default."""
    return settings.model_copy(update={"synthetic_probes": FAST_JOB["synthetic_probes"]})


def test_job_calibrates_its_last_checkpoint_and_localize_serves_it(client, settings):
    ctx = WorkerContext.create(settings)
    try:
        es = client.post("/v1/exemplar-sets", files=files(png_bytes(28, 28, seed=9))
                         + files(png_bytes(28, 28, seed=4), field="negative_files")).json()
        r = client.post(f"/v1/exemplar-sets/{es['id']}/adaptations", data={"iterations": "5", "activate": "true"},
                        files=files(*[png_bytes(84, 84, seed=i) for i in range(4)]))
        assert r.status_code == 202, r.text
        job = r.json()
        assert run_adaptation_job(ctx, uuid.UUID(job["id"]), worker="test") == "succeeded"
        with ctx.session_factory() as s:
            ckpts = list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == uuid.UUID(job["id"]))
                                   .order_by(Checkpoint.iteration)))
        last = ckpts[-1]
        assert last.calibration is not None and last.calibration["iteration"] == last.iteration
        assert last.calibration["score"]["features"] == ["log_score"]
        reward = client.get(f"/v1/adaptations/{job['id']}").json()["validation"]["reward"]
        # the set's negatives were embedded by the bundle's head: they apply unless the job repaired the head
        assert (last.calibration["negatives"] is not None) == (reward == "bundle head")
        assert last.calibration["stats"]["positives"] > settings.calibration_samples  # the probes joined the crops
        best = client.get(f"/v1/adaptations/{job['id']}").json()["validation"]["best"]
        named = {last.iteration} | ({best["iteration"]} if best else set())  # served, last, or the verdict's best
        for c in ckpts:  # the others: the set's calibration is used
            assert (c.calibration is not None) == (c.iteration in named), (c.iteration, named)
        r = client.post(f"/v1/exemplar-sets/{es['id']}/localize", files=files(png_bytes(seed=1)))
        assert r.json()["checkpoint_id"] == str(last.id) and 0 <= r.json()["results"][0]["confidence"] <= 1
    finally:
        ctx.engine.dispose()


def test_a_sets_kind_check_is_served_and_carried_into_a_jobs_calibration(client, settings, monkeypatch):
    """A verifier that knows the set's crops (their kind 'square'): the set is matched to it, localize serves the
    check's confidence, and the job's refreshed calibration keeps the check (it does not depend on the policy)."""
    v = square_verifier(monkeypatch)
    ctx = WorkerContext.create(settings)
    try:
        # two crops: the check needs the NCC fits, which need another exemplar to leave one out
        es = client.post("/v1/exemplar-sets", files=files(*[png_bytes(28, 28, seed=k) for k in (9, 10)])).json()
        assert es["kind"] == "square"
        with ctx.session_factory() as s:
            check = s.get_one(ExemplarSet, uuid.UUID(es["id"])).calibration["kind"]
        assert check["verifier"] == "test verifier" and check["known"] >= 0.99
        r = client.post(f"/v1/exemplar-sets/{es['id']}/localize", params={"rerank": "false"},
                        files=files(png_bytes(seed=1)))
        res = r.json()["results"][0]
        image = pil_to_tensor(Image.open(io.BytesIO(png_bytes(seed=1))), 1, (0.0,))[None]  # 84 x 84: the input size
        expected = KindCheck.from_dict(check).probability(v.embed_boxes(image, torch.tensor([[res["box"]]])))
        assert res["confidence"] == pytest.approx(float(expected), abs=1e-6)
        assert res["found"] == (res["confidence"] >= 0.5)
        r = client.post(f"/v1/exemplar-sets/{es['id']}/adaptations", data={"iterations": "3", "activate": "true"},
                        files=files(*[png_bytes(84, 84, seed=i) for i in range(4)]))
        assert r.status_code == 202, r.text
        assert run_adaptation_job(ctx, uuid.UUID(r.json()["id"]), worker="test") == "succeeded"
        with ctx.session_factory() as s:
            last = s.scalars(select(Checkpoint).where(Checkpoint.job_id == uuid.UUID(r.json()["id"]))
                             .order_by(Checkpoint.iteration.desc())).first()
        assert last.calibration is not None and last.calibration["kind"] == check
    finally:
        ctx.engine.dispose()
