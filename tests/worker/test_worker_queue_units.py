"""``app.queue`` by value, on the real Redis: the message a job becomes, the queues declared, the broker's ping, the
result backend's keys and their expiry, and the Celery options producer and consumer share. The end-to-end job tests
reach it in seconds per run; these pin each piece in milliseconds (``scripts/mutation.py``'s ``queue``)."""

from __future__ import annotations

import sqlite3
import time
import uuid
from pathlib import Path

import pytest
import redis
from service_fixtures import REDIS_URL

from app.config import Settings
from app.queue import ADAPT_TASK, JobQueue, broker_transport_options, create_celery, declare_queues


@pytest.fixture
def on_redis(redis_prefix: str) -> Settings:
    return Settings(broker_url=REDIS_URL, broker_transport_options={"global_keyprefix": redis_prefix},
                    queue=f"jobs-{uuid.uuid4().hex[:8]}")


def next_message(settings: Settings, queue: str):  # noqa: ANN201
    with create_celery(settings).connection_for_read() as conn:
        q = conn.SimpleQueue(queue, no_ack=True)
        try:
            return q.get(timeout=5)
        finally:
            q.close()


def test_a_job_is_one_message_with_its_id_on_the_jobs_queue(on_redis):
    job_id = uuid.uuid4()
    JobQueue(on_redis).enqueue_adaptation(job_id)
    message = next_message(on_redis, on_redis.queue)
    assert message.headers["task"] == ADAPT_TASK == "qloc.adapt"
    assert message.content_type == "application/json"
    args, kwargs, _ = message.decode()
    assert args == [str(job_id)] and kwargs == {}
    assert message.headers["ignore_result"] is True
    assert redis.Redis.from_url(REDIS_URL).llen(f"{on_redis.broker_transport_options['global_keyprefix']}"
                                                f"{on_redis.queue}") == 0  # one message, taken


def queues_on(broker: Path) -> set[str]:
    with sqlite3.connect(broker) as db:
        return {name for (name,) in db.execute("SELECT name FROM kombu_queue")}


def test_ping_is_a_round_trip_that_declares_the_jobs_queue_and_fails_fast_without_a_broker(on_redis, tmp_path):
    JobQueue(on_redis).ping()  # Redis answers
    broker = tmp_path / "broker.db"
    JobQueue(Settings(broker_url=f"sqla+sqlite:///{broker}", queue="only-this")).ping()
    assert queues_on(broker) == {"only-this"}  # the SQLAlchemy transport keeps what was declared
    start = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017, PT011 -- kombu's or redis's connection error
        JobQueue(Settings(broker_url="redis://127.0.0.1:1/0")).ping()
    assert time.monotonic() - start < 15  # one retry, a 3 s timeout: a readiness check does not hang


def test_the_queues_declared_are_the_modes(tmp_path):
    broker = tmp_path / "broker.db"
    local = Settings(broker_url=f"sqla+sqlite:///{broker}", queue="jobs")
    assert declare_queues(local) == ["jobs"] and queues_on(broker) == {"jobs"}
    workers = local.model_copy(update={"inference": "workers", "result_backend": "redis://h:1/0",
                                       "localize_queue": "calls"})
    assert declare_queues(workers) == ["jobs", "calls"] and queues_on(broker) == {"jobs", "calls"}


def test_the_shared_options_by_value():
    app = create_celery(Settings(broker_url="redis://h:6379/0"))
    conf = app.conf
    assert app.main == "qloc" and conf.broker_url == "redis://h:6379/0"
    assert (conf.task_serializer, conf.accept_content) == ("json", ["json"])
    assert conf.broker_connection_retry_on_startup is True and conf.broker_connection_timeout == 5
    assert conf.task_publish_retry_policy == {"max_retries": 2, "interval_start": 0, "interval_step": 0.5,
                                              "interval_max": 1}  # a down broker answers the API in ~1.5 s
    assert conf.worker_send_task_events is False and conf.worker_hijack_root_logger is False
    assert conf.broker_transport_options == {"visibility_timeout": 3660 + 600}
    assert not conf.result_backend  # no result backend without inference=workers


def test_a_new_app_is_never_celerys_current_one():
    from celery import current_app

    before = current_app._get_current_object()
    app = create_celery(Settings())
    assert current_app._get_current_object() is before and app is not before


def test_the_result_backend_keeps_each_answer_under_the_prefix_until_the_api_gave_up(redis_prefix):
    s = Settings(broker_url=REDIS_URL, inference="workers", result_backend=REDIS_URL, localize_timeout=40,
                 set_timeout=100, broker_transport_options={"global_keyprefix": redis_prefix, "other_option": 1})
    app = create_celery(s)
    assert (app.conf.result_serializer, app.conf.result_accept_content) == ("json", ["json"])
    assert app.conf.result_backend_transport_options == {"global_keyprefix": redis_prefix}  # the broker's others: not
    task_id = str(uuid.uuid4())
    app.backend.store_result(task_id, {"boxes": [[1, 2, 3, 4]]}, "SUCCESS")
    client = redis.Redis.from_url(REDIS_URL)
    key = f"{redis_prefix}celery-task-meta-{task_id}"
    assert client.exists(key)
    assert 100 + 300 - 5 <= client.ttl(key) <= 100 + 300  # the longer wait, and five minutes more
    assert app.AsyncResult(task_id).get(timeout=5) == {"boxes": [[1, 2, 3, 4]]}


@pytest.mark.parametrize(("url", "expected"), [
    ("rediss://h:6380/0", {"visibility_timeout": 4260}),
    ("redis://h:6379/0", {"visibility_timeout": 4260}),
    ("sqla+sqlite:///var/b.db", {"connect_args": {"timeout": 30}}),
    ("sqlalchemy+sqlite:///var/b.db", {"connect_args": {"timeout": 30}}),
    ("sqla+postgresql://h/db", {}),
    ("amqp://h//", {}),
])
def test_broker_options_by_scheme(url, expected):
    assert broker_transport_options(Settings(broker_url=url)) == expected
