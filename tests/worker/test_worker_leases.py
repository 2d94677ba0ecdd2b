"""The job code's leases, checked one at a time, and its boundaries.

A run owns its job while ``(status, attempts)`` is ``("running", its attempt)``. Each check below is
the only one that can notice a stolen lease at the moment the lease is stolen (another worker claims
the job): the heartbeat, the progress sync, the check before a checkpoint's file, the one before its
row, the final update, and ``fail_job``. Each test steals the lease at that moment and asserts that
the run ends ``lost`` having written nothing: no file, no row, the new owner's job row untouched.

Also: the attempt budget at its exact boundary (run and reaper), a resumed run starting from its
checkpoint's iteration, and ``claim_job`` / ``reap_abandoned_jobs`` on SQLite and PostgreSQL.
"""

import dataclasses
import math
import threading
import time
import uuid
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from service_fixtures import FAST_JOB, at_once, files, png_bytes
from sqlalchemy import event, inspect, select, update

from app.main import create_app
from app.storage import job_prefix
from app.tables import AdaptationJob, Checkpoint, utcnow
from worker import jobs
from worker.context import WorkerContext
from worker.jobs import AdaptationRun, claim_job, fail_job, run_adaptation_job
from worker.reaper import reap_abandoned_jobs


class Crash(BaseException):
    """Stands for the process dying: nothing in the job code catches it."""


# --- helpers


@pytest.fixture
def make_ctx(settings):
    """Worker contexts on the test's database with some settings changed (and ``FAST_JOB``'s: the leases and
    budgets under test do not depend on how many probes a job scores)."""
    made = []

    def make(**overrides):
        c = WorkerContext.create(settings.model_copy(update={**FAST_JOB, **overrides}))
        made.append(c)
        return c

    yield make
    for c in made:
        c.engine.dispose()


@pytest.fixture
def quiet_ctx(make_ctx, monkeypatch):
    """A run that no check but the one under test can catch: no heartbeat beats during the test, and
    progress is synced only where the test says (the sync's timer never fires)."""
    monkeypatch.setattr(AdaptationRun, "progress_every_s", math.inf)
    return make_ctx(heartbeat_interval=60.0, heartbeat_timeout=120.0)


def new_job(client, set_id=None, **data):
    if set_id is None:
        set_id = client.post("/v1/exemplar-sets", files=files(png_bytes(28, 28, seed=9))).json()["id"]
    data = {"iterations": "30", "seed": "3", **data}
    r = client.post(f"/v1/exemplar-sets/{set_id}/adaptations", data=data,
                    files=files(*[png_bytes(84, 84, seed=i) for i in range(3)]))
    assert r.status_code == 202, r.text
    job = r.json()
    return uuid.UUID(job["id"]), uuid.UUID(job["exemplar_set_id"])


class AdaptSpy:
    """Wraps ``models.adapt.adapt`` as the worker calls it.

    Records the iteration each run starts from and every iteration it runs; ``hooks[i](run)`` runs
    right after the run's own ``on_progress`` of iteration ``i`` (before that iteration's checkpoint),
    ``after(run)`` once ``adapt`` has returned.
    """

    def __init__(self, monkeypatch):
        self.starts: list[int] = []
        self.iterations: list[int] = []
        self.hooks: dict[int, object] = {}
        self.after = None
        real = jobs.adapt

        def adapt(bundle, prototype, images01, cfg, *, resume=None, on_progress=None, **kw):
            run = on_progress.__self__
            self.starts.append(0 if resume is None else int(resume["iteration"]))

            def progress(iteration, total, reward):
                self.iterations.append(iteration)
                on_progress(iteration, total, reward)
                if iteration in self.hooks:
                    self.hooks[iteration](run)

            result = real(bundle, prototype, images01, cfg, resume=resume, on_progress=progress, **kw)
            if self.after is not None:
                self.after(run)
            return result

        monkeypatch.setattr(jobs, "adapt", adapt)


def snapshot(ctx, job_id):
    with ctx.session_factory() as s:
        job = s.get_one(AdaptationJob, job_id)
        return {a.key: getattr(job, a.key) for a in inspect(AdaptationJob).column_attrs}


class Theft:
    """Another worker claims the job (its clock says the run's heartbeat is stale): the lease moves on."""

    def __init__(self, ctx, job_id):
        self.ctx, self.job_id = ctx, job_id
        self.after: dict | None = None

    def __call__(self, *_):
        thief = dataclasses.replace(self.ctx, settings=self.ctx.settings.model_copy(
            update={"heartbeat_timeout": -3600.0}))
        assert claim_job(thief, self.job_id, worker="thief") == 2
        self.after = snapshot(self.ctx, self.job_id)  # the new owner's row: the old run must leave it be


def checkpoint_rows(ctx, job_id):
    with ctx.session_factory() as s:
        return list(s.scalars(select(Checkpoint.iteration).where(Checkpoint.job_id == job_id)
                              .order_by(Checkpoint.iteration)))


def checkpoint_files(ctx, set_id, job_id):
    d = ctx.store.path(job_prefix(set_id, job_id)) / "checkpoints"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def wait_until(condition, timeout):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


def assert_lost_with_nothing_written(ctx, job_id, set_id, theft, outcome, files_left=()):
    assert outcome == "lost"
    assert theft.after is not None, "the lease was never stolen"
    assert snapshot(ctx, job_id) == theft.after  # status running, attempts 2, worker "thief", as the thief left it
    assert checkpoint_rows(ctx, job_id) == []
    assert checkpoint_files(ctx, set_id, job_id) == list(files_left)


# --- each lease check alone


def test_the_heartbeat_alone_notices_a_stolen_lease_and_stops_the_run(client, make_ctx, monkeypatch):
    monkeypatch.setattr(AdaptationRun, "progress_every_s", math.inf)
    ctx = make_ctx(heartbeat_interval=0.05, heartbeat_timeout=120.0, checkpoint_every=1000)
    job_id, set_id = new_job(client)
    spy, theft = AdaptSpy(monkeypatch), Theft(ctx, job_id)

    def steal_then_let_the_heartbeat_beat(run):
        theft()
        wait_until(lambda: run.heartbeat.lost, timeout=3)

    spy.hooks[2] = steal_then_let_the_heartbeat_beat
    outcome = run_adaptation_job(ctx, job_id, worker="w")
    assert spy.iterations == [1, 2]  # stopped before iteration 3, not at the end
    assert_lost_with_nothing_written(ctx, job_id, set_id, theft, outcome)


def steal_then_sync_at_the_next_check(theft):
    """A hook for ``AdaptSpy``: steal the lease, then let the run sync at its next cancel check."""
    def hook(run):
        theft()
        run.progress_every_s = 0.0
    return hook


def test_the_progress_sync_alone_notices_a_stolen_lease_and_stops_the_run(client, quiet_ctx, make_ctx, monkeypatch):
    ctx = make_ctx(heartbeat_interval=60.0, heartbeat_timeout=120.0, checkpoint_every=1000)
    job_id, set_id = new_job(client)
    spy, theft = AdaptSpy(monkeypatch), Theft(ctx, job_id)

    spy.hooks[2] = steal_then_sync_at_the_next_check(theft)
    outcome = run_adaptation_job(ctx, job_id, worker="w")
    assert spy.iterations == [1, 2]
    assert_lost_with_nothing_written(ctx, job_id, set_id, theft, outcome)


def test_a_run_that_knows_it_lost_its_lease_issues_no_more_writes(client, quiet_ctx, make_ctx, monkeypatch):
    """The sync finds the lease gone and ``adapt`` stops: the run must end there, not go on to record
    an outcome (the final update would match no row, but a lost run must not even try)."""
    ctx = make_ctx(heartbeat_interval=60.0, heartbeat_timeout=120.0, checkpoint_every=1000)
    job_id, set_id = new_job(client)
    spy, theft = AdaptSpy(monkeypatch), Theft(ctx, job_id)
    writes: list[str] = []
    me = threading.get_ident()

    @event.listens_for(ctx.engine, "before_cursor_execute")
    def record(conn, cursor, statement, *_):
        if theft.after is not None and threading.get_ident() == me and statement.lstrip().upper().startswith(
                ("UPDATE", "INSERT", "DELETE")):
            writes.append(statement)

    spy.hooks[2] = steal_then_sync_at_the_next_check(theft)
    outcome = run_adaptation_job(ctx, job_id, worker="w")
    assert spy.iterations == [1, 2]
    assert len(writes) == 1, writes  # the sync's own conditional update, which found the lease gone
    assert_lost_with_nothing_written(ctx, job_id, set_id, theft, outcome)


def test_no_checkpoint_file_once_the_lease_is_lost(client, quiet_ctx, monkeypatch):
    job_id, set_id = new_job(client)
    spy, theft = AdaptSpy(monkeypatch), Theft(quiet_ctx, job_id)
    spy.hooks[2] = theft  # after iteration 2's progress, before its checkpoint
    outcome = run_adaptation_job(quiet_ctx, job_id, worker="w")
    assert spy.iterations == [1, 2]
    assert_lost_with_nothing_written(quiet_ctx, job_id, set_id, theft, outcome)


def test_no_checkpoint_row_once_the_lease_is_lost_while_its_file_is_written(client, quiet_ctx, monkeypatch):
    job_id, set_id = new_job(client)
    spy, theft = AdaptSpy(monkeypatch), Theft(quiet_ctx, job_id)
    put = quiet_ctx.store.put

    def put_then_lose_the_lease(key, data):
        sha = put(key, data)
        if "/checkpoints/" in key and theft.after is None:
            theft()
        return sha

    monkeypatch.setattr(quiet_ctx.store, "put", put_then_lose_the_lease)
    outcome = run_adaptation_job(quiet_ctx, job_id, worker="w")
    assert spy.iterations == [1, 2]
    # the file went out before the lease did; it is never recorded (the new owner rewrites that iteration)
    assert_lost_with_nothing_written(quiet_ctx, job_id, set_id, theft, outcome, files_left=["0000002.pt"])


def test_no_outcome_recorded_once_the_lease_is_lost(client, quiet_ctx, monkeypatch):
    job_id, set_id = new_job(client, iterations="4")
    base = client.get(f"/v1/exemplar-sets/{set_id}").json()["active_checkpoint_id"]
    spy, theft = AdaptSpy(monkeypatch), Theft(quiet_ctx, job_id)
    spy.after = theft  # every iteration and checkpoint done under the lease; lost before the final update
    outcome = run_adaptation_job(quiet_ctx, job_id, worker="w")
    assert outcome == "lost" and spy.iterations == [1, 2, 3, 4]
    assert snapshot(quiet_ctx, job_id) == theft.after
    assert checkpoint_rows(quiet_ctx, job_id) == [2, 4]  # written while the run owned the job: kept
    assert client.get(f"/v1/exemplar-sets/{set_id}").json()["active_checkpoint_id"] == base  # not activated


def test_an_error_after_the_lease_is_lost_leaves_the_new_owners_job_alone(client, quiet_ctx, monkeypatch):
    job_id, set_id = new_job(client)
    spy, theft = AdaptSpy(monkeypatch), Theft(quiet_ctx, job_id)

    def steal_then_fail(run):
        theft()
        raise RuntimeError("boom")

    spy.hooks[1] = steal_then_fail
    outcome = run_adaptation_job(quiet_ctx, job_id, worker="w")
    assert spy.iterations == [1]
    assert_lost_with_nothing_written(quiet_ctx, job_id, set_id, theft, outcome)  # not failed: the thief runs it
    assert fail_job(quiet_ctx, job_id, 1, "late") == "lost" and snapshot(quiet_ctx, job_id) == theft.after


# --- the attempt budget, at its boundary


def set_row(ctx, job_id, **values):
    with ctx.session_factory.begin() as s:
        s.execute(update(AdaptationJob).where(AdaptationJob.id == job_id).values(**values))


def test_the_last_allowed_attempt_runs_and_the_one_after_fails(client, make_ctx, monkeypatch):
    ctx = make_ctx()
    n = ctx.settings.max_job_attempts
    last, set_id = new_job(client, iterations="2")
    over, _ = new_job(client, str(set_id), iterations="2")
    set_row(ctx, last, attempts=n - 1)  # redelivered after n - 1 lost runs
    set_row(ctx, over, attempts=n)
    spy = AdaptSpy(monkeypatch)

    assert run_adaptation_job(ctx, last, worker="w") == "succeeded"
    assert spy.starts == [0] and snapshot(ctx, last)["attempts"] == n

    assert run_adaptation_job(ctx, over, worker="w") == "failed"
    assert spy.starts == [0]  # never started
    job = snapshot(ctx, over)
    assert job["status"] == "failed" and job["attempts"] == n + 1
    assert job["error"] == f"gave up after {n} attempts (worker lost each time)"
    assert checkpoint_rows(ctx, over) == []


@pytest.fixture
def db_client(db_settings):
    app = create_app(db_settings)
    yield TestClient(app)
    app.state.engine.dispose()


@pytest.fixture
def db_ctx(db_settings):
    c = WorkerContext.create(db_settings)
    yield c
    c.engine.dispose()


def test_the_reaper_requeues_below_the_budget_and_fails_at_it(db_client, db_ctx):
    n = db_ctx.settings.max_job_attempts
    below, set_id = new_job(db_client)
    at, _ = new_job(db_client, str(set_id))
    hour_ago = utcnow() - timedelta(hours=1)
    set_row(db_ctx, below, status="running", attempts=n - 1, worker="dead", heartbeat_at=hour_ago)
    set_row(db_ctx, at, status="running", attempts=n, worker="dead", heartbeat_at=hour_ago)
    assert reap_abandoned_jobs(db_ctx) == ([below], [at])
    requeued, failed = snapshot(db_ctx, below), snapshot(db_ctx, at)
    assert (requeued["status"], requeued["attempts"], requeued["worker"], requeued["enqueued_at"]) == (
        "queued", n - 1, None, None)
    assert failed["status"] == "failed" and failed["attempts"] == n and failed["finished_at"] is not None
    assert failed["error"] == f"worker lost {n} times (no heartbeat for {db_ctx.settings.heartbeat_timeout:g} s)"
    assert reap_abandoned_jobs(db_ctx) == ([], [])


def test_the_reaper_cancels_an_abandoned_job_whose_cancel_was_asked(db_client, db_ctx):
    """A dead worker's job the user asked to cancel is canceled, not resumed only to be canceled there, whatever its
    attempts; the end is dated by the round's clock (as a failure at the budget is)."""
    n = db_ctx.settings.max_job_attempts
    asked, set_id = new_job(db_client)
    asked_at_budget, _ = new_job(db_client, str(set_id))
    at_budget, _ = new_job(db_client, str(set_id))
    hour_ago = utcnow() - timedelta(hours=1)
    set_row(db_ctx, asked, status="running", attempts=1, worker="dead", heartbeat_at=hour_ago, cancel_requested=True)
    set_row(db_ctx, asked_at_budget, status="running", attempts=n, worker="dead", heartbeat_at=hour_ago,
            cancel_requested=True)
    set_row(db_ctx, at_budget, status="running", attempts=n, worker="dead", heartbeat_at=hour_ago)
    now = utcnow() + timedelta(minutes=5)  # a round's clock, not the database's
    assert reap_abandoned_jobs(db_ctx, now=now) == ([], [at_budget])
    for job_id in (asked, asked_at_budget):
        job = snapshot(db_ctx, job_id)
        assert (job["status"], job["error"], job["finished_at"]) == ("canceled", "canceled on request", now)
    assert snapshot(db_ctx, at_budget)["finished_at"] == now
    assert reap_abandoned_jobs(db_ctx, now=now) == ([], [])


# --- a redelivered job resumes from its checkpoint


def test_a_redelivered_job_resumes_from_its_latest_checkpoint(client, make_ctx, monkeypatch):
    ctx = make_ctx()
    job_id, _ = new_job(client, iterations="7")  # checkpoint_every=2: checkpoints at 2, 4, 6, 7
    spy = AdaptSpy(monkeypatch)
    on_checkpoint = AdaptationRun.on_checkpoint

    def die_after_the_checkpoint_at_4(self, state):
        on_checkpoint(self, state)
        if state["iteration"] == 4:
            raise Crash

    with monkeypatch.context() as m:
        m.setattr(AdaptationRun, "on_checkpoint", die_after_the_checkpoint_at_4)
        with pytest.raises(Crash):
            run_adaptation_job(ctx, job_id, worker="dies")
    assert (spy.starts, spy.iterations) == ([0], [1, 2, 3, 4])
    assert checkpoint_rows(ctx, job_id) == [2, 4]
    later = utcnow() + timedelta(seconds=ctx.settings.heartbeat_timeout + 1)
    assert reap_abandoned_jobs(ctx, now=later) == ([job_id], [])

    spy.starts.clear()
    spy.iterations.clear()
    assert run_adaptation_job(ctx, job_id, worker="second") == "succeeded"
    assert spy.starts == [4]  # the latest checkpoint, not 0 nor an earlier one
    assert spy.iterations == [5, 6, 7]  # only what the first run did not do
    assert checkpoint_rows(ctx, job_id) == [2, 4, 6, 7]
    job = snapshot(ctx, job_id)
    assert job["attempts"] == 2 and job["progress_iteration"] == 7 and job["status"] == "succeeded"


# --- claim and reap, on SQLite and PostgreSQL


def test_claim_job(db_client, db_ctx):
    job_id, set_id = new_job(db_client)
    assert claim_job(db_ctx, job_id, worker="a") == 1
    first = snapshot(db_ctx, job_id)
    assert first["status"] == "running" and first["worker"] == "a" and first["started_at"] is not None
    assert claim_job(db_ctx, job_id, worker="b") is None  # the heartbeat is fresh
    set_row(db_ctx, job_id, heartbeat_at=utcnow() - timedelta(seconds=db_ctx.settings.heartbeat_timeout + 1))
    assert claim_job(db_ctx, job_id, worker="b") == 2
    second = snapshot(db_ctx, job_id)
    assert second["worker"] == "b" and second["started_at"] == first["started_at"]  # the first start is kept
    assert second["heartbeat_at"] > first["heartbeat_at"]

    for finished in ("succeeded", "failed", "canceled"):
        set_row(db_ctx, job_id, status=finished, heartbeat_at=utcnow() - timedelta(hours=1))
        assert claim_job(db_ctx, job_id, worker="c") is None
        assert snapshot(db_ctx, job_id)["attempts"] == 2

    # many workers at once: one claim wins
    contested, _ = new_job(db_client, str(set_id))
    results = at_once(db_ctx.settings, 6, lambda c, i: claim_job(c, contested, worker=f"w{i}"))
    assert sorted(results, key=lambda r: r or 0) == [None] * 5 + [1]
    assert snapshot(db_ctx, contested)["attempts"] == 1


def test_reap_abandoned_jobs(db_client, db_ctx):
    timeout = db_ctx.settings.heartbeat_timeout
    now = utcnow()
    fresh, set_id = new_job(db_client)
    stale = [new_job(db_client, str(set_id))[0] for _ in range(3)]
    done, _ = new_job(db_client, str(set_id))
    queued, _ = new_job(db_client, str(set_id))
    set_row(db_ctx, fresh, status="running", attempts=1, heartbeat_at=now - timedelta(seconds=timeout - 1))
    for job_id in stale[:2]:
        set_row(db_ctx, job_id, status="running", attempts=1, heartbeat_at=now - timedelta(seconds=timeout + 1))
    set_row(db_ctx, stale[2], status="running", attempts=1, heartbeat_at=None)
    set_row(db_ctx, done, status="succeeded", attempts=1, heartbeat_at=now - timedelta(hours=1))
    set_row(db_ctx, queued, heartbeat_at=now - timedelta(hours=1))

    # concurrent reapers (one per worker): each job requeued once, by one of them
    rounds = at_once(db_ctx.settings, 4, lambda c, i: reap_abandoned_jobs(c, now=now))
    requeued = [j for r, _ in rounds for j in r]
    failed = [j for _, f in rounds for j in f]
    assert sorted(requeued) == sorted(stale) and failed == []
    for job_id in stale:
        assert snapshot(db_ctx, job_id)["status"] == "queued"
    assert snapshot(db_ctx, fresh)["status"] == "running"
    assert snapshot(db_ctx, done)["status"] == "succeeded"
    assert snapshot(db_ctx, queued)["status"] == "queued"
