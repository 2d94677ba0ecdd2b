"""The Celery side: one configuration from the settings, a thin task that takes a job id."""

from app.config import Settings
from app.queue import ADAPT_TASK, broker_transport_options, create_celery


def test_configuration_from_settings():
    s = Settings(job_soft_time_limit=100, job_time_limit=130, queue="q1", worker_concurrency=2)
    conf = create_celery(s).conf
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1
    assert (conf.task_soft_time_limit, conf.task_time_limit) == (100, 130)
    assert conf.task_default_queue == "q1" and conf.worker_concurrency == 2
    assert conf.task_ignore_result and conf.accept_content == ["json"]


def test_broker_options():
    redis = Settings(broker_url="redis://h:6379/0", job_soft_time_limit=100, job_time_limit=3600,
                     broker_transport_options={"global_keyprefix": "p:"})
    opts = broker_transport_options(redis)
    assert opts["visibility_timeout"] > 3600  # longer than the longest job
    assert opts["global_keyprefix"] == "p:"
    sqlite = broker_transport_options(Settings())
    assert sqlite == {"connect_args": {"timeout": 30}} and "visibility_timeout" not in sqlite
    assert broker_transport_options(Settings(broker_url="sqla+postgresql://h/db")) == {}


def test_the_task_is_thin_and_safe_to_redeliver():
    from worker.celery_app import celery_app
    from worker.tasks import adapt_job

    task = celery_app.tasks[ADAPT_TASK]
    assert task.run is adapt_job.run
    assert task.acks_late and task.reject_on_worker_lost and task.ignore_result
