"""An adaptation job refreshes the calibration of the checkpoints it may serve, and localize uses it."""

import uuid

from service_fixtures import files, png_bytes
from sqlalchemy import select

from app.tables import Checkpoint
from worker.context import WorkerContext
from worker.jobs import run_adaptation_job


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
        assert last.calibration["stats"]["positives"] > 128  # the job's probes joined the pasted crops
        assert all(c.calibration is None for c in ckpts[:-1])  # neither activated nor last: the set's is used
        r = client.post(f"/v1/exemplar-sets/{es['id']}/localize", files=files(png_bytes(seed=1)))
        assert r.json()["checkpoint_id"] == str(last.id) and 0 <= r.json()["results"][0]["confidence"] <= 1
    finally:
        ctx.engine.dispose()
