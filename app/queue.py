"""The Celery configuration, built from the one settings object, and the API's side of the queue.

The worker builds its Celery app with ``create_celery`` too, so producer and consumer agree on the
queue, serializer, time limits and broker options. Tasks carry a job id only: the job's state lives
in SQL (Celery's own task states are never shown to clients).
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from app.config import Settings

ADAPT_TASK = "qloc.adapt"


def broker_transport_options(settings: Settings) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    scheme = settings.broker_url.split("://", 1)[0]
    if scheme in ("redis", "rediss"):
        # Redis redelivers an unacknowledged task after the visibility timeout: it must be longer
        # than the longest job, or a running job would be handed to a second worker.
        opts["visibility_timeout"] = settings.broker_visibility_timeout
    elif scheme.startswith(("sqla+", "sqlalchemy+")) and "sqlite" in scheme:
        # Passed to create_engine by kombu: wait for the other process' lock instead of failing.
        opts["connect_args"] = {"timeout": 30}
    opts.update(settings.broker_transport_options)
    return opts


def create_celery(settings: Settings) -> Celery:
    app = Celery("qloc", broker=settings.broker_url, set_as_current=False)
    app.conf.update(
        task_default_queue=settings.queue,
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        # A job is idempotent by id (it resumes from its last checkpoint), so it may run again:
        # acknowledge only when done, requeue when the worker process dies, take one at a time.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_soft_time_limit=settings.job_soft_time_limit,
        task_time_limit=settings.job_time_limit,
        worker_concurrency=settings.worker_concurrency,
        broker_transport_options=broker_transport_options(settings),
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=5,
        task_publish_retry_policy={"max_retries": 2, "interval_start": 0, "interval_step": 0.5, "interval_max": 1},
        worker_send_task_events=False,
        worker_hijack_root_logger=False,
        # After a broker reconnect Celery restores the prefetch count without the task running, so a busy
        # worker reserved the next job's message and sat on it while an idle worker waited (an outside test: 64-117
        # s). Without prefetch a worker takes a message only when a process is free (Celery supports it on Redis).
        worker_disable_prefetch=settings.broker_url.startswith(("redis://", "rediss://")),
        # A broker blip must not cancel the running jobs (Celery 6's default would): the run keeps its lease
        # and checkpoints, and a redelivered message of it is skipped (``claim_job`` is conditional).
        worker_cancel_long_running_tasks_on_connection_loss=False,
    )
    if settings.result_backend:  # QLOC_INFERENCE=workers: the localize tasks answer through it (app/remote.py)
        app.conf.update(
            result_backend=settings.result_backend, result_serializer="json", result_accept_content=["json"],
            # an answer nobody read (the API gave up) expires
            result_expires=int(max(settings.localize_timeout, settings.set_timeout)) + 300,
            result_backend_transport_options={k: v for k, v in settings.broker_transport_options.items()
                                              if k == "global_keyprefix"})
    return app


def declare_queues(settings: Settings) -> list[str]:
    """Create the job queue (and, with ``inference=workers``, the localize queue) on the broker -> their names.
    Idempotent. ``scripts/run migrate`` runs it (``python -m app.queue``) before the API and the worker start: on
    a fresh SQLAlchemy broker (the embedded default) both would otherwise insert the queue's row at once, and the
    loser -- the worker's consumer, seen in CI -- stops with ``UNIQUE constraint failed: kombu_queue.name``,
    leaving every job queued."""
    names = [settings.queue] + ([settings.localize_queue] if settings.inference == "workers" else [])
    with create_celery(settings).connection_for_write() as conn:
        conn.ensure_connection(max_retries=3)
        for name in names:
            conn.default_channel.queue_declare(queue=name, durable=True, auto_delete=False)
    return names


class JobQueue:
    """What the API needs from the broker: enqueue a job id, check the broker is reachable."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.celery = create_celery(settings)

    def enqueue_adaptation(self, job_id: object) -> None:
        self.celery.send_task(ADAPT_TASK, args=[str(job_id)], queue=self.settings.queue, ignore_result=True)

    def ping(self) -> None:
        """Raise unless the broker answers (a real round trip: the queue's length)."""
        with self.celery.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=3)
            conn.default_channel.queue_declare(queue=self.settings.queue, durable=True, auto_delete=False)


if __name__ == "__main__":  # python -m app.queue: the broker side of ``scripts/run migrate``
    print("declared broker queues: " + ", ".join(declare_queues(Settings())))
