"""Whether any worker consumes the localize queue (``QLOC_INFERENCE=workers``), and which: the API's watch
(``ConsumerWatch``), read by ``app.remote.WorkerInference`` before and while it waits for a call, and by ``/readyz``."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque

from celery import Celery

log = logging.getLogger(__name__)


def ping_backend(celery: Celery) -> None:
    """Raise unless the result backend answers (a real round trip: a read of a key no task has)."""
    celery.backend.get_task_meta(f"qloc-ping-{uuid.uuid4()}")


class ConsumerWatch:
    """Whether any worker consumes the localize queue, as the last broadcasts of Celery's ``active_queues`` saw, and
    whether the result backend answers.

    A daemon thread asks every ``interval_s``, and every ``ABSENT_EVERY_S`` while none is seen (or one seen before is
    missing), so a worker that starts is seen within seconds, and one that is gone is confirmed gone within seconds of
    the first check that missed it. Every reply counts (``broadcast``, not ``inspect``: two workers of one host under
    Celery's default name ``celery@host`` would be one entry of ``inspect``'s dict, a job worker's hiding a localize
    worker's). A worker answers from its consumer thread, also while its pool is busy; still, one broadcast without
    an answer is not taken for an absence: ``MISSES`` in a row are. A broker that cannot broadcast (no fanout: the
    SQLAlchemy transport) or a broadcast that fails tells nothing: never an absence."""

    MISSES = 2
    ABSENT_EVERY_S = 1.0
    REPLY_S = 1.0
    """Seconds a broadcast waits for the workers' answers (it waits them all out: it cannot know how many)."""

    def __init__(self, celery: Celery, queue: str, interval_s: float):
        self.celery, self.queue, self.interval_s = celery, queue, interval_s
        self.workers: int | None = None
        """Workers consuming the queue at the last broadcast (replies, not names); ``None``: not known (not asked
        yet, or no answer can tell)."""
        self.recent: deque[frozenset[str]] = deque(maxlen=self.MISSES)
        """The names of the workers consuming the queue at each of the last ``MISSES`` broadcasts that could tell
        (emptied when one cannot)."""
        self.misses = 0
        self.seen = False
        """Whether any worker consumed the queue at some check since this API started."""
        self.checked_at: float | None = None
        self.unknown = "not checked yet"
        self.ask_error: str | None = None
        """Why the last broadcast failed (the broker could not be asked), or ``None``."""
        self.backend_error: str | None = None
        """Why the result backend did not answer at the last check, or ``None``."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> None:
        """One broadcast (and one read of the result backend); their answers replace the last ones."""
        try:
            ping_backend(self.celery)
            self.backend_error = None
        except Exception as e:  # noqa: BLE001 -- reported by _ask and /readyz
            self.backend_error = f"{type(e).__name__}"
        try:
            with self.celery.connection_for_read() as conn:
                if "fanout" not in getattr(conn.transport.implements, "exchange_type", ()):
                    self.workers, self.misses = None, 0
                    self.recent.clear()
                    self.unknown = f"the broker ({conn.transport_cls}) cannot broadcast"
                    self.checked_at = time.monotonic()
                    return
                replies = self.celery.control.broadcast("active_queues", reply=True, timeout=self.REPLY_S,
                                                        connection=conn) or []
        except Exception as e:  # noqa: BLE001 -- the broker's own check (/readyz "broker") reports it
            log.warning("localize queue: cannot ask the workers: %s", e)
            self.workers, self.misses, self.unknown = None, 0, f"cannot ask the workers ({type(e).__name__})"
            self.ask_error = self.unknown
            self.recent.clear()
            self.checked_at = time.monotonic()
            return
        self.ask_error = None
        names = [name for reply in replies if isinstance(reply, dict) for name, queues in reply.items()
                 if any(isinstance(q, dict) and q.get("name") == self.queue for q in queues or ())]
        workers = len(names)
        self.recent.append(frozenset(names))
        self.misses = 0 if workers else self.misses + 1
        self.seen = self.seen or workers > 0
        if self.misses == self.MISSES:
            log.warning("no worker consumes queue %r: model calls are refused until one does", self.queue)
        elif workers and self.workers == 0:
            log.info("queue %r: consumed again (%d workers)", self.queue, workers)
        self.workers, self.checked_at = workers, time.monotonic()

    def absent(self) -> str | None:
        """Why calls cannot be answered (no worker consumes the queue), or ``None`` when they may be."""
        if self.misses < self.MISSES or self.checked_at is None:
            return None
        if self._stale():
            return None  # the watch stopped: not evidence
        return (f"no worker consumes queue {self.queue!r} (none answered the last {self.misses} checks, "
                f"{time.monotonic() - self.checked_at:.0f} s ago): start a localize worker (README, workers mode); "
                "retry later")

    def gone(self, worker: str) -> str | None:
        """Why the worker named ``worker`` (its node name, as a started task's state records it) cannot answer: it
        was not among the workers consuming the queue at the last ``MISSES`` broadcasts (killed, or stopped), while
        those broadcasts could tell; else ``None``. A worker restarted under the same name in between is taken for
        the one that started the call (its call is then waited for until its timeout)."""
        if len(self.recent) < self.MISSES or self.checked_at is None or self._stale():
            return None
        if any(worker in names for names in self.recent):
            return None
        return (f"the localize worker {worker!r} that was running this call is gone (not among the workers consuming "
                f"queue {self.queue!r} at the last {self.MISSES} checks); retry")

    def _stale(self) -> bool:
        return self.checked_at is None or \
            time.monotonic() - self.checked_at > self.interval_s + 2 * self.REPLY_S + self.ABSENT_EVERY_S

    def readiness(self) -> str:
        """``/readyz``'s entry: ``ok`` (a worker answered the last check), ``error: ...`` (none, ``absent``; also
        until the watch has seen one since the API started: not checked yet, or none at the first check), or
        ``unknown: ...`` (one miss after workers were seen, a watch turned off, or a broker that cannot tell). A
        broker that broadcasts but could not be asked (Redis down, or coming back) is an error, not unknown: no
        worker is known to take calls."""
        why = self.absent()
        if why is not None:
            return f"error: {why}"
        if self.ask_error is not None and not self._stale():
            return f"error: {self.ask_error}; checking again"
        if self.workers:
            return "ok"
        if not self.seen and self._thread is not None and (self.checked_at is None or self.misses):
            # starting: a load balancer should not send calls here before a worker is known to take them
            return (f"error: no worker seen on queue {self.queue!r} yet (" +
                    ("the first check is running" if self.checked_at is None else "none answered the first check") +
                    "); checking again")
        return "unknown: no worker answered the last check; checking again" if self.misses else \
            f"unknown: {self.unknown}"

    def start(self) -> None:
        if self.interval_s <= 0 or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="qloc-localize-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def went_missing(self) -> bool:
        """Whether a worker seen at the check before the last was not at the last (gone, or one reply lost): the
        next check comes within ``ABSENT_EVERY_S``, so that its calls are given up soon if it is gone."""
        return len(self.recent) == self.MISSES and bool(self.recent[-2] - self.recent[-1])

    def _run(self) -> None:
        while not self._stop.is_set():
            self.check()
            self._stop.wait(self.ABSENT_EVERY_S if self.misses or self.went_missing() else self.interval_s)
