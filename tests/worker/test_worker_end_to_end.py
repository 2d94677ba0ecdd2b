"""End to end against real processes (uvicorn + a Celery worker), on both ways to run:

- ``embedded``: SQLite + Celery's SQLAlchemy transport on a SQLite file (the run command's default);
- ``postgres_redis``: PostgreSQL + Redis on this machine (a fresh database and key prefix per test).

Register exemplars -> localize -> adapt with a small budget -> poll to ``succeeded`` -> localize
with the adapted checkpoint -> roll back; and the fault case: ``kill -9`` the worker during a job,
start another, the job resumes from its last checkpoint and succeeds with no row lost or doubled.
"""

import time

import httpx
import pytest
from service_fixtures import (
    files,
    live_worker_settings,
    png_bytes,
    row_counts,
    running_stack,
    wait_for_job,
)

pytestmark = pytest.mark.slow


@pytest.fixture(params=["embedded", "postgres_redis"])
def stack(request, tmp_path, bundle_dir):
    with running_stack(request.param, request, tmp_path, bundle_dir, make=live_worker_settings) as st:
        yield st


def api(st):
    return httpx.Client(base_url=st.base_url, timeout=60)


def register(c):
    r = c.post("/v1/exemplar-sets", files=files(png_bytes(28, 28, seed=1), png_bytes(32, 32, "RGB", seed=2)),
               data={"name": "squares"})
    assert r.status_code == 201, r.text
    return r.json()


def unlabeled():
    return files(*[png_bytes(84, 84, seed=10 + i) for i in range(3)], png_bytes(160, 100, "RGB", seed=20))


def test_register_localize_adapt_poll_localize_rollback(stack):
    with api(stack) as c:
        es = register(c)
        base_id = es["active_checkpoint_id"]
        loc = c.post(f"/v1/exemplar-sets/{es['id']}/localize", files=files(png_bytes(100, 60)))
        assert loc.status_code == 200 and loc.json()["checkpoint_id"] == base_id

        r = c.post(f"/v1/exemplar-sets/{es['id']}/adaptations", files=unlabeled(),
                   data={"iterations": "4", "activate": "true"},
                   headers={"Idempotency-Key": "e2e-1"})
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        assert c.get(r.headers["location"]).json()["status"] in ("queued", "running", "succeeded")
        job = wait_for_job(c, job_id, stack=stack)
        assert job["status"] == "succeeded", (job, stack.logs())
        assert job["progress"]["iteration"] == 4 and job["attempts"] == 1
        # the job checked itself on its probes; activate=true still activates the final checkpoint
        v = job["validation"]
        assert job["verdict"] in ("improved", "no better", "worse", "reward unreliable") and v["message"]
        probes = stack.settings.synthetic_probes  # LIVE_WORKER's 16
        assert v["probes"]["synthetic"] == probes and v["probes"]["select"] + v["probes"]["held"] == probes
        assert [c["iteration"] for c in v["checkpoints"]] == [2, 4] and v["activated_iteration"] == 4

        ckpts = c.get(f"/v1/exemplar-sets/{es['id']}/checkpoints").json()["data"]
        assert [(k["kind"], k["iteration"]) for k in ckpts] == [("base", 0), ("adapted", 2), ("adapted", 4)]
        assert ckpts[-1]["id"] == job["checkpoint_id"] and ckpts[-1]["active"]
        assert ckpts[1]["parent_id"] == base_id and ckpts[2]["parent_id"] == ckpts[1]["id"]

        loc = c.post(f"/v1/exemplar-sets/{es['id']}/localize", files=files(png_bytes(100, 60)),
                     params={"trajectory": "true"})
        assert loc.status_code == 200 and loc.json()["checkpoint_id"] == job["checkpoint_id"]
        assert len(loc.json()["results"][0]["trajectory"]) >= 2

        # the same Idempotency-Key and body give the same job, not a new one
        again = c.post(f"/v1/exemplar-sets/{es['id']}/adaptations", files=unlabeled(),
                   data={"iterations": "4", "activate": "true"},
                       headers={"Idempotency-Key": "e2e-1"})
        assert again.status_code == 202 and again.json()["id"] == job_id

        # roll back to the base policy
        r = c.post(f"/v1/checkpoints/{base_id}/activate")
        assert r.status_code == 200 and r.json()["active_checkpoint_id"] == base_id
        loc = c.post(f"/v1/exemplar-sets/{es['id']}/localize", files=files(png_bytes(100, 60)))
        assert loc.json()["checkpoint_id"] == base_id

        metrics = c.get("/metrics").text
        assert 'qloc_jobs{status="succeeded"} 1.0' in metrics
        assert 'qloc_job_duration_seconds_mean{status="succeeded"}' in metrics
        assert "# TYPE qloc_job_duration_seconds_recorded_sum gauge" in metrics  # rows on record: not a counter
    counts = row_counts(stack.settings.database_url)
    assert counts == {"exemplar_sets": 1, "exemplars": 2, "adaptation_jobs": 1, "job_images": 4, "checkpoints": 3,
                      "pool_images": 0}


def test_kill_9_during_a_job_then_a_new_worker_resumes_it(stack):
    iterations = 10  # killed once 2 checkpoints are written (iteration 4 or so): 6 more to resume
    with api(stack) as c:
        es = register(c)
        r = c.post(f"/v1/exemplar-sets/{es['id']}/adaptations", files=unlabeled(),
                   data={"iterations": str(iterations), "activate": "true"})
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]

        deadline = time.monotonic() + 120
        while True:  # until the job is running and has written at least two checkpoints
            job = c.get(f"/v1/adaptations/{job_id}").json()
            written = c.get(f"/v1/exemplar-sets/{es['id']}/checkpoints").json()["count"] - 1
            if job["status"] == "running" and written >= 2:
                break
            assert job["status"] in ("queued", "running") and time.monotonic() < deadline, (job, stack.logs())
            time.sleep(0.05)
        stack.kill(stack.workers[0])  # SIGKILL to the worker's whole process group, pool included
        killed_at = c.get(f"/v1/adaptations/{job_id}").json()
        assert killed_at["status"] == "running" and killed_at["progress"]["iteration"] < iterations
        before = [k["iteration"] for k in c.get(f"/v1/exemplar-sets/{es['id']}/checkpoints").json()["data"]]
        assert before[0] == 0 and len(before) >= 3

        stack.start_worker()
        job = wait_for_job(c, job_id, timeout=180, stack=stack)
        assert job["status"] == "succeeded", (job, stack.logs())
        assert job["attempts"] == 2 and job["progress"]["iteration"] == iterations

        ckpts = c.get(f"/v1/exemplar-sets/{es['id']}/checkpoints", params={"limit": 200}).json()["data"]
        # every checkpoint_every=2 iterations once: nothing lost, nothing duplicated
        assert [k["iteration"] for k in ckpts] == [0, *range(2, iterations + 1, 2)]
        for parent, child in zip(ckpts, ckpts[1:], strict=False):  # one unbroken lineage across the crash
            assert child["parent_id"] == parent["id"]
        assert job["checkpoint_id"] == ckpts[-1]["id"] and ckpts[-1]["active"]
        log = (stack.log_dir / "worker-1.log").read_text()
        assert f"job {job_id} resumes from checkpoint" in log
    counts = row_counts(stack.settings.database_url)
    assert counts["adaptation_jobs"] == 1 and counts["checkpoints"] == 1 + iterations // 2
