"""The reaper: no job is left running without a worker, nor queued without a task message.

Running jobs whose heartbeat stopped belong to a dead worker: a job whose cancel was asked is marked
``canceled``; one abandoned fewer than ``max_job_attempts`` times goes back to ``queued`` (the next run
resumes from its latest checkpoint), after that it is marked ``failed``.

Queued jobs are an outbox: ``enqueued_at`` records the last send of the job's task. The reaper sends

- a job requeued above (it is written ``queued`` with ``enqueued_at`` NULL first, so a send that fails
  is retried at the next round);
- a job with ``enqueued_at`` NULL older than ``enqueue_grace`` (the API died between committing the job
  and sending it, or an earlier send failed);
- a job whose last send is older than ``requeue_after`` (the broker lost the message).

Each change is a conditional update, so concurrent reapers (one per worker) never both act on a job:
a requeue or failure (``app.jobstates``) is conditional on the job's fencing token and on its heartbeat
being still stale, and a send is claimed first by stamping ``enqueued_at`` where it still holds the
value this reaper read; only the reaper whose stamp landed sends, and it clears its stamp again when
the send fails. A reaper dying between its stamp and its send delays the job by ``requeue_after``.
A duplicate message is harmless: ``claim_job`` is conditional.

A worker whose pool process died under a job (``kill -9``, the OOM killer) while the worker itself lives
need not wait for the heartbeat to go stale: its main process knows which process ran which job, and
``expire_lease`` makes that job claimable at once (``worker.celery_app``), before Celery requeues its message.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import and_, or_, select, update

from app import jobstates
from app.jobstates import JobState
from app.storage import job_prefix
from app.tables import FINISHED_STATES, AdaptationJob, JobImage, utcnow
from worker.context import WorkerContext

log = logging.getLogger(__name__)


def reap_abandoned_jobs(ctx: WorkerContext, *, now: datetime | None = None) -> tuple[list[uuid.UUID], list[uuid.UUID]]:
    """-> (job ids put back in ``queued`` with ``enqueued_at`` NULL: send their tasks; job ids marked ``failed``)."""
    now = now or utcnow()
    stale = now - timedelta(seconds=ctx.settings.heartbeat_timeout)
    requeued, failed, canceled = [], [], []
    with ctx.session_factory.begin() as s:
        rows = s.execute(select(AdaptationJob.id, AdaptationJob.attempts, AdaptationJob.cancel_requested).where(
            AdaptationJob.status == JobState.RUNNING,
            or_(AdaptationJob.heartbeat_at < stale, AdaptationJob.heartbeat_at.is_(None)))).all()
        for job_id, attempts, cancel in rows:
            if cancel:
                if jobstates.cancel_abandoned(s, job_id=job_id, attempt=attempts, stale_before=stale, now=now):
                    canceled.append(job_id)
            elif attempts >= ctx.settings.max_job_attempts:
                error = f"worker lost {attempts} times (no heartbeat for {ctx.settings.heartbeat_timeout:g} s)"
                if jobstates.fail_abandoned(s, job_id=job_id, attempt=attempts, stale_before=stale, error=error,
                                            now=now):
                    failed.append(job_id)
            elif jobstates.requeue_abandoned(s, job_id=job_id, attempt=attempts, stale_before=stale):
                requeued.append(job_id)
    for job_id in requeued:
        log.warning("job %s: its worker stopped beating; requeued to resume from its last checkpoint", job_id)
    for job_id in failed:
        log.error("job %s: abandoned too often; marked failed", job_id)
    for job_id in canceled:
        log.warning("job %s: its worker stopped beating after its cancel was asked; canceled", job_id)
    return requeued, failed


UPLOADS_SWEEP_S = 30.0
"""Seconds between a reaper's sweeps of finished jobs' uploads (``drop_finished_uploads``)."""


def drop_finished_uploads(ctx: WorkerContext, *, limit: int = 512) -> int:
    """Delete the files finished jobs were posted with -> how many. A finished job never runs again (a retried
    creation answers with the same job), so the copies of its own uploads only took storage; the images it took
    from the set's pool are the pool's and stay. Its ``job_images`` rows keep each image's name, size and hash,
    their ``blob`` emptied first (committed), then the files go: a crash between leaves a file, never a row
    naming a missing one."""
    with ctx.session_factory() as s:
        rows = s.execute(select(JobImage.id, JobImage.blob, AdaptationJob.exemplar_set_id, AdaptationJob.id)
                         .join(AdaptationJob, AdaptationJob.id == JobImage.job_id)
                         .where(AdaptationJob.status.in_(FINISHED_STATES), JobImage.pool_image_id.is_(None),
                                JobImage.blob != "").limit(limit)).all()
    if not rows:
        return 0
    with ctx.session_factory.begin() as s:
        s.execute(update(JobImage).where(JobImage.id.in_([r[0] for r in rows]), JobImage.pool_image_id.is_(None))
                  .values(blob="").execution_options(synchronize_session=False))
    for _, blob, _, _ in rows:
        ctx.store.delete(blob)
    for set_id, job_id in {(r[2], r[3]) for r in rows}:
        folder = ctx.store.path(job_prefix(set_id, job_id) + "/images")
        with contextlib.suppress(OSError):  # gone, or not empty (a row of a later round): left to that round
            folder.rmdir()
    return len(rows)


def expire_lease(ctx: WorkerContext, job_id: uuid.UUID, worker: str, *, now: datetime | None = None) -> bool:
    """The process named ``worker`` (``host:pid``, as ``claim_job`` records it) died running ``job_id``: date the
    job's heartbeat a day back, so that the next claim or reaper round takes the job over at once -> whether
    the job was still running under that process (a job claimed by another run since is left alone)."""
    now = now or utcnow()
    with ctx.session_factory.begin() as s:
        res = s.execute(update(AdaptationJob).where(AdaptationJob.id == job_id,
                                                    AdaptationJob.status == JobState.RUNNING,
                                                    AdaptationJob.worker == worker)
                        .values(heartbeat_at=now - timedelta(days=1)))
    expired = res.rowcount == 1  # type: ignore[attr-defined]
    if expired:
        log.warning("job %s: its process %s died; lease expired, the job resumes from its last checkpoint",
                    job_id, worker)
    return expired


def jobs_to_send(ctx: WorkerContext, *, now: datetime | None = None) -> list[tuple[uuid.UUID, datetime | None]]:
    """Queued jobs whose task must be sent -> (job id, its ``enqueued_at`` as read: the send's precondition).

    Never confirmed sent and older than ``enqueue_grace``, or last sent longer than ``requeue_after`` ago.
    """
    now = now or utcnow()
    unsent_before = now - timedelta(seconds=ctx.settings.enqueue_grace)
    resend_before = now - timedelta(seconds=ctx.settings.requeue_after)
    with ctx.session_factory() as s:
        rows = s.execute(select(AdaptationJob.id, AdaptationJob.enqueued_at).where(
            AdaptationJob.status == JobState.QUEUED,
            or_(and_(AdaptationJob.enqueued_at.is_(None), AdaptationJob.created_at < unsent_before),
                AdaptationJob.enqueued_at < resend_before))
            .order_by(AdaptationJob.created_at)).all()
    return [(job_id, enqueued_at) for job_id, enqueued_at in rows]


def send_job(ctx: WorkerContext, job_id: uuid.UUID, send: Callable[[uuid.UUID], None], *,
             read: datetime | None, now: datetime | None = None) -> bool:
    """Send a queued job's task unless another reaper did since ``enqueued_at`` was ``read`` -> whether sent.

    Stamp first (conditional on the value read: at most one reaper wins), then send; a failed send
    clears the stamp (NULL: the next round retries) and raises.
    """
    now = now or utcnow()
    unchanged = AdaptationJob.enqueued_at.is_(None) if read is None else AdaptationJob.enqueued_at == read
    with ctx.session_factory.begin() as s:
        res = s.execute(update(AdaptationJob).where(AdaptationJob.id == job_id,
                                                    AdaptationJob.status == JobState.QUEUED, unchanged)
                        .values(enqueued_at=now))
        if res.rowcount != 1:  # type: ignore[attr-defined]
            return False
    try:
        send(job_id)
    except BaseException:
        with ctx.session_factory.begin() as s:
            s.execute(update(AdaptationJob).where(AdaptationJob.id == job_id, AdaptationJob.enqueued_at == now)
                      .values(enqueued_at=None))
        raise
    return True


class Reaper:
    """Runs a reaper round every ``reaper_interval`` seconds in a thread, sending tasks with ``send``."""

    def __init__(self, ctx: WorkerContext, send: Callable[[uuid.UUID], None]):
        self.ctx, self.send = ctx, send
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="qloc-reaper", daemon=True)
        self._swept = -math.inf  # the first round sweeps finished jobs' uploads

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def run_once(self, *, now: datetime | None = None) -> list[uuid.UUID]:
        """One round: requeue or fail abandoned jobs, send every job due, delete finished jobs' uploads -> the job
        ids sent."""
        now = now or utcnow()
        requeued, _ = reap_abandoned_jobs(self.ctx, now=now)
        due: dict[uuid.UUID, datetime | None] = dict.fromkeys(requeued)
        due.update(jobs_to_send(self.ctx, now=now))
        sent = []
        for job_id, read in due.items():
            try:
                if send_job(self.ctx, job_id, self.send, read=read, now=now):
                    sent.append(job_id)
            except Exception:  # the broker (or database) is down: this job is sent again next round
                log.exception("reaper: could not send job %s", job_id)
        for job_id in sent:
            if job_id in requeued:
                continue
            if due[job_id] is None:
                log.warning("job %s: queued, its task never confirmed sent; sent it", job_id)
            else:
                log.warning("job %s: still queued %g s after its task was sent (its message lost, or every worker "
                            "busy); sent it again (a duplicate is harmless)", job_id, self.ctx.settings.requeue_after)
        if time.monotonic() - self._swept >= UPLOADS_SWEEP_S:  # a scan of the job images: not every round
            self._swept = time.monotonic()
            try:
                drop_finished_uploads(self.ctx)
            except Exception:  # storage or database trouble: the next sweep tries again
                log.exception("reaper: could not delete finished jobs' uploads")
        return sent

    def _loop(self) -> None:
        while True:
            try:
                self.run_once()
            except Exception:  # the database is down: try again next round
                log.exception("reaper round failed")
            if self._stop.wait(self.ctx.settings.reaper_interval):
                return
