"""The reaper: running jobs whose heartbeat stopped belong to a dead worker; requeue or fail them.

A job abandoned fewer than ``max_job_attempts`` times goes back to ``queued`` and its task is sent
again (the next run resumes from the job's latest checkpoint); after that it is marked ``failed``.
Each change is a conditional update on the job's fencing token, so concurrent reapers (one per
worker) cannot both act on the same job.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import or_, select, update

from app.tables import AdaptationJob, utcnow
from worker.context import WorkerContext

log = logging.getLogger(__name__)


def reap_abandoned_jobs(ctx: WorkerContext, *, now: datetime | None = None) -> tuple[list[uuid.UUID], list[uuid.UUID]]:
    """-> (job ids put back in ``queued``: send their tasks; job ids marked ``failed``)."""
    now = now or utcnow()
    stale = now - timedelta(seconds=ctx.settings.heartbeat_timeout)
    requeued, failed = [], []
    with ctx.session_factory.begin() as s:
        rows = s.execute(select(AdaptationJob.id, AdaptationJob.attempts).where(
            AdaptationJob.status == "running",
            or_(AdaptationJob.heartbeat_at < stale, AdaptationJob.heartbeat_at.is_(None)))).all()
        for job_id, attempts in rows:
            same_run = (AdaptationJob.id == job_id, AdaptationJob.status == "running",
                        AdaptationJob.attempts == attempts)
            if attempts >= ctx.settings.max_job_attempts:
                res = s.execute(update(AdaptationJob).where(*same_run).values(
                    status="failed", finished_at=now,
                    error=f"worker lost {attempts} times (no heartbeat for {ctx.settings.heartbeat_timeout:g} s)"))
                if res.rowcount:  # type: ignore[attr-defined]
                    failed.append(job_id)
            else:
                res = s.execute(update(AdaptationJob).where(*same_run).values(status="queued", worker=None))
                if res.rowcount:  # type: ignore[attr-defined]
                    requeued.append(job_id)
    for job_id in requeued:
        log.warning("job %s: its worker stopped beating; requeued to resume from its last checkpoint", job_id)
    for job_id in failed:
        log.error("job %s: abandoned too often; marked failed", job_id)
    return requeued, failed


class Reaper:
    """Runs ``reap_abandoned_jobs`` every ``reaper_interval`` seconds in a thread; sends requeued jobs."""

    def __init__(self, ctx: WorkerContext, send: Callable[[uuid.UUID], None]):
        self.ctx, self.send = ctx, send
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="qloc-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def run_once(self) -> None:
        requeued, _ = reap_abandoned_jobs(self.ctx)
        for job_id in requeued:
            self.send(job_id)

    def _loop(self) -> None:
        while True:
            try:
                self.run_once()
            except Exception:  # the database or broker is down: try again next round
                log.exception("reaper round failed")
            if self._stop.wait(self.ctx.settings.reaper_interval):
                return
