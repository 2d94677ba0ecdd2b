"""What a run records: the checkpoint file's metadata, no second row for an iteration, the error's bound."""

import threading
import uuid

import pytest
import torch
from celery.exceptions import SoftTimeLimitExceeded
from service_fixtures import FAST_JOB
from sqlalchemy import select, update
from test_worker_jobs import new_job

from app.inference import read_checkpoint
from app.tables import AdaptationJob, Checkpoint
from worker import jobs
from worker.context import WorkerContext
from worker.jobs import AdaptationRun, run_adaptation_job


def _ctx(settings):
    return WorkerContext.create(settings.model_copy(update=FAST_JOB))  # what is checked here needs no more probes


def test_checkpoint_files_carry_their_job_metrics_and_resume_state(client, settings):
    ctx = _ctx(settings)
    try:
        job = new_job(client)
        job_id = uuid.UUID(job["id"])
        assert run_adaptation_job(ctx, job_id, worker="test") == "succeeded"
        with ctx.session_factory() as s:
            rows = list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.iteration)))
        bundle = ctx.bundles.get(settings.default_bundle).bundle
        for row in rows:
            agent, meta = read_checkpoint(ctx.store, blob=row.blob, sha256=row.sha256, bundle=bundle)
            assert meta["job_id"] == job["id"] and meta["iteration"] == row.iteration
            assert meta["metrics"] == row.metrics
            assert set(row.metrics) == {"mean_reward", "probe_corloc", "probe_mean_iou", "probe_held_corloc",
                                        "probe_gain", "probe_noise"}
            assert set(meta["resume"]) == {"iteration", "optimizer", "rng"}  # the agent is the file's own part
            assert meta["resume"]["iteration"] == row.iteration
            assert set(agent) == set(bundle.new_agent().state_dict())
    finally:
        ctx.engine.dispose()


def test_a_checkpoint_offered_twice_for_one_iteration_is_recorded_once(client, settings, monkeypatch):
    """``adapt`` may call back again with an iteration already saved (a resumed run's last state): the run
    keeps the first file and row and does not fail on the (job, iteration) unique constraint."""
    real_adapt = jobs.adapt

    def twice(*args, on_checkpoint, **kwargs):
        def both(state):
            on_checkpoint(state)
            on_checkpoint(state)
        return real_adapt(*args, on_checkpoint=both, **kwargs)

    monkeypatch.setattr(jobs, "adapt", twice)
    ctx = _ctx(settings)
    try:
        job = new_job(client)
        assert run_adaptation_job(ctx, uuid.UUID(job["id"]), worker="test") == "succeeded"
        with ctx.session_factory() as s:
            its = list(s.scalars(select(Checkpoint.iteration).where(Checkpoint.job_id == uuid.UUID(job["id"]))
                                 .order_by(Checkpoint.iteration)))
        assert its == [2, 4, 5]
    finally:
        ctx.engine.dispose()


def test_a_failed_job_keeps_the_first_2000_characters_of_its_error(client, settings, monkeypatch):
    def boom(*args, **kwargs):
        raise ValueError("x" * 5000)

    monkeypatch.setattr(jobs, "adapt", boom)
    ctx = _ctx(settings)
    try:
        job = new_job(client)
        assert run_adaptation_job(ctx, uuid.UUID(job["id"]), worker="test") == "failed"
        polled = client.get(f"/v1/adaptations/{job['id']}").json()
        assert polled["status"] == "failed"
        assert polled["error"] == ("ValueError: " + "x" * 5000)[:2000]
    finally:
        ctx.engine.dispose()


def _job_row(ctx, job_id):
    with ctx.session_factory() as s:
        return s.get_one(AdaptationJob, job_id)


def test_progress_rows_between_checkpoints_and_at_the_end(client, settings, monkeypatch):
    """Progress is synced at most every ``progress_every_s``, always at the last iteration and when the phase
    changes (setup -> adapting -> finishing); each sync and each checkpoint writes the run's progress, reward,
    phase, heartbeat (and checkpoint) to its own job row."""
    monkeypatch.setattr(AdaptationRun, "progress_every_s", 1e9)  # the timer never fires in this test
    synced, saved = [], []
    real_sync, real_save = AdaptationRun._sync, AdaptationRun.save_checkpoint

    def sync(self):
        before = _job_row(ctx, self.job_id).heartbeat_at
        real_sync(self)
        row = _job_row(ctx, self.job_id)
        synced.append((self.iteration, row.phase))
        assert row.progress_iteration == self.iteration and row.mean_reward == pytest.approx(self.mean_reward)
        assert row.heartbeat_at > before

    def save(self, iteration, state):
        before = _job_row(ctx, self.job_id).heartbeat_at
        real_save(self, iteration, state)
        row = _job_row(ctx, self.job_id)
        saved.append(iteration)
        assert row.checkpoint_id == self.last_checkpoint_id and row.progress_iteration == iteration
        assert row.mean_reward == pytest.approx(self.mean_reward) and row.heartbeat_at > before
        other_row = _job_row(ctx, other)
        assert (other_row.checkpoint_id, other_row.progress_iteration, other_row.mean_reward) == (None, 0, None)

    monkeypatch.setattr(AdaptationRun, "_sync", sync)
    monkeypatch.setattr(AdaptationRun, "save_checkpoint", save)
    ctx = _ctx(settings)
    try:
        job = new_job(client)
        other = uuid.UUID(new_job(client)["id"])  # queued beside it: its row must not move
        assert run_adaptation_job(ctx, uuid.UUID(job["id"]), worker="test") == "succeeded"
        assert synced == [(0, "adapting"), (5, "adapting"), (5, "finishing")] and saved == [2, 4, 5]
        assert _job_row(ctx, uuid.UUID(job["id"])).phase is None  # done
    finally:
        ctx.engine.dispose()


def test_a_job_adapts_what_it_was_asked_with_from_its_base_checkpoint(client, settings, monkeypatch):
    """``adapt`` gets the job's parameters and the set's adapted policy it starts from; a redelivered job
    whose last checkpoint is already final does not adapt again and reports that checkpoint's reward."""
    calls = []
    real_adapt = jobs.adapt

    def spy(bundle, prototype, images01, cfg, **kwargs):
        calls.append((cfg, kwargs["agent_state"], len(images01)))
        return real_adapt(bundle, prototype, images01, cfg, **kwargs)

    monkeypatch.setattr(jobs, "adapt", spy)
    ctx = _ctx(settings.model_copy(update={"adapt_batch_size": 3}))
    try:
        first = new_job(client)
        assert run_adaptation_job(ctx, uuid.UUID(first["id"]), worker="w-first") == "succeeded"
        cfg, start, n = calls[-1]
        assert (cfg.iterations, cfg.seed, cfg.checkpoint_every, cfg.batch_size, n) == (5, 3, 2, 3, 4)
        assert cfg.lr == pytest.approx(settings.default_learning_rate) and start is None  # the bundle's policy
        assert _job_row(ctx, uuid.UUID(first["id"])).worker == "w-first"

        second = new_job(client, first["exemplar_set_id"], iterations="2", learning_rate="0.02")
        second_id = uuid.UUID(second["id"])
        assert run_adaptation_job(ctx, second_id, worker="w") == "succeeded"
        cfg, start, n = calls[-1]
        assert (cfg.iterations, cfg.lr, cfg.batch_size) == (2, pytest.approx(0.02), 3)
        with ctx.session_factory() as s:
            base = s.get_one(Checkpoint, uuid.UUID(second["params"]["base_checkpoint_id"]))
        want, _ = read_checkpoint(ctx.store, blob=base.blob, sha256=base.sha256,
                                  bundle=ctx.bundles.get(settings.default_bundle).bundle)
        assert start is not None and set(start) == set(want)
        assert all(torch.equal(start[k], want[k]) for k in want)  # the first job's final policy

        # redelivered after its last checkpoint but before its outcome was written
        last = _job_row(ctx, second_id)
        with ctx.session_factory.begin() as s:
            s.execute(update(AdaptationJob).where(AdaptationJob.id == second_id)
                      .values(status="queued", mean_reward=None, finished_at=None))
        before = len(calls)
        assert run_adaptation_job(ctx, second_id, worker="w") == "succeeded"
        assert len(calls) == before  # nothing left to adapt
        row = _job_row(ctx, second_id)
        assert row.checkpoint_id == last.checkpoint_id and row.progress_iteration == 2
        with ctx.session_factory() as s:
            final = s.get_one(Checkpoint, last.checkpoint_id)
        assert row.mean_reward == pytest.approx(final.metrics["mean_reward"])
    finally:
        ctx.engine.dispose()


def test_a_canceled_run_and_a_timed_out_one_say_why(client, settings, monkeypatch):
    ctx = _ctx(settings)
    try:
        monkeypatch.setattr(AdaptationRun, "should_stop", lambda self: True)
        job = new_job(client)
        assert run_adaptation_job(ctx, uuid.UUID(job["id"]), worker="test") == "canceled"
        assert client.get(f"/v1/adaptations/{job['id']}").json()["error"] == "canceled on request"
        monkeypatch.undo()

        def late(*args, **kwargs):
            raise SoftTimeLimitExceeded()

        monkeypatch.setattr(jobs, "adapt", late)
        job = new_job(client)
        assert run_adaptation_job(ctx, uuid.UUID(job["id"]), worker="test") == "failed"
        assert client.get(f"/v1/adaptations/{job['id']}").json()["error"] == (
            f"time limit exceeded ({settings.job_soft_time_limit:g} s); checkpoints written so far are kept")
    finally:
        ctx.engine.dispose()


def test_a_run_writes_nothing_once_its_job_was_failed_under_it(client, settings, monkeypatch):
    """The reaper may fail a job whose heartbeat looked stale while its run still works (same attempt): the
    run must then not record an outcome, and its progress must not land on another running job."""
    real_adapt = jobs.adapt
    ctx = _ctx(settings)

    def failed_meanwhile(*args, **kwargs):
        result = real_adapt(*args, **kwargs)
        with ctx.session_factory.begin() as s:
            s.execute(update(AdaptationJob).where(AdaptationJob.id == job_id).values(status="failed"))
        return result

    monkeypatch.setattr(jobs, "adapt", failed_meanwhile)
    try:
        other = uuid.UUID(new_job(client)["id"])
        assert jobs.claim_job(ctx, other, worker="other") == 1  # running, attempt 1, like the run below
        with ctx.session_factory.begin() as s:
            s.execute(update(AdaptationJob).where(AdaptationJob.id == other).values(progress_iteration=3,
                                                                                     mean_reward=1.5))
        other_before = _job_row(ctx, other)
        job_id = uuid.UUID(new_job(client)["id"])
        assert run_adaptation_job(ctx, job_id, worker="test") == "lost"
        assert _job_row(ctx, job_id).status == "failed"
        other_row = _job_row(ctx, other)
        assert (other_row.status, other_row.progress_iteration, other_row.mean_reward) == ("running", 3, 1.5)
        assert other_row.heartbeat_at == other_before.heartbeat_at
    finally:
        ctx.engine.dispose()


def test_a_runs_heads_are_stored_once_each_under_the_sets_folder_by_their_digest(tmp_path):
    """``_store_head``: each distinct head written once, under the set's heads folder and named by its file's digest;
    the same head object asked again gets its reference back without a second write."""
    from types import SimpleNamespace

    from app.storage import BlobStore, head_key

    store = BlobStore(tmp_path / "blobs")
    puts = []
    real_put = store.put

    def put(key: str, data: bytes) -> str:  # each write recorded
        puts.append(key)
        return real_put(key, data)

    store.put = put  # type: ignore[method-assign]
    run = AdaptationRun(SimpleNamespace(store=store), uuid.uuid4(), attempt=1)  # type: ignore[arg-type]
    set_id = uuid.uuid4()
    run.exemplar_set = SimpleNamespace(id=set_id)
    one, two = {"w": torch.ones(3)}, {"w": torch.zeros(3)}
    ref_one = run._store_head(one)
    ref_two = run._store_head(two)
    for ref in (ref_one, ref_two):
        assert ref["key"] == head_key(set_id, ref["sha256"])
    assert ref_one != ref_two and store.exists(ref_one["key"]) and store.exists(ref_two["key"])
    assert run._store_head(one) is ref_one and run._store_head(two) is ref_two
    assert puts == [ref_one["key"], ref_two["key"]]


def test_a_shutdown_is_found_behind_a_chain_of_errors_and_a_cycle_ends_the_search():
    """``_stopping``: the ``SystemExit`` or ``KeyboardInterrupt`` in an error's context or cause, else None, also when
    the chain loops back on itself."""
    stop = KeyboardInterrupt()
    inner = RuntimeError("connection in transaction status ACTIVE")
    inner.__context__ = stop
    outer = ValueError("cleanup")
    outer.__cause__ = inner
    assert jobs._stopping(outer) is stop and jobs._stopping(stop) is stop
    exit_ = SystemExit(1)
    assert jobs._stopping(exit_) is exit_
    assert jobs._stopping(RuntimeError("alone")) is None

    def bounded(e: BaseException) -> BaseException | None:  # a search that loops fails here, not at the suite's timeout
        out: list = []
        t = threading.Thread(target=lambda: out.append(jobs._stopping(e)), daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), "the search went round the loop forever"
        return out[0]

    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a  # a loop: no shutdown behind it
    c = RuntimeError("c")
    c.__context__ = c  # itself
    assert bounded(a) is None and bounded(c) is None
