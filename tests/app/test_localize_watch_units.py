"""``app.localize_watch.ConsumerWatch`` by value: what each check makes of the workers' replies, and what the API reads
from it (``absent``, ``gone``, ``readiness``), on a real Celery app and its Redis broker.

Only the workers are stand-ins: ``control.broadcast`` returns the replies a test scripts (the real-worker tests in
``tests/worker/test_worker_remote_inference.py`` take seconds each, one per broadcast), so every branch is reached in
milliseconds: replies of workers on other queues, malformed replies, misses in a row, a worker gone, a watch that
stopped, a broker that cannot broadcast or cannot be asked, a result backend down."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from celery import Celery
from service_fixtures import REDIS_URL

from app import localize_watch
from app.localize_watch import ConsumerWatch

QUEUE = "q-loc"


def reply(name: str, *queues: str) -> dict:
    """One worker's answer to ``active_queues``, as Celery sends it."""
    return {name: [{"name": q, "exchange": {"name": q}, "routing_key": q} for q in queues]}


class Broadcasts:
    """The workers: each broadcast returns the next scripted list of replies (or raises it), and is recorded."""

    def __init__(self, *script: list | Exception | None) -> None:
        self.script = list(script)
        self.calls: list[tuple[tuple, dict]] = []

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.calls.append((args, kwargs))
        nxt = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(nxt, Exception):
            raise nxt
        return nxt


@pytest.fixture
def celery() -> Iterator[Celery]:
    app = Celery("watch-test", broker=REDIS_URL, backend="cache+memory://")
    yield app
    app.close()


def watch_on(celery: Celery, *script: list | Exception | None, interval_s: float = 30.0) -> ConsumerWatch:
    celery.control.broadcast = Broadcasts(*script)  # type: ignore[method-assign]
    return ConsumerWatch(celery, QUEUE, interval_s)


def test_a_check_counts_the_workers_that_consume_the_queue_and_asks_on_the_brokers_connection(celery):
    w = watch_on(celery, [reply("loc@a", QUEUE, "other"), reply("jobs@b", "qloc-jobs"), reply("loc@c", QUEUE),
                          "not a dict", {"odd@d": None}, {"odd@e": ["not a dict", {"no": "name"}]}])
    assert (w.workers, w.checked_at, w.seen, w.unknown) == (None, None, False, "not checked yet")
    before = time.monotonic()
    w.check()
    assert w.workers == 2 and w.misses == 0 and w.seen
    assert list(w.recent) == [frozenset({"loc@a", "loc@c"})]
    assert before <= w.checked_at <= time.monotonic()
    assert w.ask_error is None and w.backend_error is None
    [(args, kwargs)] = celery.control.broadcast.calls
    assert args == ("active_queues",)
    assert kwargs["reply"] is True and kwargs["timeout"] == ConsumerWatch.REPLY_S
    assert kwargs["connection"] is not None and kwargs["connection"].transport_cls == "redis"


def test_a_watch_keeps_the_names_of_its_last_two_checks():
    assert ConsumerWatch.MISSES == 2
    w = ConsumerWatch(SimpleNamespace(), QUEUE, 30.0)  # type: ignore[arg-type]
    assert w.recent.maxlen == ConsumerWatch.MISSES


def test_an_absence_takes_two_misses_in_a_row_and_a_reply_ends_it(celery, caplog):
    w = watch_on(celery, [reply("jobs@b", "qloc-jobs")], [], None, [reply("loc@a", QUEUE)], [])
    with caplog.at_level(logging.INFO, logger=localize_watch.__name__):
        w.check()
        assert (w.workers, w.misses, w.seen) == (0, 1, False)
        assert w.absent() is None  # one miss is not an absence
        w.check()
        assert (w.workers, w.misses) == (0, 2)
        why = w.absent()
        assert why == (f"no worker consumes queue {QUEUE!r} (none answered the last 2 checks, 0 s ago): start a "
                       "localize worker (README, workers mode); retry later")
        w.check()  # a broadcast that returns nothing at all: one more miss
        assert (w.workers, w.misses) == (0, 3)
        assert w.absent().startswith(f"no worker consumes queue {QUEUE!r} (none answered the last 3 checks")
        w.check()
        assert (w.workers, w.misses, w.seen) == (1, 0, True) and w.absent() is None
        w.check()
        assert (w.workers, w.misses, w.seen) == (0, 1, True)  # seen once: stays seen
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "no worker consumes queue" in warned[0].getMessage()  # at the second miss only
    back = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(back) == 1 and "consumed again (1 workers)" in back[0].getMessage()
    assert list(w.recent) == [frozenset({"loc@a"}), frozenset()]


def test_the_wait_named_in_an_absence_is_the_time_since_the_last_check(celery):
    w = watch_on(celery, [])
    w.check()
    w.check()
    w.checked_at -= 3.4
    assert "(none answered the last 2 checks, 3 s ago)" in w.absent()


@pytest.mark.parametrize("reply_s", [1.0, 0.25])
def test_a_watch_that_stopped_tells_nothing(celery, monkeypatch, reply_s):
    """Its last answers are older than an interval, two replies' waits and the absent recheck: not evidence."""
    monkeypatch.setattr(ConsumerWatch, "REPLY_S", reply_s)
    w = watch_on(celery, [])
    w.check()
    w.check()
    limit = w.interval_s + 2 * ConsumerWatch.REPLY_S + ConsumerWatch.ABSENT_EVERY_S
    w.checked_at = time.monotonic() - limit + 0.1
    assert w.absent() is not None and w.readiness().startswith("error: no worker consumes")
    w.checked_at = time.monotonic() - limit - 0.1
    assert w.absent() is None and w.gone("loc@a") is None
    assert w.readiness() == "unknown: no worker answered the last check; checking again"


def test_a_worker_is_gone_when_neither_of_the_last_two_checks_saw_it(celery):
    w = watch_on(celery, [reply("loc@a", QUEUE), reply("loc@b", QUEUE)], [reply("loc@a", QUEUE)],
                 [reply("loc@a", QUEUE)])
    assert w.gone("loc@b") is None  # not checked yet
    w.check()
    assert w.gone("loc@b") is None and w.gone("loc@z") is None  # one check: not enough to tell
    w.check()
    assert w.gone("loc@b") is None and w.went_missing()  # seen by the check before: not gone yet, look again soon
    w.check()
    why = w.gone("loc@b")
    assert why == (f"the localize worker 'loc@b' that was running this call is gone (not among the workers consuming "
                   f"queue {QUEUE!r} at the last 2 checks); retry")
    assert w.gone("loc@a") is None and not w.went_missing()


def test_went_missing_compares_the_last_two_checks():
    w = ConsumerWatch(SimpleNamespace(), QUEUE, 30.0)  # type: ignore[arg-type]
    assert not w.went_missing()
    w.recent.append(frozenset({"a"}))
    assert not w.went_missing()  # one check: nothing to compare
    w.recent.append(frozenset({"a", "b"}))
    assert not w.went_missing()  # one more is no absence
    w.recent.append(frozenset({"b"}))
    assert w.went_missing()
    w.recent.append(frozenset())
    assert w.went_missing()
    w.recent.append(frozenset())
    assert not w.went_missing()


def test_a_broker_that_cannot_broadcast_tells_nothing_and_forgets_what_it_saw(celery, tmp_path):
    """The embedded default's broker (Kombu's SQLAlchemy transport) has no fanout exchange."""
    w = watch_on(celery, [reply("loc@a", QUEUE)], [])
    w.check()
    w.check()
    assert w.misses == 1 and len(w.recent) == 2
    sql = Celery("watch-test-sql", broker=f"sqla+sqlite:///{tmp_path / 'broker.db'}", backend="cache+memory://")
    sql.control.broadcast = Broadcasts(AssertionError("a broker without fanout is not asked"))  # type: ignore[method-assign]
    w.celery = sql
    w.checked_at = None
    w.check()
    assert (w.workers, w.misses, len(w.recent)) == (None, 0, 0)
    assert w.unknown == "the broker (sqla) cannot broadcast" and w.checked_at is not None
    assert w.absent() is None and w.gone("loc@a") is None
    assert w.readiness() == "unknown: the broker (sqla) cannot broadcast"
    assert sql.control.broadcast.calls == []


def test_a_broadcast_that_fails_is_an_error_until_one_goes_through(celery, caplog):
    w = watch_on(celery, [reply("loc@a", QUEUE)], [], ConnectionError("refused"), [reply("loc@a", QUEUE)])
    w.check()
    w.check()
    with caplog.at_level(logging.WARNING, logger=localize_watch.__name__):
        w.check()
    assert "cannot ask the workers: refused" in caplog.text
    assert (w.workers, w.misses, len(w.recent)) == (None, 0, 0)
    assert w.unknown == w.ask_error == "cannot ask the workers (ConnectionError)"
    assert w.checked_at is not None and w.absent() is None and w.gone("loc@a") is None
    assert w.readiness() == "error: cannot ask the workers (ConnectionError); checking again"
    w.checked_at -= 60  # the watch stopped since: its error is old news
    assert w.readiness() == "unknown: cannot ask the workers (ConnectionError)"
    w.check()
    assert w.ask_error is None and w.workers == 1 and w.readiness() == "ok"


def test_the_result_backend_is_read_at_each_check_and_its_failure_named(celery):
    w = watch_on(celery, [reply("loc@a", QUEUE)])
    keys: list[str] = []
    up = {"now": True}

    def get_task_meta(key: str) -> dict:
        keys.append(key)
        if not up["now"]:
            raise TimeoutError("no answer")
        return {}

    celery.backend.get_task_meta = get_task_meta  # type: ignore[method-assign]
    w.check()
    assert w.backend_error is None and w.workers == 1
    up["now"] = False
    w.check()
    assert w.backend_error == "TimeoutError" and w.workers == 1  # the broadcast is still asked
    up["now"] = True
    w.check()
    assert w.backend_error is None
    assert len(keys) == 3 and len(set(keys)) == 3 and all(k.startswith("qloc-ping-") for k in keys)


def test_ping_backend_reads_a_key_no_task_has(celery):
    localize_watch.ping_backend(celery)  # the in-memory backend answers
    down = SimpleNamespace(backend=SimpleNamespace(get_task_meta=lambda key: (_ for _ in ()).throw(OSError(key))))
    with pytest.raises(OSError, match="^qloc-ping-"):
        localize_watch.ping_backend(down)  # type: ignore[arg-type]


def test_readiness_while_starting_waits_for_a_first_worker(celery):
    w = watch_on(celery, [], [reply("loc@a", QUEUE)], [])
    assert w.readiness() == "unknown: not checked yet"  # a watch that is not running tells nothing
    w._thread = threading.current_thread()  # started (its loop not run: each check is the test's)
    assert w.readiness() == f"error: no worker seen on queue {QUEUE!r} yet (the first check is running); checking again"
    w.check()
    assert w.readiness() == (f"error: no worker seen on queue {QUEUE!r} yet (none answered the first check); "
                             "checking again")
    w.check()
    assert w.readiness() == "ok"
    w.check()  # one miss after a worker was seen: not known either way
    assert w.readiness() == "unknown: no worker answered the last check; checking again"
    w.check()
    assert w.readiness().startswith(f"error: no worker consumes queue {QUEUE!r} (none answered the last 2 checks")


def test_readiness_of_a_watch_that_never_ran_is_unknown_after_a_miss(celery):
    w = watch_on(celery, [])
    w.check()
    assert w.readiness() == "unknown: no worker answered the last check; checking again"


def calls_within(celery: Celery, n: int, timeout: float = 10.0) -> float:
    """Seconds until the watch has broadcast ``n`` times (polled: a loaded machine may start its thread late)."""
    t0 = time.monotonic()
    while len(celery.control.broadcast.calls) < n:
        assert time.monotonic() - t0 < timeout, f"{len(celery.control.broadcast.calls)} checks, {n} expected"
        time.sleep(0.01)
    return time.monotonic() - t0


def test_the_watch_rechecks_soon_while_a_worker_is_missing_and_at_its_interval_otherwise(celery, monkeypatch):
    monkeypatch.setattr(ConsumerWatch, "ABSENT_EVERY_S", 0.05)
    w = watch_on(celery, [], interval_s=30.0)
    w.start()
    try:
        calls_within(celery, 4)  # misses: every ABSENT_EVERY_S, not every 30 s
    finally:
        w.stop()
    assert w._thread is None
    w = watch_on(celery, [reply("loc@a", QUEUE)], interval_s=30.0)
    w.start()
    first = w._thread
    w.start()  # started once
    try:
        assert w._thread is first and first.daemon and first.name == "qloc-localize-watch"
        calls_within(celery, 1)
        time.sleep(0.4)
        assert len(celery.control.broadcast.calls) == 1  # seen: the next check comes after the interval
    finally:
        t0 = time.monotonic()
        w.stop()
    assert time.monotonic() - t0 < 2 and not first.is_alive()  # the stop ends its wait at once
    w = watch_on(celery, [reply("loc@a", QUEUE)], interval_s=30.0)
    w.recent.append(frozenset({"loc@a", "loc@b"}))  # both seen at the check before
    w.start()
    try:
        calls_within(celery, 2)  # loc@b missing: checked again soon, not after 30 s
        time.sleep(0.4)
        assert len(celery.control.broadcast.calls) == 2  # seen as it was then: back to the interval
    finally:
        w.stop()


def test_a_short_interval_is_kept_between_checks(celery):
    w = watch_on(celery, [reply("loc@a", QUEUE)], interval_s=0.1)
    w.start()
    try:
        calls_within(celery, 1)
        t0 = time.monotonic()
        calls_within(celery, 4)
        took = time.monotonic() - t0
    finally:
        w.stop()
    assert took >= 3 * 0.1 - 0.02  # three more checks, an interval apart (one at start, then one every 0.1 s)


def test_a_watch_turned_off_starts_no_thread(celery):
    for interval in (0.0, -1.0):
        w = watch_on(celery, [])
        w.interval_s = interval
        w.start()
        assert w._thread is None
        w.stop()
    assert celery.control.broadcast.calls == []


def test_a_stopped_watch_can_start_again(celery, monkeypatch):
    monkeypatch.setattr(ConsumerWatch, "ABSENT_EVERY_S", 0.05)
    w = watch_on(celery, [], interval_s=30.0)
    w.start()
    w.stop()
    n = len(celery.control.broadcast.calls)
    w.start()
    try:
        calls_within(celery, n + 1)
    finally:
        w.stop()
