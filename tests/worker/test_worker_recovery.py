"""Recovery from a dead worker with the shipped timings (``heartbeat_interval`` / ``heartbeat_timeout`` /
``reaper_interval`` at their defaults, not the other tests' short ones).

``kill -9`` a real Celery worker (its whole process group, pool included) in the middle of a job, start
another one: the new worker's reaper finds the job's heartbeat stale, requeues and sends it, and the job
resumes from its latest checkpoint on the new worker within 20 s of the kill, then succeeds with every
checkpoint written once and one unbroken lineage. ``benchmarks/recovery.py`` times the same sequence.

And ``kill -9`` of the pool process alone (the OOM killer's way): the worker's main process expires the job's
lease and Celery requeues the message, so the job resumes at once, long before its heartbeat times out.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from service_fixtures import FAST_JOB, Stack, files, make_test_settings, migrate, png_bytes, running_stack
from sqlalchemy import select, update

from app.config import Settings
from app.db import make_engine, make_sessionmaker
from app.tables import AdaptationJob, Checkpoint
from worker.jobs import claim_job
from worker.reaper import expire_lease, reap_abandoned_jobs

RESUME_WITHIN_S = 20.0
"""The floor: a job whose worker died is running again on another worker this long after the kill."""


def shipped_timings() -> dict[str, float]:
    return {name: Settings.model_fields[name].default
            for name in ("heartbeat_interval", "heartbeat_timeout", "reaper_interval")}


def recovery_settings(root: Path, bundle_dir: Path, **overrides: Any) -> Settings:
    # The shipped recovery timings; the job's probe count does not bear on them (``FAST_JOB``: a quicker setup).
    return make_test_settings(root, bundle_dir, **{**shipped_timings(), **FAST_JOB, **overrides})


def test_shipped_timings_resume_a_dead_workers_job_within_the_floor():
    t = shipped_timings()
    # a job is reaped at most heartbeat_timeout + reaper_interval after its last beat; one late beat is tolerated
    assert t["heartbeat_timeout"] + t["reaper_interval"] < RESUME_WITHIN_S - 2
    assert t["heartbeat_timeout"] >= 4 * t["heartbeat_interval"]


def test_expire_lease_frees_only_the_dead_processs_run(api, ctx):
    """On SQLite and PostgreSQL: only the run of the named process loses its lease, and at once."""
    set_id = api.post("/v1/exemplar-sets", files=files(png_bytes(28, 28))).json()["id"]
    job_id = uuid.UUID(api.post(f"/v1/exemplar-sets/{set_id}/adaptations", files=files(png_bytes())).json()["id"])
    assert not expire_lease(ctx, job_id, "host:1")  # queued: nothing to expire
    assert claim_job(ctx, job_id, worker="host:1") == 1
    assert not expire_lease(ctx, job_id, "host:2")  # another process's name: the live run keeps its lease
    assert claim_job(ctx, job_id, worker="host:3") is None and reap_abandoned_jobs(ctx) == ([], [])
    assert expire_lease(ctx, job_id, "host:1")
    assert claim_job(ctx, job_id, worker="host:3") == 2  # taken over at once, no timeout waited
    assert not expire_lease(ctx, job_id, "host:1")  # late news of the first process: the new run is untouched
    assert claim_job(ctx, job_id, worker="host:4") is None and reap_abandoned_jobs(ctx) == ([], [])
    with ctx.session_factory() as s:
        job = s.get_one(AdaptationJob, job_id)
    assert (job.status, job.attempts, job.worker) == ("running", 2, "host:3")

    # only the job named: another run recorded under the same process name keeps its lease
    other = uuid.UUID(api.post(f"/v1/exemplar-sets/{set_id}/adaptations", files=files(png_bytes())).json()["id"])
    assert claim_job(ctx, other, worker="host:3") == 1
    assert expire_lease(ctx, job_id, "host:3")
    assert claim_job(ctx, other, worker="host:5") is None and claim_job(ctx, job_id, worker="host:5") == 3
    # a finished run is left as it finished: its heartbeat is not dated back
    with ctx.session_factory.begin() as s:
        s.execute(update(AdaptationJob).where(AdaptationJob.id == job_id).values(status="succeeded"))
    with ctx.session_factory() as s:
        beat = s.get_one(AdaptationJob, job_id).heartbeat_at
    assert not expire_lease(ctx, job_id, "host:5")
    with ctx.session_factory() as s:
        assert s.get_one(AdaptationJob, job_id).heartbeat_at == beat


def _rows(session_factory, job_id: uuid.UUID) -> tuple[AdaptationJob, list[Checkpoint]]:
    with session_factory() as s:
        job = s.get_one(AdaptationJob, job_id)
        ckpts = list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.iteration)))
    return job, ckpts


def _worker_ready(stack: Stack, index: int) -> bool:
    log = stack.log_dir / f"worker-{index}.log"
    return log.exists() and " ready." in log.read_text(errors="replace")


def kill_mid_job_and_resume(stack: Stack, *, iterations: int = 20, kill_after: int = 2, victim: str = "worker",
                            timeout: float = 180) -> dict[str, Any]:
    """Start a job, ``kill -9`` its worker (``victim="worker"``: the whole process group, then a new worker is
    started; ``"pool"``: the pool process running the job, the worker lives on) once the job has written
    ``kill_after`` checkpoints -> seconds from the kill to the new worker ready, the job requeued, running
    again, succeeded; the job row and its checkpoints at the kill and at the end. The stack's API and its
    last worker run."""
    engine = make_engine(stack.settings.database_url)
    sf = make_sessionmaker(engine)
    try:
        with httpx.Client(base_url=stack.base_url, timeout=60) as c:
            r = c.post("/v1/exemplar-sets", files=files(png_bytes(28, 28, seed=1), png_bytes(32, 32, "RGB", seed=2)))
            assert r.status_code == 201, r.text
            set_id = r.json()["id"]
            r = c.post(f"/v1/exemplar-sets/{set_id}/adaptations", data={"iterations": str(iterations)},
                       files=files(*[png_bytes(84, 84, seed=10 + i) for i in range(4)]))
            assert r.status_code == 202, r.text
            job_id = uuid.UUID(r.json()["id"])

        deadline = time.monotonic() + timeout
        while True:  # until the job runs and has written kill_after checkpoints
            job, ckpts = _rows(sf, job_id)
            if job.status == "running" and len(ckpts) >= kill_after:
                break
            assert job.status in ("queued", "running") and time.monotonic() < deadline, (job.status, stack.logs())
            time.sleep(0.05)
        killed_at = time.monotonic()
        if victim == "worker":
            stack.kill(stack.workers[-1])  # SIGKILL to the worker's whole process group, pool included
        else:  # the pool process that claimed the job (its name is host:pid)
            os.kill(int(job.worker.rsplit(":", 1)[1]), signal.SIGKILL)
        at_kill, ckpts_at_kill = _rows(sf, job_id)
        assert at_kill.status == "running" and at_kill.progress_iteration < iterations
        if victim == "worker":
            new_index = len(stack.workers)
            stack.start_worker()
        else:
            new_index = len(stack.workers) - 1

        t: dict[str, float | None] = {"ready": None, "requeued": None, "running": None, "succeeded": None}
        while t["succeeded"] is None:
            now = time.monotonic() - killed_at
            job, _ = _rows(sf, job_id)
            if t["ready"] is None and _worker_ready(stack, new_index):
                t["ready"] = now
            if t["requeued"] is None and job.status == "queued":
                t["requeued"] = now
            if t["running"] is None and job.status == "running" and job.attempts > at_kill.attempts:
                t["running"] = now
            if job.status in ("succeeded", "failed", "canceled"):
                assert job.status == "succeeded", (job.status, job.error, stack.logs())
                t["succeeded"] = now
                t["running"] = t["running"] if t["running"] is not None else now
            assert now < timeout, (job.status, job.attempts, stack.logs())
            time.sleep(0.05)
        final, ckpts = _rows(sf, job_id)
        return {"job_id": job_id, "seconds": t, "at_kill": at_kill, "checkpoints_at_kill": ckpts_at_kill,
                "final": final, "checkpoints": ckpts, "new_worker_log": stack.log_dir / f"worker-{new_index}.log"}
    finally:
        engine.dispose()


@pytest.fixture(params=["postgres_redis"])  # the embedded setup is timed by benchmarks/recovery.py (and killed
def recovery_stack(request, tmp_path, bundle_dir):  # with the tests' short timings in test_worker_end_to_end)
    with running_stack(request.param, request, tmp_path, bundle_dir, make=recovery_settings) as st:
        yield st


def check_resumed_once(out: dict[str, Any], iterations: int) -> None:
    final, ckpts = out["final"], out["checkpoints"]
    # one run at a time: the dead worker's run (attempt 1) and the new worker's (attempt 2), nothing else
    assert final.status == "succeeded" and final.attempts == 2 and final.progress_iteration == iterations
    assert final.worker != out["at_kill"].worker
    # resumed from the latest checkpoint: what was written before the kill is kept, and nothing is written twice
    iters = [k.iteration for k in ckpts]
    assert iters == list(range(2, iterations + 1, 2)), iters
    before = {k.id: k.iteration for k in out["checkpoints_at_kill"]}
    assert {k.id: k.iteration for k in ckpts if k.id in before} == before
    for parent, child in zip(ckpts, ckpts[1:], strict=False):  # one lineage across the crash
        assert child.parent_id == parent.id
    assert final.checkpoint_id == ckpts[-1].id
    resumed_at = max(before.values())
    log = out["new_worker_log"].read_text(errors="replace")
    assert f"job {out['job_id']} resumes from checkpoint" in log and f"at iteration {resumed_at}" in log, log[-3000:]


@pytest.mark.slow
@pytest.mark.exclusive  # timed: nothing else shares the machine (tests/conftest.py)
def test_kill_9_mid_job_resumes_on_a_new_worker_within_the_floor(recovery_stack):
    out = kill_mid_job_and_resume(recovery_stack, iterations=12, kill_after=2)
    t = out["seconds"]
    assert t["running"] is not None and t["running"] < RESUME_WITHIN_S, (t, recovery_stack.logs())
    check_resumed_once(out, 12)


@pytest.mark.slow
@pytest.mark.exclusive  # timed: nothing else shares the machine (tests/conftest.py)
def test_kill_9_of_the_pool_process_resumes_at_once(tmp_path, bundle_dir):
    """The worker lives: its main process expires the lease once the pool reports the process lost (after
    ``worker_lost_wait``, 1 s); without that the job would wait out its heartbeat timeout (60 s here), and with
    Celery's default lost wait (10 s) it would resume only after that."""
    settings = recovery_settings(tmp_path, bundle_dir, heartbeat_timeout=60.0)
    migrate(settings.database_url)
    st = Stack(settings, tmp_path)
    st.start_api()
    st.start_worker()
    try:
        st.wait_ready()
        out = kill_mid_job_and_resume(st, iterations=12, kill_after=2, victim="pool")
        t = out["seconds"]
        assert t["running"] is not None and t["running"] < 8.0, (t, st.logs())  # measured: 2.3 s
        check_resumed_once(out, 12)
        log = out["new_worker_log"].read_text(errors="replace")
        assert f"job {out['job_id']}: its process {out['at_kill'].worker} died; lease expired" in log, log[-3000:]
    finally:
        st.stop()
