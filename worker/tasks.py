"""Celery tasks: thin wrappers that take a job id (the job's state is in SQL, not in Celery).

The localize queue's tasks (``QLOC_INFERENCE=workers``, ``worker/localize.py``) are the exception: they
carry the request itself and answer through the result backend.
"""

from __future__ import annotations

import uuid
from typing import Any

from app.queue import ADAPT_TASK
from app.remote import BUNDLE_CHECK_TASK, LOCALIZE_TASK, NEGATIVES_TASK, PROTOTYPE_TASK
from worker import localize as on_worker
from worker.celery_app import celery_app
from worker.context import worker_context, worker_name
from worker.jobs import run_adaptation_job


@celery_app.task(name=ADAPT_TASK, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def adapt_job(job_id: str) -> str:
    """Run (or resume) adaptation job ``job_id``; a no-op for a finished job or one a live worker runs."""
    return run_adaptation_job(worker_context(), uuid.UUID(job_id), worker=worker_name())


# A request's task: its answer goes to the result backend; one lost with its worker is not run again (the
# API has answered 503 by then), hence acknowledged on receipt. Started is recorded (one more write to the result
# backend): the API gives up on a call no worker consumes only while it is still waiting in the queue, and waits for
# one a worker stopping gracefully has started (app.remote.WorkerInference._wait).
_REQUEST = {"ignore_result": False, "acks_late": False, "reject_on_worker_lost": False, "track_started": True}


@celery_app.task(name=LOCALIZE_TASK, **_REQUEST)
def localize(payload: dict[str, Any]) -> dict[str, Any]:
    """Localize a request's images (batched with concurrent requests): the API's ``LocalizeCall``, encoded."""
    return on_worker.localize(worker_context(), payload)


@celery_app.task(name=PROTOTYPE_TASK, **_REQUEST)
def prototype(payload: dict[str, Any]) -> dict[str, Any]:
    """A new exemplar set's prototype from its crops."""
    return on_worker.prototype(worker_context(), payload)


@celery_app.task(name=BUNDLE_CHECK_TASK, **_REQUEST)
def check_bundle(payload: dict[str, Any]) -> dict[str, Any]:
    """Whether a set's bundle file is still the one installed under its name."""
    return on_worker.check_bundle(worker_context(), payload)


@celery_app.task(name=NEGATIVES_TASK, **_REQUEST)
def negatives_confidence(payload: dict[str, Any]) -> dict[str, Any]:
    """The confidences of a set's boxes by its negative exemplars' fit (the boxes embedded here)."""
    return on_worker.negatives_confidence(worker_context(), payload)
