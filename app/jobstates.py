"""The adaptation job's state machine: every write of ``adaptation_jobs.status``. The states are declared
once, with the schema's CHECK constraint, in ``app.tables`` (``JobState``) and re-exported here.

A job is created ``queued`` (the column's default) and ends ``succeeded``, ``failed`` or ``canceled``.
Each transition is one conditional UPDATE whose WHERE clause is its guard, and returns whether it
applied: a caller that lost a race (another worker, a reaper, the user) changes nothing and is told so.

=====================  ======================  ==================================================================
transition             function                guard
=====================  ======================  ==================================================================
queued → running       ``claim``               ``queued``, or ``running`` with a heartbeat older than
                                               ``stale_before`` (a new run takes over a dead worker's)
running → succeeded    ``finish_run``          the run's lease: ``running`` with ``attempts`` = its fencing token
running → canceled     ``finish_run``          the run's lease (the run stopped because of ``flag_cancel``)
running → failed       ``fail_run``            the run's lease
running → queued       ``requeue_abandoned``   ``running``, ``attempts`` as the reaper read it, heartbeat still
                                               older than ``stale_before``
running → failed       ``fail_abandoned``      as ``requeue_abandoned`` (the job's last allowed attempt)
queued → canceled      ``cancel_queued``       ``queued``
queued → failed        ``fail_unsent``         ``queued`` and ``enqueued_at`` NULL (no send of its task is known)
(running, cancel flag) ``flag_cancel``         ``running``; the run finishes ``canceled`` at its next check
=====================  ======================  ==================================================================

A succeeded job also moves its set's active checkpoint (``activate_job_result``), only where the set
still has the job's base checkpoint active: an activation made while the job ran (a rollback) stands.
The functions take the caller's session and leave the transaction to it.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, func, literal, or_, select, update
from sqlalchemy.orm import Session

from app import tables
from app.tables import FINISHED_STATES, JOB_STATES, JobState  # noqa: F401 -- the states, re-exported


def _applied(result: Any) -> bool:
    return result.rowcount == 1


def lease_held(job_id: uuid.UUID, attempt: int) -> ColumnElement[bool]:
    """The guard of every write of a run: the job is ``running`` under the run's fencing token ``attempt``."""
    job = tables.AdaptationJob
    return and_(job.id == job_id, job.attempts == attempt, job.status == JobState.RUNNING)


def _abandoned(job_id: uuid.UUID, attempt: int, stale_before: datetime) -> ColumnElement[bool]:
    job = tables.AdaptationJob
    return and_(job.id == job_id, job.status == JobState.RUNNING, job.attempts == attempt,
                or_(job.heartbeat_at < stale_before, job.heartbeat_at.is_(None)))


# --- the worker's run


def claim(session: Session, *, job_id: uuid.UUID, worker: str, stale_before: datetime,
          now: datetime | None = None) -> int | None:
    """queued → running, or take over a running job whose heartbeat is older than ``stale_before``
    -> the new run's fencing token (``attempts`` + 1), or None when the job is not claimable."""
    job = tables.AdaptationJob
    now = now or tables.utcnow()
    res = session.execute(
        update(job)
        .where(job.id == job_id,
               or_(job.status == JobState.QUEUED,
                   and_(job.status == JobState.RUNNING, job.heartbeat_at < stale_before)))
        .values(status=JobState.RUNNING, phase="setup", attempts=job.attempts + 1, worker=worker, heartbeat_at=now,
                started_at=func.coalesce(job.started_at, literal(now, tables.UTCDateTime()))))
    if not _applied(res):
        return None
    return session.scalar(select(job.attempts).where(job.id == job_id))


def finish_run(session: Session, *, job_id: uuid.UUID, attempt: int, outcome: JobState, progress_iteration: int,
               mean_reward: float | None, checkpoint_id: uuid.UUID | None = None, error: str | None = None,
               verdict: str | None = None, validation: dict[str, Any] | None = None,
               now: datetime | None = None) -> bool:
    """running → ``outcome`` (succeeded, or canceled on request), with the run's last progress and
    checkpoint (``checkpoint_id`` None keeps the row's) and the guard's ``verdict`` / ``validation`` ->
    False when the run no longer holds the lease."""
    if outcome not in (JobState.SUCCEEDED, JobState.CANCELED):
        raise ValueError(f"a run finishes succeeded or canceled (fail_run fails it), not {outcome!r}")
    now = now or tables.utcnow()
    values: dict[str, Any] = {"status": outcome, "finished_at": now, "heartbeat_at": now, "error": error,
                              "progress_iteration": progress_iteration, "mean_reward": mean_reward, "phase": None}
    if checkpoint_id is not None:
        values["checkpoint_id"] = checkpoint_id
    if verdict is not None:
        values["verdict"], values["validation"] = verdict, validation
    return _applied(session.execute(update(tables.AdaptationJob).where(lease_held(job_id, attempt)).values(**values)))


def fail_run(session: Session, *, job_id: uuid.UUID, attempt: int, error: str, now: datetime | None = None) -> bool:
    """running → failed with ``error`` (its first 2000 characters) -> False when the run no longer holds the lease."""
    return _applied(session.execute(update(tables.AdaptationJob).where(lease_held(job_id, attempt)).values(
        status=JobState.FAILED, error=error[:2000], finished_at=now or tables.utcnow(), phase=None)))


def activate_job_result(session: Session, *, set_id: uuid.UUID, checkpoint_id: uuid.UUID,
                        base_checkpoint_id: uuid.UUID | None) -> bool:
    """Make a finished job's checkpoint the set's active one, unless the active pointer moved while the
    job ran (it no longer holds ``base_checkpoint_id``, the job's starting point) -> whether it moved it."""
    es = tables.ExemplarSet
    return _applied(session.execute(
        update(es).where(es.id == set_id, es.active_checkpoint_id.is_not_distinct_from(base_checkpoint_id))
        .values(active_checkpoint_id=checkpoint_id)))


# --- the API


CANCELED_ON_REQUEST = "canceled on request"
"""A canceled job's ``error``, queued or running when it was asked."""


def fail_unsent(session: Session, *, job_id: uuid.UUID, error: str, now: datetime | None = None) -> bool:
    """queued → failed, for a job whose task could not be sent -> False when a reaper has sent it meanwhile. The
    request was answered 503 ("retry later"): its ``Idempotency-Key`` is freed, so the retry with the same key
    makes the job (it answered with this failed one before)."""
    job = tables.AdaptationJob
    return _applied(session.execute(
        update(job).where(job.id == job_id, job.status == JobState.QUEUED, job.enqueued_at.is_(None))
        .values(status=JobState.FAILED, error=error, finished_at=now or tables.utcnow(), idempotency_key=None)))


def cancel_queued(session: Session, *, job_id: uuid.UUID, now: datetime | None = None) -> bool:
    """queued → canceled at once -> False when the job is not queued."""
    job = tables.AdaptationJob
    return _applied(session.execute(
        update(job).where(job.id == job_id, job.status == JobState.QUEUED)
        .values(status=JobState.CANCELED, cancel_requested=True, error=CANCELED_ON_REQUEST,
                finished_at=now or tables.utcnow())))


def flag_cancel(session: Session, *, job_id: uuid.UUID) -> bool:
    """Ask a running job to stop (its run finishes it ``canceled`` at its next check) -> False when not running."""
    job = tables.AdaptationJob
    return _applied(session.execute(
        update(job).where(job.id == job_id, job.status == JobState.RUNNING).values(cancel_requested=True)))


def request_cancel(session: Session, *, job_id: uuid.UUID) -> bool:
    """Cancel a queued job at once, flag a running one -> False when the job had already finished."""
    return cancel_queued(session, job_id=job_id) or flag_cancel(session, job_id=job_id)


# --- the reaper


def requeue_abandoned(session: Session, *, job_id: uuid.UUID, attempt: int, stale_before: datetime) -> bool:
    """running → queued, for a run whose worker stopped beating (``enqueued_at`` NULL: its task is to be sent)
    -> False when the run moved on since the reaper read ``attempt`` (finished, claimed, or beating again)."""
    return _applied(session.execute(update(tables.AdaptationJob).where(_abandoned(job_id, attempt, stale_before))
                                    .values(status=JobState.QUEUED, worker=None, enqueued_at=None, phase=None)))


def cancel_abandoned(session: Session, *, job_id: uuid.UUID, attempt: int, stale_before: datetime,
                     now: datetime | None = None) -> bool:
    """running → canceled, for a run whose worker stopped beating after its cancel was asked: it is not resumed
    only to be canceled there (nor kept queued while no worker runs) -> as ``requeue_abandoned``."""
    return _applied(session.execute(update(tables.AdaptationJob).where(
        _abandoned(job_id, attempt, stale_before), tables.AdaptationJob.cancel_requested.is_(True))
        .values(status=JobState.CANCELED, error=CANCELED_ON_REQUEST, finished_at=now or tables.utcnow(),
                phase=None)))


def fail_abandoned(session: Session, *, job_id: uuid.UUID, attempt: int, stale_before: datetime, error: str,
                   now: datetime | None = None) -> bool:
    """running → failed, for a run whose worker stopped beating once too often -> as ``requeue_abandoned``."""
    return _applied(session.execute(update(tables.AdaptationJob).where(_abandoned(job_id, attempt, stale_before))
                                    .values(status=JobState.FAILED, error=error, finished_at=now or tables.utcnow(),
                                            phase=None)))
