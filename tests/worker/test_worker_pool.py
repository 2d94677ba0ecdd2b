"""Adaptation jobs on an exemplar set's image pool: the worker adapts on the images the pool held when the job
was created (its snapshot), with the job's own uploads first; end to end through a real Celery worker too."""

import json
import uuid

import httpx
import pytest
from service_fixtures import (
    FAST_JOB,
    live_worker_settings,
    png_bytes,
    running_stack,
    stored_files,
    wait_for_job,
)

from worker import jobs
from worker.context import WorkerContext
from worker.jobs import run_adaptation_job


@pytest.fixture
def ctx(db_settings):
    """The worker context on ``db_settings`` with ``FAST_JOB``'s probes: which images a job adapts on does not
    depend on them."""
    c = WorkerContext.create(db_settings.model_copy(update=FAST_JOB))
    yield c
    c.engine.dispose()


def named(*names, seed=0):
    return [("files", (name, png_bytes(84, 84, seed=seed + i), "image/png")) for i, name in enumerate(names)]


def test_a_job_adapts_on_the_pool_it_was_created_with(api, ctx, monkeypatch):
    seen = []
    real_adapt = jobs.adapt

    def spy(bundle, prototype, images01, cfg, **kwargs):
        seen.append(images01.clone())
        return real_adapt(bundle, prototype, images01, cfg, **kwargs)

    monkeypatch.setattr(jobs, "adapt", spy)
    set_id = api.post("/v1/exemplar-sets", files=named("crop", seed=9)).json()["id"]
    for request in range(2):  # the pool, filled over two requests
        r = api.post(f"/v1/exemplar-sets/{set_id}/images", files=named("a", "b", "c", seed=10 * request))
        assert r.status_code == 201, r.text
    url = f"/v1/exemplar-sets/{set_id}/adaptations"
    job = api.post(url, data={"source": "both", "iterations": "3", "activate": "false"}, files=named("own", seed=50))
    assert job.status_code == 202, job.text
    job = job.json()
    api.post(f"/v1/exemplar-sets/{set_id}/images", files=named("late1", "late2", seed=70))  # after the job: not its
    assert api.get(f"/v1/exemplar-sets/{set_id}").json()["num_pool_images"] == 8

    assert run_adaptation_job(ctx, uuid.UUID(job["id"]), worker="test") == "succeeded"
    done = api.get(f"/v1/adaptations/{job['id']}").json()
    assert done["params"]["num_images"] == 7 and done["params"]["num_pool_images"] == 6
    assert done["progress"]["iteration"] == 3 and done["validation"]["probes"]["synthetic"] > 0
    (images01,) = seen
    assert images01.shape[0] == 7  # its own upload and the 6 pool images of its snapshot, not the 2 added later

    # the same images through a job on its files alone: the pool job's first image is its upload, the rest the pool
    files_job = api.post(url, data={"iterations": "1", "activate": "false"},
                         files=named("own", seed=50) + named("a", "b", "c", seed=0) + named("a", "b", "c", seed=10))
    assert run_adaptation_job(ctx, uuid.UUID(files_job.json()["id"]), worker="test") == "succeeded"
    assert seen[1].shape == images01.shape and bool((seen[1] == images01).all())

    # the job ended: its pool images may go now
    assert api.delete(f"/v1/exemplar-sets/{set_id}/images").status_code == 204


def test_a_finished_jobs_own_uploads_are_deleted_its_pool_images_kept(api, ctx):
    """A finished job never runs again: the reaper deletes the copies of the files it was posted with (succeeded,
    or canceled while queued), keeps the pool's images it took, and the job's record stays readable."""
    from worker.reaper import Reaper, drop_finished_uploads

    set_id = api.post("/v1/exemplar-sets", files=named("crop", seed=9)).json()["id"]
    assert api.post(f"/v1/exemplar-sets/{set_id}/images", files=named("a", "b", seed=10)).status_code == 201
    url = f"/v1/exemplar-sets/{set_id}/adaptations"
    ran = api.post(url, data={"source": "both", "iterations": "2", "activate": "false"},
                   files=named("own1", "own2", seed=50)).json()
    canceled = api.post(url, data={"iterations": "2"}, files=named("own3", seed=60)).json()
    assert api.post(f"/v1/adaptations/{canceled['id']}/cancel").status_code == 202
    root = ctx.settings.storage_dir
    uploads = [f for f in stored_files(root) if "/images/" in f and "/jobs/" in f]
    pool = [f for f in stored_files(root) if "/pool/" in f]
    assert len(uploads) == 3 and len(pool) == 2
    reaper = Reaper(ctx, send=lambda job_id: None)
    reaper.run_once()  # a reaper's first round sweeps: the canceled job's file; the other job is queued: it needs its
    job_uploads = [f for f in stored_files(root) if "/images/" in f and "/jobs/" in f]
    assert len(job_uploads) == 2
    assert run_adaptation_job(ctx, uuid.UUID(ran["id"]), worker="test") == "succeeded"
    reaper.run_once()  # a round within UPLOADS_SWEEP_S of the last sweep does not sweep
    assert [f for f in stored_files(root) if "/images/" in f and "/jobs/" in f] == job_uploads
    assert drop_finished_uploads(ctx, limit=1) == 1  # at most `limit` files a sweep; the next sweep goes on
    assert drop_finished_uploads(ctx) == 1 and drop_finished_uploads(ctx) == 0
    left = stored_files(root)
    assert not [f for f in left if "/images/" in f and "/jobs/" in f] and [f for f in left if "/pool/" in f] == pool
    assert not any((root / f"exemplar-sets/{set_id}/jobs/{j['id']}/images").exists() for j in (ran, canceled))
    done = api.get(f"/v1/adaptations/{ran['id']}").json()
    assert done["status"] == "succeeded" and done["params"]["num_images"] == 4


@pytest.fixture(params=["embedded", "postgres_redis"])
def stack(request, tmp_path, bundle_dir):
    with running_stack(request.param, request, tmp_path, bundle_dir, make=live_worker_settings) as st:
        yield st


@pytest.mark.slow
def test_a_pool_job_end_to_end_through_the_worker(stack):
    with httpx.Client(base_url=stack.base_url, timeout=60) as c:
        set_id = c.post("/v1/exemplar-sets", files=named("crop", seed=9)).json()["id"]
        kept = c.post(f"/v1/exemplar-sets/{set_id}/localize", params={"keep": "true"}, files=named("l1", "l2", seed=3))
        assert kept.status_code == 200 and len(kept.json()["kept"]) == 2
        assert c.post(f"/v1/exemplar-sets/{set_id}/images", files=named("a", "b", "c", seed=20)).status_code == 201
        r = c.post(f"/v1/exemplar-sets/{set_id}/adaptations", data={"iterations": "4", "activate": "true"})
        assert r.status_code == 202, r.text
        job = wait_for_job(c, r.json()["id"], stack=stack)
        assert job["status"] == "succeeded", (job, stack.logs())
        assert job["params"]["num_images"] == job["params"]["num_pool_images"] == 5
        assert job["progress"]["iteration"] == 4
        loc = c.post(f"/v1/exemplar-sets/{set_id}/localize", files=named("q"))
        assert loc.json()["checkpoint_id"] == job["checkpoint_id"]  # activate=true: the adapted policy serves

        assert c.delete(f"/v1/exemplar-sets/{set_id}").status_code == 204
        assert not any(set_id in f for f in stored_files(stack.settings.storage_dir))


@pytest.mark.parametrize("rule", ["agree", None])
def test_a_job_on_a_set_with_boxes_reports_its_labeled_examples(api, db_settings, rule):
    """A set made from whole images with ``boxes``: the job scores the start and every checkpoint on those labeled
    examples too, and the job resource carries them (``validation.base.labeled``, each checkpoint's
    ``labeled_gain`` / ``labeled_noise``) with the rule that applied (``probes.labeled_rule``: the worker's
    ``QLOC_LABELED_RULE``, ``beyond_noise`` when unset)."""
    update = {**FAST_JOB, **({"labeled_rule": rule} if rule else {})}
    ctx = WorkerContext.create(db_settings.model_copy(update=update))
    boxes = [[10, 12, 50, 60], [30, 20, 80, 70], [0, 0, 40, 40]]
    r = api.post("/v1/exemplar-sets", files=named("w0", "w1", "w2", seed=3), data={"boxes": json.dumps(boxes)})
    assert r.status_code == 201, r.text
    set_id = r.json()["id"]
    assert r.json()["num_labeled"] == 3
    job = api.post(f"/v1/exemplar-sets/{set_id}/adaptations", data={"iterations": "2", "activate": "auto"},
                   files=named("u0", "u1", "u2", "u3", seed=40)).json()
    try:
        assert run_adaptation_job(ctx, uuid.UUID(job["id"]), worker="test") == "succeeded"
    finally:
        ctx.engine.dispose()
    v = api.get(f"/v1/adaptations/{job['id']}").json()["validation"]
    assert v["probes"]["labeled"] == 3 and v["probes"]["labeled_rule"] == (rule or "beyond_noise")
    assert v["probes"]["synthetic_confirms"] is True  # the test bundle is grayscale: pasted probes may confirm
    assert v["base"]["labeled"]["n"] == 3 and 0 <= v["base"]["labeled"]["corloc"] <= 100
    for c in v["checkpoints"]:
        assert c["labeled"]["n"] == 3
        assert c["labeled_gain"] == pytest.approx(c["labeled"]["corloc"] - v["base"]["labeled"]["corloc"], abs=0.01)
        assert c["labeled_noise"] >= 100 / 3 - 0.01  # at least one labeled example's worth
