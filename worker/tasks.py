"""Celery tasks: thin wrappers that take a job id (the job's state is in SQL, not in Celery)."""

from __future__ import annotations

import uuid

from app.queue import ADAPT_TASK
from worker.celery_app import celery_app
from worker.context import worker_context, worker_name
from worker.jobs import run_adaptation_job


@celery_app.task(name=ADAPT_TASK, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def adapt_job(job_id: str) -> str:
    """Run (or resume) adaptation job ``job_id``; a no-op for a finished job or one a live worker runs."""
    return run_adaptation_job(worker_context(), uuid.UUID(job_id), worker=worker_name())
