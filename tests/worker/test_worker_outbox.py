"""No job is stranded in ``queued``: the job row is the outbox of its task message.

The API commits a job with ``enqueued_at`` NULL, sends its task, then stamps it; the reaper sends a
job whose send was never confirmed (after ``enqueue_grace``), sends again one still queued long after
its last send (``requeue_after``: the broker lost it), and requeues an abandoned running job with
``enqueued_at`` NULL, so that a send that fails is retried at the next round.

The fault cases run against a real Celery worker and broker and each ends with the job run once:
the API dying between commit and send, the broker losing the message, the reaper's send failing.
"""

import threading
import time
import uuid
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from kombu import Connection
from service_fixtures import (
    LIVE_WORKER,
    REDIS_URL,
    Stack,
    at_once,
    files,
    make_test_settings,
    migrate,
    png_bytes,
    register_set,
    wait_for_job_row,
)
from sqlalchemy import select, update

from app.main import create_app
from app.queue import JobQueue, broker_transport_options
from app.tables import AdaptationJob, Checkpoint, utcnow
from worker import jobs
from worker import reaper as reaper_module
from worker.context import WorkerContext
from worker.reaper import Reaper, jobs_to_send, send_job


class Killed(BaseException):
    """Stands for the API process dying: nothing in the request's code catches it."""


class Recorder:
    """A reaper's ``send``: records the job ids; fails the first ``fail_first`` sends of each job."""

    def __init__(self, then=None, fail_first=0):
        self.then, self.fail_first = then, fail_first
        self.sent: list[uuid.UUID] = []
        self.failures: dict[uuid.UUID, int] = {}
        self._lock = threading.Lock()

    def __call__(self, job_id):
        with self._lock:
            if self.failures.get(job_id, 0) < self.fail_first:
                self.failures[job_id] = self.failures.get(job_id, 0) + 1
                raise ConnectionError("broker unreachable")
            self.sent.append(job_id)
        if self.then is not None:
            self.then(job_id)


def post_job(client, set_id, iterations=4):
    return client.post(f"/v1/exemplar-sets/{set_id}/adaptations", data={"iterations": str(iterations), "seed": "3"},
                       files=files(*[png_bytes(84, 84, seed=i) for i in range(3)]))


def create_unsent_job(client, set_id, monkeypatch, iterations=4):
    """A job created the way the API does, the API dying right after its commit -> the job id."""
    def die(self, job_id):
        raise Killed

    with monkeypatch.context() as m:
        m.setattr(JobQueue, "enqueue_adaptation", die)
        with pytest.raises(Killed):
            post_job(client, set_id, iterations)
    (job,) = [j for j in client.get(f"/v1/exemplar-sets/{set_id}/adaptations").json()["data"]
              if j["params"]["iterations"] == iterations and j["status"] == "queued"]
    return uuid.UUID(job["id"])


def row(ctx, job_id):
    with ctx.session_factory() as s:
        return s.get_one(AdaptationJob, job_id)


def set_row(ctx, job_id, **values):
    with ctx.session_factory.begin() as s:
        s.execute(update(AdaptationJob).where(AdaptationJob.id == job_id).values(**values))


def checkpoint_iterations(database_url, job_id):
    from app.db import make_engine, make_sessionmaker

    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as s:
            return list(s.scalars(select(Checkpoint.iteration).where(Checkpoint.job_id == job_id)
                                  .order_by(Checkpoint.iteration)))
    finally:
        engine.dispose()


def broker(settings):
    return Connection(settings.broker_url, transport_options=broker_transport_options(settings))


def messages_waiting(settings):
    with broker(settings) as conn:
        return conn.default_channel.queue_declare(queue=settings.queue, durable=True, auto_delete=False).message_count


def later(seconds):
    return utcnow() + timedelta(seconds=seconds)


# --- the outbox in SQL (SQLite and PostgreSQL)


def test_the_api_stamps_the_job_once_its_task_is_sent(api, ctx, db_settings):
    before = utcnow()
    r = post_job(api, register_set(api))
    assert r.status_code == 202
    job = row(ctx, uuid.UUID(r.json()["id"]))
    assert job.status == "queued" and before <= job.enqueued_at <= utcnow()
    assert messages_waiting(db_settings) == 1
    # sent and confirmed: nothing to send until requeue_after has passed since the stamp (counted from
    # the stamp itself, not from the clock: a loaded machine may take seconds between the two)
    sent = job.enqueued_at
    assert jobs_to_send(ctx, now=sent + timedelta(seconds=db_settings.requeue_after - 1)) == []
    assert jobs_to_send(ctx, now=sent + timedelta(seconds=db_settings.requeue_after + 1)) == [(job.id, sent)]


def test_a_job_never_sent_is_sent_by_the_reaper_after_the_grace(api, ctx, db_settings, monkeypatch):
    job_id = create_unsent_job(api, register_set(api), monkeypatch)
    assert row(ctx, job_id).enqueued_at is None and messages_waiting(db_settings) == 0
    send = Recorder()
    reaper = Reaper(ctx, send)
    assert reaper.run_once() == [] and send.sent == []  # within the grace: the API may still send it
    t1 = later(db_settings.enqueue_grace + 1)
    assert reaper.run_once(now=t1) == [job_id] and send.sent == [job_id]
    assert row(ctx, job_id).enqueued_at == t1
    # at most once per requeue_after
    assert reaper.run_once(now=t1 + timedelta(seconds=db_settings.requeue_after - 1)) == []
    t2 = t1 + timedelta(seconds=db_settings.requeue_after + 1)
    assert reaper.run_once(now=t2) == [job_id] and send.sent == [job_id, job_id]
    assert row(ctx, job_id).enqueued_at == t2
    # only queued jobs: once a worker has it (or it is canceled), never again
    t3 = t2 + timedelta(seconds=db_settings.requeue_after + 1)
    set_row(ctx, job_id, status="running", heartbeat_at=t3)
    assert reaper.run_once(now=t3) == []
    set_row(ctx, job_id, status="canceled")
    assert reaper.run_once(now=t2 + timedelta(days=1)) == [] and send.sent == [job_id, job_id]


def test_an_abandoned_job_is_requeued_and_sent_in_the_same_round(api, ctx, db_settings):
    job_id = uuid.UUID(post_job(api, register_set(api)).json()["id"])  # sent a moment ago
    assert jobs.claim_job(ctx, job_id, worker="dead") == 1
    set_row(ctx, job_id, heartbeat_at=utcnow() - timedelta(hours=1))
    send = Recorder()
    t = utcnow()
    assert Reaper(ctx, send).run_once(now=t) == [job_id]  # not left waiting for requeue_after
    job = row(ctx, job_id)
    assert (job.status, job.worker, job.enqueued_at, job.attempts) == ("queued", None, t, 1)


def test_a_failed_send_of_the_reaper_is_retried_at_the_next_round(api, ctx, db_settings, monkeypatch):
    set_id = register_set(api)
    unsent = create_unsent_job(api, set_id, monkeypatch)
    stale = uuid.UUID(post_job(api, set_id).json()["id"])
    abandoned = uuid.UUID(post_job(api, set_id).json()["id"])
    assert jobs.claim_job(ctx, abandoned, worker="dead") == 1
    t = later(db_settings.requeue_after + db_settings.heartbeat_timeout + 1)
    send = Recorder(fail_first=1)
    reaper = Reaper(ctx, send)

    assert reaper.run_once(now=t) == []  # each send raised
    assert send.failures == {unsent: 1, stale: 1, abandoned: 1} and send.sent == []
    for job_id in (unsent, stale, abandoned):
        job = row(ctx, job_id)
        assert job.status == "queued" and job.enqueued_at is None, job_id  # not sent: due at the next round
    assert row(ctx, abandoned).attempts == 1 and row(ctx, abandoned).worker is None

    t2 = t + timedelta(seconds=1)
    assert sorted(reaper.run_once(now=t2)) == sorted([unsent, stale, abandoned])
    assert sorted(send.sent) == sorted([unsent, stale, abandoned])
    assert all(row(ctx, j).enqueued_at == t2 for j in (unsent, stale, abandoned))
    assert reaper.run_once(now=t2 + timedelta(seconds=1)) == []


def test_concurrent_reapers_send_each_job_once(api, ctx, db_settings, monkeypatch):
    set_id = register_set(api)
    due = [create_unsent_job(api, set_id, monkeypatch, iterations=i) for i in (2, 3)]
    due.append(uuid.UUID(post_job(api, set_id).json()["id"]))
    due.append(uuid.UUID(post_job(api, set_id).json()["id"]))
    assert jobs.claim_job(ctx, due[-1], worker="dead") == 1
    t = later(db_settings.requeue_after + db_settings.heartbeat_timeout + 1)
    send = Recorder()
    at_once(db_settings, 4, lambda c, i: Reaper(c, send).run_once(now=t))
    assert sorted(send.sent) == sorted(due)  # each exactly once, whichever reaper sent it


def test_a_send_lost_to_another_reaper_is_not_repeated(api, ctx, db_settings, monkeypatch):
    job_id = create_unsent_job(api, register_set(api), monkeypatch)
    t = later(db_settings.enqueue_grace + 1)
    (read,) = jobs_to_send(ctx, now=t)
    first, second = Recorder(), Recorder()
    assert send_job(ctx, job_id, first, read=read[1], now=t)
    assert not send_job(ctx, job_id, second, read=read[1], now=t + timedelta(seconds=1))  # read is stale now
    assert first.sent == [job_id] and second.sent == []


def test_jobs_to_send_lists_only_queued_jobs_due_oldest_first(api, ctx, db_settings, monkeypatch):
    set_id = register_set(api)
    newer, older = create_unsent_job(api, set_id, monkeypatch, iterations=2), create_unsent_job(api, set_id,
                                                                                                  monkeypatch)
    t = utcnow()
    set_row(ctx, older, created_at=t - timedelta(minutes=2))
    set_row(ctx, newer, created_at=t - timedelta(minutes=1))
    grace = timedelta(seconds=db_settings.enqueue_grace)
    assert jobs_to_send(ctx, now=t) == [(older, None), (newer, None)]  # the order they were created in
    # the bounds: due only once the grace (or requeue_after since the last send) has passed, not at it
    assert jobs_to_send(ctx, now=t - timedelta(minutes=2) + grace) == []
    sent_at = t - timedelta(seconds=db_settings.requeue_after)
    set_row(ctx, newer, enqueued_at=sent_at)
    assert jobs_to_send(ctx, now=t) == [(older, None)]
    assert jobs_to_send(ctx, now=t + timedelta(seconds=1)) == [(older, None), (newer, sent_at)]
    # a job claimed since its last send (or finished) is no longer the outbox's
    set_row(ctx, newer, status="running", heartbeat_at=t)
    set_row(ctx, older, status="canceled")
    assert jobs_to_send(ctx, now=t + timedelta(days=1)) == []


def test_send_job_sends_only_a_job_still_queued_and_a_failed_send_clears_only_its_own_stamp(api, ctx, db_settings,
                                                                                           monkeypatch):
    set_id = register_set(api)
    taken, ok, fails, restamped = (create_unsent_job(api, set_id, monkeypatch, iterations=i) for i in (2, 3, 4, 5))
    t = later(db_settings.enqueue_grace + 1)
    assert jobs.claim_job(ctx, taken, worker="w") == 1  # read as queued, claimed by a worker before the send
    send = Recorder()
    assert not send_job(ctx, taken, send, read=None, now=t) and send.sent == []
    assert row(ctx, taken).enqueued_at is None

    def broken(job_id):
        raise ConnectionError("broker unreachable")

    assert send_job(ctx, ok, send, read=None, now=t) and send.sent == [ok]
    with pytest.raises(ConnectionError):
        send_job(ctx, fails, broken, read=None, now=t)  # the same round (the same `now`) as `ok`'s send
    assert row(ctx, fails).enqueued_at is None and row(ctx, ok).enqueued_at == t  # `ok`'s stamp stands

    other = t + timedelta(seconds=5)

    def another_reaper_sent_it_meanwhile(job_id):
        set_row(ctx, job_id, enqueued_at=other)
        raise ConnectionError("broker unreachable")

    with pytest.raises(ConnectionError):
        send_job(ctx, restamped, another_reaper_sent_it_meanwhile, read=None, now=t)
    assert row(ctx, restamped).enqueued_at == other  # not this reaper's stamp: left alone


def test_the_api_answers_503_and_fails_the_job_only_if_nobody_sent_it(api, ctx, db_settings, monkeypatch):
    set_id = register_set(api)

    def broker_down(self, job_id):
        raise ConnectionError("broker unreachable")

    monkeypatch.setattr(JobQueue, "enqueue_adaptation", broker_down)
    r = post_job(api, set_id)
    assert r.status_code == 503
    (job,) = api.get(f"/v1/exemplar-sets/{set_id}/adaptations").json()["data"]
    assert job["status"] == "failed" and "could not enqueue" in job["error"]

    # a reaper sent the job while the API's own send was failing: the job is enqueued after all
    def reaper_wins(self, job_id):
        assert send_job(ctx, job_id, Recorder(), read=None)
        raise ConnectionError("broker unreachable")

    monkeypatch.setattr(JobQueue, "enqueue_adaptation", reaper_wins)
    r = post_job(api, set_id, iterations=3)
    assert r.status_code == 202 and r.json()["status"] == "queued"
    assert row(ctx, uuid.UUID(r.json()["id"])).enqueued_at is not None


def test_the_reaper_thread_goes_on_after_a_failed_round_and_ends_when_stopped(api, ctx, db_settings, monkeypatch):
    """The worker's reaper thread: a round that raises (the database down) is logged and the next round comes
    ``reaper_interval`` later; ``stop`` ends the thread at its next wait."""
    job_id = create_unsent_job(api, register_set(api), monkeypatch)
    set_row(ctx, job_id, created_at=utcnow() - timedelta(hours=1))  # never sent, past the grace: due now
    rounds = []
    real_round = reaper_module.reap_abandoned_jobs

    def first_round_fails(c, *, now=None):
        rounds.append(time.monotonic())
        if len(rounds) == 1:
            raise ConnectionError("database unreachable")
        return real_round(c, now=now)

    monkeypatch.setattr(reaper_module, "reap_abandoned_jobs", first_round_fails)
    send = Recorder()
    reaper = Reaper(ctx, send)
    assert reaper._thread.daemon and reaper._thread.name == "qloc-reaper"  # never holds the worker's exit
    reaper.start()
    deadline = time.monotonic() + 20
    while not send.sent and time.monotonic() < deadline:
        time.sleep(0.05)
    reaper.stop()
    reaper._thread.join(timeout=5)
    assert send.sent == [job_id] and not reaper._thread.is_alive()
    assert len(rounds) >= 2 and rounds[1] - rounds[0] >= 0.9 * db_settings.reaper_interval  # waited between rounds
    n = len(rounds)
    time.sleep(2 * db_settings.reaper_interval)
    assert len(rounds) == n  # stopped: no round since


# --- against a real worker and broker: each fault ends with the job run once


def delivery_settings(tmp_path, bundle_dir, **overrides):
    s = make_test_settings(tmp_path, bundle_dir, **{"enqueue_grace": 1.0, "requeue_after": 2.0,
                                                    "reaper_interval": 0.3, **LIVE_WORKER, **overrides})
    migrate(s.database_url)
    return s


def assert_ran_once(settings, job_id, stack, attempts=1, iterations=4):
    job = wait_for_job_row(settings.database_url, job_id, timeout=60, stack=stack)
    assert job.status == "succeeded", (job.error, stack.logs())
    assert job.attempts == attempts and job.progress_iteration == iterations
    # every checkpoint_every=2 iterations, once: as for a single run
    assert checkpoint_iterations(settings.database_url, job_id) == list(range(2, iterations + 1, 2))
    return job


@pytest.mark.slow
def test_the_api_dies_between_commit_and_send(tmp_path, bundle_dir, monkeypatch):
    settings = delivery_settings(tmp_path, bundle_dir)
    app = create_app(settings)
    try:
        job_id = create_unsent_job(TestClient(app), register_set(TestClient(app)), monkeypatch)
    finally:
        app.state.engine.dispose()
    assert messages_waiting(settings) == 0
    stack = Stack(settings, tmp_path)
    stack.start_worker()  # its reaper sends the job once the grace is over
    try:
        job = assert_ran_once(settings, job_id, stack)
    finally:
        stack.stop()
    assert job.enqueued_at is not None
    assert f"job {job_id}: queued, its task never confirmed sent; sent it" in stack.logs()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["embedded", "postgres_redis"])
def test_the_broker_loses_the_message(backend, tmp_path, bundle_dir, request):
    overrides = {}
    if backend == "postgres_redis":
        overrides = dict(database_url=request.getfixturevalue("postgres_url"), broker_url=REDIS_URL,
                         broker_transport_options={"global_keyprefix": request.getfixturevalue("redis_prefix")},
                         queue=f"qloc-test-{uuid.uuid4().hex[:8]}")
    settings = delivery_settings(tmp_path, bundle_dir, **overrides)
    app = create_app(settings)
    try:
        client = TestClient(app)
        r = post_job(client, register_set(client))
        assert r.status_code == 202
    finally:
        app.state.engine.dispose()
    job_id = uuid.UUID(r.json()["id"])
    with broker(settings) as conn:
        assert conn.default_channel.queue_purge(settings.queue) == 1  # the message is gone
    assert messages_waiting(settings) == 0
    stack = Stack(settings, tmp_path)
    stack.start_worker()  # its reaper sends the job again once requeue_after has passed
    try:
        assert_ran_once(settings, job_id, stack)
    finally:
        stack.stop()
    assert f"job {job_id}: still queued" in stack.logs()


@pytest.mark.slow
def test_the_reapers_send_fails_once(tmp_path, bundle_dir, monkeypatch):
    """A job never sent and an abandoned one requeued: the reaper's first send of each fails."""
    # The worker's own reaper stays out of it (long bounds); this test's reaper runs at times of its choosing.
    settings = delivery_settings(tmp_path, bundle_dir, enqueue_grace=600.0, requeue_after=600.0,
                                 heartbeat_timeout=600.0)
    app = create_app(settings)
    ctx = WorkerContext.create(settings)
    stack = Stack(settings, tmp_path)
    try:
        client = TestClient(app)
        set_id = register_set(client)
        unsent = create_unsent_job(client, set_id, monkeypatch)
        abandoned = uuid.UUID(post_job(client, set_id).json()["id"])
        with broker(settings) as conn:
            conn.default_channel.queue_purge(settings.queue)  # its first run gets it from here, not the broker

        class Crash(BaseException):
            pass

        def crash_after_the_first_checkpoint(self, state):
            jobs.AdaptationRun.save_checkpoint(self, int(state["iteration"]), state)
            raise Crash

        with monkeypatch.context() as m:
            m.setattr(jobs.AdaptationRun, "on_checkpoint", crash_after_the_first_checkpoint)
            with pytest.raises(Crash):
                jobs.run_adaptation_job(ctx, abandoned, worker="dies")
        assert row(ctx, abandoned).status == "running" and row(ctx, abandoned).attempts == 1

        queue = JobQueue(settings)
        send = Recorder(then=queue.enqueue_adaptation, fail_first=1)
        reaper = Reaper(ctx, send)
        t = utcnow() + timedelta(seconds=settings.heartbeat_timeout + settings.enqueue_grace + 1)
        assert reaper.run_once(now=t) == []
        assert send.failures == {unsent: 1, abandoned: 1} and messages_waiting(settings) == 0
        for job_id in (unsent, abandoned):
            job = row(ctx, job_id)
            assert job.status == "queued" and job.enqueued_at is None

        stack.start_worker()
        assert sorted(reaper.run_once(now=t + timedelta(seconds=1))) == sorted([unsent, abandoned])
        assert_ran_once(settings, unsent, stack)
        resumed = assert_ran_once(settings, abandoned, stack, attempts=2)  # the crashed run, then this one
        assert resumed.worker != "dies"
        assert f"job {abandoned} resumes from checkpoint" in stack.logs()
    finally:
        stack.stop()
        ctx.engine.dispose()
        app.state.engine.dispose()
