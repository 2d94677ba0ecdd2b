"""Turns between tests that run at once on several pytest-xdist workers (``tests/conftest.py``'s ``exclusive``
marker): an exclusive turn has the machine alone; shared turns run side by side.

Two ``flock`` files in a directory every worker sees: a room every turn holds, shared or alone, and a turnstile
that an exclusive turn holds while it waits for the room, so that turns arriving meanwhile queue behind it
(it is not starved by a stream of shared ones).
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def turn(shared: Path, *, exclusive: bool) -> Iterator[None]:
    with open(shared / "qloc-turnstile.lock", "a") as turnstile, open(shared / "qloc-room.lock", "a") as room:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if not exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)  # passed: an exclusive turn waiting there stops the next ones
        fcntl.flock(room, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
