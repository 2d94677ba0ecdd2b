"""A bounded, thread-safe map of things loaded once and kept: the least recently used goes first.

What the API keeps between requests (decoded calibrations, checkpoints' policies, served agents) is read far more
often than loaded, by many request threads: ``get`` looks up under a lock and loads outside it, so a slow load
never holds the other threads up (two threads missing the same key at once may both load it; the first stored
is kept, the same value).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class LoadingLRU(Generic[V]):
    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self._items: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, load: Callable[[], V]) -> V:
        """The value kept under ``key``, else ``load()``'s, then kept (the oldest dropped past ``size``)."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = load()
        with self._lock:
            value = self._items.setdefault(key, value)
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
