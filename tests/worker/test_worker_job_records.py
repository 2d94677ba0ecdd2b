"""What a run records: the checkpoint file's metadata, no second row for an iteration, the error's bound."""

import uuid

import pytest
from sqlalchemy import select
from test_worker_jobs import new_job

from app.inference import read_checkpoint
from app.tables import AdaptationJob, Checkpoint
from worker import jobs
from worker.context import WorkerContext
from worker.jobs import AdaptationRun, run_adaptation_job


def _ctx(settings):
    return WorkerContext.create(settings)


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
            assert meta["metrics"] == row.metrics and set(row.metrics) == {"mean_reward"}
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
    """Progress is synced at most every ``progress_every_s`` and always at the last iteration; each sync
    and each checkpoint writes the run's progress, reward, heartbeat (and checkpoint) to its own job row."""
    monkeypatch.setattr(AdaptationRun, "progress_every_s", 1e9)  # the timer never fires in this test
    synced, saved = [], []
    real_sync, real_save = AdaptationRun._sync, AdaptationRun.save_checkpoint

    def sync(self):
        before = _job_row(ctx, self.job_id).heartbeat_at
        real_sync(self)
        row = _job_row(ctx, self.job_id)
        synced.append(self.iteration)
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
        assert synced == [5] and saved == [2, 4, 5]
    finally:
        ctx.engine.dispose()
