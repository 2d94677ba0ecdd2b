"""A finished job activates its final checkpoint only where the set still holds the job's base checkpoint:
a rollback the user makes while the job runs (``POST /v1/checkpoints/{id}/activate``) stands. On SQLite
and PostgreSQL, through the API and the worker's real run."""

import uuid

import pytest
from service_fixtures import FAST_JOB, files, png_bytes, register_set

from worker import jobs
from worker.context import WorkerContext
from worker.jobs import run_adaptation_job


@pytest.fixture
def ctx(db_settings):
    """The worker context on ``db_settings`` with ``FAST_JOB``'s probes: activation does not depend on them."""
    c = WorkerContext.create(db_settings.model_copy(update=FAST_JOB))
    yield c
    c.engine.dispose()


def post_job(client, set_id):
    r = client.post(f"/v1/exemplar-sets/{set_id}/adaptations",
                    data={"iterations": "4", "seed": "3", "activate": "true"},
                    files=files(*[png_bytes(84, 84, seed=i) for i in range(3)]))
    assert r.status_code == 202, r.text
    return r.json()


def run(ctx, job, monkeypatch, *, at_iteration=None, then=None):
    """Run the job in this thread; ``then()`` right after its progress of ``at_iteration`` (mid-run)."""
    real = jobs.adapt

    def adapt(bundle, prototype, images01, cfg, *, on_progress, **kw):
        def progress(iteration, total, reward):
            on_progress(iteration, total, reward)
            if iteration == at_iteration:
                then()

        return real(bundle, prototype, images01, cfg, on_progress=progress, **kw)

    with monkeypatch.context() as m:
        m.setattr(jobs, "adapt", adapt)
        assert run_adaptation_job(ctx, uuid.UUID(job["id"]), worker="w") == "succeeded"


def checkpoints_of(client, set_id, job_id):
    data = client.get(f"/v1/exemplar-sets/{set_id}/checkpoints").json()["data"]
    return [c for c in data if c["job_id"] == job_id]


def adapted_once(client, ctx, monkeypatch):
    """A set whose active checkpoint is an adapted one -> (set id, its base checkpoint id, the adapted one's id)."""
    set_id = register_set(client)
    first = post_job(client, set_id)
    run(ctx, first, monkeypatch)
    active = client.get(f"/v1/exemplar-sets/{set_id}").json()["active_checkpoint_id"]
    assert active == checkpoints_of(client, set_id, first["id"])[-1]["id"]
    return set_id, first["params"]["base_checkpoint_id"], active


def test_a_rollback_made_while_a_job_runs_stands(api, ctx, monkeypatch):
    set_id, base, adapted = adapted_once(api, ctx, monkeypatch)
    job = post_job(api, set_id)
    assert job["params"]["base_checkpoint_id"] == adapted

    def roll_back():
        r = api.post(f"/v1/checkpoints/{base}/activate")
        assert r.status_code == 200 and r.json()["active_checkpoint_id"] == base

    run(ctx, job, monkeypatch, at_iteration=3, then=roll_back)
    assert api.get(f"/v1/exemplar-sets/{set_id}").json()["active_checkpoint_id"] == base  # the user's choice
    done = api.get(f"/v1/adaptations/{job['id']}").json()
    ckpts = checkpoints_of(api, set_id, job["id"])
    assert done["status"] == "succeeded" and [c["iteration"] for c in ckpts] == [2, 4]  # the job's work is kept
    assert done["checkpoint_id"] == ckpts[-1]["id"] and not any(c["active"] for c in ckpts)
    r = api.post(f"/v1/exemplar-sets/{set_id}/localize", files=files(png_bytes()))
    assert r.status_code == 200 and r.json()["checkpoint_id"] == base


def test_without_a_rollback_a_job_activates_its_final_checkpoint(api, ctx, monkeypatch):
    set_id, _, adapted = adapted_once(api, ctx, monkeypatch)
    job = post_job(api, set_id)
    run(ctx, job, monkeypatch)
    ckpts = checkpoints_of(api, set_id, job["id"])
    assert [c["iteration"] for c in ckpts] == [2, 4] and ckpts[0]["parent_id"] == adapted
    assert api.get(f"/v1/exemplar-sets/{set_id}").json()["active_checkpoint_id"] == ckpts[-1]["id"]
    assert [c["active"] for c in ckpts] == [False, True]
