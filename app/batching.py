"""Dynamic batching across callers: one engine thread runs the calls of many threads as few batches.

``Batcher`` knows nothing of HTTP or models: callers ``submit(key, item, size)`` from any thread and get a
``Future``; one engine thread takes the oldest waiting item, gathers every waiting item with an equal key
(first come, first served, up to ``max_batch`` in size) and hands them to ``run(key, items)`` at once,
which answers one result per item. Items of other keys wait for the next turn, in order.

Timing is continuous batching: an item that finds the engine idle runs at once (``window_s = 0``, the
default), so a lone caller waits for nothing but its own work; while a batch runs, what arrives gathers
for the next one. ``window_s > 0`` holds the first item of an idle engine back that long for company
(Triton's ``max_queue_delay``): larger batches, at that much more latency.

A caller may also say an item is on its way before it can submit it (``expect``: a request whose images are
still being read and decoded). While any is, an idle engine holds its batch back for them, up to ``gather_s``
after the oldest waiting item: under load the engine then runs the requests in flight as one batch rather than
starting on the first and leaving the rest for the next; a lone caller, with nothing else on its way, still
runs at once.

The waiting room is bounded: ``max_queue`` in size (images, for localization) submitted and not yet taken
by the engine. ``submit`` raises ``QueueFull`` at once when an item would overflow it, rather than let
waits grow without bound; an item larger than the bound is still taken when nothing waits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class QueueFull(Exception):  # noqa: N818 -- a refusal to queue, not a crash
    """The batcher's waiting room is full: try again later."""


class BatcherClosed(RuntimeError):
    """The batcher was closed: it takes no more items."""


@dataclass
class _Waiting(Generic[T, R]):
    key: Hashable
    item: T
    size: int
    future: Future[R] = field(default_factory=Future)
    enqueued: float = field(default_factory=time.monotonic)


@dataclass
class BatcherStats:
    batches: int = 0
    """Calls of ``run`` so far."""
    items: int = 0
    """Items answered (or failed) so far."""
    size: int = 0
    """Their total size."""
    refused: int = 0
    """Items refused with ``QueueFull``."""
    largest: int = 0
    """Size of the largest batch run."""


class Expected:
    """An item on its way to a ``Batcher`` (``Batcher.expect``): ``submit(..., expected=)`` or ``done`` ends it
    (once; a context manager ends it on exit)."""

    def __init__(self, batcher: Batcher) -> None:
        self._batcher, self.pending = batcher, True

    def done(self) -> None:
        if self.pending:
            with self._batcher._cond:
                self._arrived()

    def _arrived(self) -> None:  # under the batcher's lock
        if self.pending:
            self.pending = False
            self._batcher._coming -= 1
            self._batcher._cond.notify_all()

    def __enter__(self) -> Expected:
        return self

    def __exit__(self, *exc: object) -> None:
        self.done()


class Batcher(Generic[T, R]):
    """Runs items submitted from many threads as batches of equal keys, on one engine thread.

    ``run(key, items)`` returns one result per item, in order; a result that is an exception instance is
    raised to that item's caller alone, and an exception raised by ``run`` goes to every item of the batch.
    """

    def __init__(self, run: Callable[[Hashable, list[T]], Sequence[R | BaseException]], *, window_s: float = 0.0,
                 max_batch: int = 64, max_queue: int = 256, name: str = "qloc-batcher",
                 observe: Callable[[int, list[float]], None] | None = None, gather_s: float = 0.0):
        if window_s < 0 or gather_s < 0 or max_batch < 1 or max_queue < 1:
            raise ValueError("window_s and gather_s must be >= 0, max_batch and max_queue >= 1")
        self._run, self.window_s, self.max_batch, self.max_queue = run, window_s, max_batch, max_queue
        self.gather_s = gather_s
        self._coming = 0
        self.name = name
        self.observe = observe
        """Told of each batch as it starts, on the engine thread: its size and each item's wait in seconds."""
        self.stats = BatcherStats()
        self._waiting: deque[_Waiting[T, R]] = deque()
        self._waiting_size = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def waiting(self) -> int:
        """Total size of the items submitted and not yet taken by the engine."""
        return self._waiting_size

    @property
    def coming(self) -> int:
        """Items said to be on their way (``expect``) and not yet submitted."""
        return self._coming

    def expect(self) -> Expected:
        """Say an item is on its way (submitted soon, e.g. once its images are decoded) -> its ``Expected``, to
        pass to ``submit`` or end with ``done`` (or as a context manager) if it never comes."""
        with self._cond:
            self._coming += 1
        return Expected(self)

    def submit(self, key: Hashable, item: T, size: int = 1, *, expected: Expected | None = None) -> Future[R]:
        """Queue ``item`` (of ``size``, e.g. its images) to run with others of ``key`` -> its ``Future``; the item
        ``expected`` announced has arrived (even when refused).

        Raises ``QueueFull`` when the waiting room cannot take it, ``BatcherClosed`` after ``close``."""
        w: _Waiting[T, R] = _Waiting(key, item, max(1, size))
        with self._cond:
            if expected is not None:
                expected._arrived()
            if self._closed:
                raise BatcherClosed(f"{self.name} is closed")
            if self._waiting and self._waiting_size + w.size > self.max_queue:
                self.stats.refused += 1
                raise QueueFull(f"{self._waiting_size} waiting, at most {self.max_queue}")
            self._waiting.append(w)
            self._waiting_size += w.size
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return w.future

    def __call__(self, key: Hashable, item: T, size: int = 1) -> R:
        """``submit`` and wait for the result (or its exception)."""
        return self.submit(key, item, size).result()

    def close(self, timeout: float | None = 10.0) -> None:
        """Take no more items; the engine finishes what waits, then stops (waited for up to ``timeout``)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _hold(self, for_s: float, still: Callable[[], bool]) -> None:
        """Under the lock: wait while ``still()``, until the oldest item's batch is full, at most ``for_s`` after it
        was submitted (or the batcher closes)."""
        deadline = self._waiting[0].enqueued + for_s
        key = self._waiting[0].key
        while not self._closed and still() and sum(w.size for w in self._waiting if w.key == key) < self.max_batch:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    def _take(self) -> tuple[Hashable, list[_Waiting[T, R]]] | None:
        """Under the lock: the next batch (the oldest item's key), or None when closed and drained."""
        while not self._waiting:
            if self._closed:
                return None
            self._cond.wait()
        if self.window_s > 0:  # hold the first item back for company, until full
            self._hold(self.window_s, lambda: True)
        if self.gather_s > 0:  # others on their way: wait for them
            self._hold(self.gather_s, lambda: self._coming > 0)
        key = self._waiting[0].key
        batch: list[_Waiting[T, R]] = []
        size, keep = 0, deque()
        for w in self._waiting:
            if w.key == key and (not batch or size + w.size <= self.max_batch):
                batch.append(w)
                size += w.size
            else:
                keep.append(w)
        self._waiting = keep
        self._waiting_size -= size
        return key, batch

    def _loop(self) -> None:
        while True:
            with self._cond:
                taken = self._take()
                if taken is None:
                    return
            key, batch = taken
            live = [w for w in batch if w.future.set_running_or_notify_cancel()]
            if not live:
                continue
            size = sum(w.size for w in live)
            if self.observe is not None:
                now = time.monotonic()
                try:
                    self.observe(size, [now - w.enqueued for w in live])
                except Exception:  # noqa: BLE001 -- a metric must not stop the engine
                    log.exception("%s: observing a batch failed", self.name)
            try:
                results = self._run(key, [w.item for w in live])
                if len(results) != len(live):
                    raise RuntimeError(f"run answered {len(results)} results for {len(live)} items")
            except BaseException as e:  # noqa: BLE001 -- every caller of the batch gets it; the engine goes on
                log.exception("%s: a batch of %d items failed", self.name, len(live))
                for w in live:
                    w.future.set_exception(e)
            else:
                for w, r in zip(live, results, strict=True):
                    if isinstance(r, BaseException):
                        w.future.set_exception(r)
                    else:
                        w.future.set_result(r)
            s = self.stats
            s.batches, s.items, s.size = s.batches + 1, s.items + len(live), s.size + size
            s.largest = max(s.largest, size)
