"""The worker's Celery app (``celery -A worker.celery_app worker``), configured from the settings.

Each pool process loads the default bundle once at start; the main process runs the reaper: a round as
soon as the worker is ready (a worker started after another one died takes over its job at once, once the
job's heartbeat is stale), then every ``reaper_interval`` seconds.

A pool process that dies under an adaptation job (the worker itself lives) is noticed by the main process
(``JobRequest``): it expires the job's lease before Celery requeues the message (``task_acks_late`` +
``task_reject_on_worker_lost``), so the redelivered task resumes the job at once instead of being skipped
as owned by a live worker until the heartbeat times out.
"""

from __future__ import annotations

import logging
import socket
import uuid
from typing import Any

import celery.app.trace
from billiard.einfo import ExceptionWithTraceback
from celery.exceptions import WorkerLostError
from celery.signals import worker_init, worker_process_init, worker_ready, worker_shutdown
from celery.worker.request import Request

from app.config import get_settings
from app.queue import ADAPT_TASK, create_celery
from models.allocator import tune_malloc
from worker.context import worker_context
from worker.reaper import Reaper, expire_lease

log = logging.getLogger(__name__)

# A task's return value is not logged with its success: a localize answer or a new set's prototype is data (and
# long), not a log line (Celery formats this line at each success from the module's constant).
celery.app.trace.LOG_SUCCESS = "Task %(name)s[%(id)s] succeeded in %(runtime)ss"


class JobRequest(Request):
    """A task request, in the worker's main process; when the pool process running an adaptation job dies,
    the job's lease is expired first (``worker.reaper.expire_lease``), then Celery requeues the message."""

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        # billiard may report the pool process's exit as SystemExit: lost too, unless the worker stopped it
        lost = isinstance(exc, WorkerLostError) or (isinstance(exc, SystemExit | KeyboardInterrupt) and not (
            getattr(self, "_already_cancelled", False) or getattr(self, "_already_revoked", False)))
        if self.task_name == ADAPT_TASK and lost and self.worker_pid:
            try:  # the name the dead process claimed the job under (``worker.context.worker_name``)
                expire_lease(worker_context(), uuid.UUID(str(self.args[0])),
                             f"{socket.gethostname()}:{self.worker_pid}")
            except Exception:  # the database is down: the reaper takes the job over once its heartbeat is stale
                log.exception("could not expire the lease of task %s's job", self.id)
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)


celery_app = create_celery(get_settings())
celery_app.Task.Request = f"{__name__}:JobRequest"  # every task of this app, before worker.tasks defines them
# How long the pool waits for a result a dead pool process may have sent before reporting it lost (Celery's
# default: 10 s). A job's outcome is in SQL, not in a result: a second is plenty, and the job resumes sooner.
celery_app.conf.worker_lost_wait = 1.0
celery_app.conf.include = ["worker.tasks"]

_reaper: Reaper | None = None


@worker_init.connect
def _tune_allocator(**_: Any) -> None:
    """In the worker's main process, whatever its pool (the localize queue's runs threads): forked pool
    processes inherit the thresholds."""
    if get_settings().tune_malloc:
        tune_malloc()


@worker_process_init.connect
def _load_bundle(**_: Any) -> None:
    ctx = worker_context()
    try:
        ctx.bundles.get(ctx.settings.default_bundle)
    except Exception as e:  # jobs of other bundles can still run; this one fails its jobs with the reason
        log.warning("default bundle %r not loaded: %s", ctx.settings.default_bundle, e)


@worker_ready.connect
def _start_reaper(**_: Any) -> None:
    global _reaper
    _reaper = Reaper(worker_context(),
                     lambda job_id: celery_app.send_task(ADAPT_TASK, args=[str(job_id)], queue=get_settings().queue,
                                                         ignore_result=True))
    _reaper.start()


@worker_shutdown.connect
def _stop_reaper(**_: Any) -> None:
    if _reaper is not None:
        _reaper.stop()
