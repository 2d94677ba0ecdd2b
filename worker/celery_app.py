"""The worker's Celery app (``celery -A worker.celery_app worker``), configured from the settings.

Each pool process loads the default bundle once at start; the main process runs the reaper.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import worker_process_init, worker_ready, worker_shutdown

from app.config import get_settings
from app.queue import ADAPT_TASK, create_celery
from worker.context import worker_context
from worker.reaper import Reaper

log = logging.getLogger(__name__)

celery_app = create_celery(get_settings())
celery_app.conf.include = ["worker.tasks"]

_reaper: Reaper | None = None


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
                     lambda job_id: celery_app.send_task(ADAPT_TASK, args=[str(job_id)], queue=get_settings().queue))
    _reaper.start()


@worker_shutdown.connect
def _stop_reaper(**_: Any) -> None:
    if _reaper is not None:
        _reaper.stop()
