"""``app.lru.LoadingLRU``: what the API keeps between requests (calibrations, policies, served agents)."""

from __future__ import annotations

import threading

import pytest

from app.lru import LoadingLRU


def test_loads_once_keeps_the_most_recently_used_and_drops_the_oldest():
    loads = []
    lru: LoadingLRU[str] = LoadingLRU(2)

    def load(k):
        return lambda: loads.append(k) or f"v{k}"

    assert lru.get("a", load("a")) == "va" and lru.get("a", load("a")) == "va" and loads == ["a"]
    lru.get("b", load("b"))
    lru.get("a", load("a"))  # a is now the most recent
    lru.get("c", load("c"))  # past the size: b, the least recently used, goes
    assert "a" in lru and "c" in lru and "b" not in lru and len(lru) == 2
    assert lru.get("b", load("b")) == "vb" and loads == ["a", "b", "c", "b"]
    with pytest.raises(ValueError, match="^size must be >= 1, got 0$"):
        LoadingLRU(0)
    one: LoadingLRU[str] = LoadingLRU(1)  # the smallest: the last one loaded
    one.get("a", load("a"))
    one.get("b", load("b"))
    assert "b" in one and "a" not in one and len(one) == 1


def test_a_slow_load_holds_no_other_key_up_and_a_failed_load_keeps_nothing():
    lru: LoadingLRU[int] = LoadingLRU(8)
    started, release = threading.Event(), threading.Event()

    def slow():
        started.set()
        assert release.wait(30)
        return 1

    t = threading.Thread(target=lambda: lru.get("slow", slow))
    t.start()
    assert started.wait(30)
    assert lru.get("fast", lambda: 2) == 2  # answered while the other load is still running
    release.set()
    t.join(30)
    assert lru.get("slow", lambda: 99) == 1

    def boom():
        raise RuntimeError("unreadable")

    with pytest.raises(RuntimeError):
        lru.get("bad", boom)
    assert "bad" not in lru and lru.get("bad", lambda: 3) == 3
