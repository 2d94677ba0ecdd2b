"""The Celery side: one configuration from the settings, a thin task that takes a job id."""

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from app.config import Settings
from app.queue import ADAPT_TASK, broker_transport_options, create_celery, declare_queues

REPO = Path(__file__).resolve().parents[2]


def test_configuration_from_settings():
    s = Settings(job_soft_time_limit=100, job_time_limit=130, queue="q1", worker_concurrency=2)
    conf = create_celery(s).conf
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1
    assert (conf.task_soft_time_limit, conf.task_time_limit) == (100, 130)
    assert conf.task_default_queue == "q1" and conf.worker_concurrency == 2
    assert conf.task_ignore_result and conf.accept_content == ["json"]


def test_a_busy_worker_takes_no_second_message_and_a_broker_blip_cancels_no_job():
    """On Redis, prefetch is off (after a reconnect Celery's prefetch count forgot the running task, and a busy worker
    reserved the next job while an idle one waited); on the SQLAlchemy transport Celery does not support it (it
    would only warn). Running jobs survive a lost broker connection in every case."""
    from app.queue import create_celery

    for url, off in (("redis://h:6379/0", True), ("rediss://h:6380/0", True), ("sqla+sqlite:////tmp/b.db", False)):
        conf = create_celery(Settings(broker_url=url)).conf
        assert conf.worker_disable_prefetch is off and conf.worker_prefetch_multiplier == 1
        assert conf.worker_cancel_long_running_tasks_on_connection_loss is False


def test_broker_options():
    redis = Settings(broker_url="redis://h:6379/0", job_soft_time_limit=100, job_time_limit=3600,
                     broker_transport_options={"global_keyprefix": "p:"})
    opts = broker_transport_options(redis)
    assert opts["visibility_timeout"] > 3600  # longer than the longest job
    assert opts["global_keyprefix"] == "p:"
    sqlite = broker_transport_options(Settings())
    assert sqlite == {"connect_args": {"timeout": 30}} and "visibility_timeout" not in sqlite
    assert broker_transport_options(Settings(broker_url="sqla+postgresql://h/db")) == {}


def test_the_queues_are_declared_before_api_and_worker_start(tmp_path):
    """``scripts/run migrate`` (``python -m app.queue``) creates the queue on a fresh SQLAlchemy broker, once: the API
    and the worker then find it instead of both inserting it (the loser, a worker, stopped with a UNIQUE error)."""
    broker = tmp_path / "broker.db"
    env = {**os.environ, "QLOC_BROKER_URL": f"sqla+sqlite:///{broker}"}
    for _ in range(2):  # idempotent
        r = subprocess.run([sys.executable, "-m", "app.queue"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and "declared broker queues: qloc" in r.stdout, r.stderr
    with sqlite3.connect(broker) as db:
        assert db.execute("SELECT name FROM kombu_queue").fetchall() == [("qloc",)]
    workers = Settings(broker_url=f"sqla+sqlite:///{broker}", inference="workers", result_backend="redis://h:1/0")
    assert declare_queues(workers) == ["qloc", "qloc-localize"]
    assert "python\" -m app.queue" in (REPO / "scripts" / "run").read_text()  # the migrate step runs it


def test_the_task_is_thin_and_safe_to_redeliver():
    from worker.celery_app import celery_app
    from worker.tasks import adapt_job

    task = celery_app.tasks[ADAPT_TASK]
    assert task.run is adapt_job.run
    assert task.acks_late and task.reject_on_worker_lost and task.ignore_result


def test_a_lost_pool_process_expires_its_jobs_lease():
    """The adaptation task's requests are ``JobRequest``: the worker's main process expires the lease of a job
    whose pool process died before Celery requeues the message (acks late, reject on worker lost)."""
    from celery.utils.imports import symbol_by_name

    from worker.celery_app import JobRequest, celery_app

    task = celery_app.tasks[ADAPT_TASK]
    assert symbol_by_name(task.Request) is JobRequest
    assert celery_app.conf.worker_lost_wait <= 2  # Celery's default (10 s) would delay the resume by as much
    assert task.acks_late and task.reject_on_worker_lost


def test_recovery_timings():
    s = Settings()
    assert (s.heartbeat_interval, s.heartbeat_timeout, s.reaper_interval) == (2.0, 10.0, 2.0)
    with pytest.raises(ValueError, match="at least twice heartbeat_interval"):
        Settings(heartbeat_interval=5.0, heartbeat_timeout=9.0)
