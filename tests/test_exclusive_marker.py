"""The ``exclusive`` marker of ``tests/conftest.py``, run as the suite runs it: a small suite of its own on two
pytest-xdist workers, whose tests note in a shared directory while they run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from turns import turn

SUITE = '''
import json, os, time
from pathlib import Path
import pytest

RUNNING = Path(os.environ["RUNNING_DIR"])


def enter(name):
    (RUNNING / name).touch()


def leave(name, seen):
    (RUNNING / name).unlink()
    with open(RUNNING.parent / "seen.jsonl", "a") as f:
        f.write(json.dumps({"name": name, "seen": sorted(seen), "worker": os.environ["PYTEST_XDIST_WORKER"]}) + "\\n")


def run(me):
    enter(me)
    seen = set()
    for _ in range(10):
        seen |= set(os.listdir(RUNNING)) - {me}
        time.sleep(0.05)
    leave(me, seen)


# in file order, each exclusive test comes while the other worker runs a shared one
@pytest.mark.parametrize("i", range(4))
def test_shared_first(i):
    run(f"shared-{i}")


@pytest.mark.exclusive
def test_alone_first():
    run("alone-0")


@pytest.mark.parametrize("i", range(4, 8))
def test_shared_then(i):
    run(f"shared-{i}")


@pytest.mark.exclusive
def test_alone_then():
    run("alone-1")


@pytest.mark.parametrize("i", range(8, 10))
def test_shared_last(i):
    run(f"shared-{i}")
'''


def test_an_exclusive_test_runs_alone_and_the_others_side_by_side(tmp_path: Path):
    for name in ("conftest.py", "turns.py"):
        shutil.copy(Path(__file__).with_name(name), tmp_path / name)
    (tmp_path / "test_suite.py").write_text(SUITE)
    running = tmp_path / "state" / "running"
    running.mkdir(parents=True)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
                        "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "basetemp"), str(tmp_path)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "RUNNING_DIR": str(running)})
    assert r.returncode == 0, r.stdout + r.stderr
    lines = (tmp_path / "state/seen.jsonl").read_text().splitlines()
    seen = {d["name"]: set(d["seen"]) for d in map(json.loads, lines)}
    workers = {d["worker"] for d in map(json.loads, lines)}
    assert len(seen) == 12
    assert seen["alone-0"] == seen["alone-1"] == set()  # nothing ran beside an exclusive test
    assert all(not any(s.startswith("alone") for s in v) for v in seen.values())
    assert workers == {"gw0", "gw1"}  # two workers did share the suite


def holds_write_flock(path: Path) -> bool:
    """Whether some open file holds an exclusive ``flock`` on ``path`` (``/proc/locks``; waiters are ``->`` lines)."""
    if not path.exists():
        return False
    ino = path.stat().st_ino
    for line in Path("/proc/locks").read_text().splitlines():
        f = line.split()
        if f[1] == "FLOCK" and f[3] == "WRITE" and f[5].rsplit(":", 1)[-1] == str(ino):
            return True
    return False


def wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out: a hang, not a timing check"
        time.sleep(0.01)


def test_an_exclusive_turn_waits_for_the_shared_ones_and_stops_the_next(tmp_path: Path):
    events: list[str] = []
    lock = threading.Lock()

    def note(what: str) -> None:
        with lock:
            events.append(what)

    def take(name: str, exclusive: bool, hold: float) -> None:
        with turn(tmp_path, exclusive=exclusive):
            note(f"{name} in")
            time.sleep(hold)
            note(f"{name} out")

    a = threading.Thread(target=take, args=("a", False, 0.4))
    a.start()
    wait_for(lambda: "a in" in events)
    b = threading.Thread(target=take, args=("b", True, 0.3))  # comes while a runs
    b.start()
    wait_for(lambda: holds_write_flock(tmp_path / "qloc-turnstile.lock"))  # b holds the turnstile, waits for a
    c = threading.Thread(target=take, args=("c", False, 0.0))  # comes while b waits for a
    d = threading.Thread(target=take, args=("d", False, 0.0))
    c.start()
    d.start()
    for t in (a, b, c, d):
        t.join(30)
    assert events[:4] == ["a in", "a out", "b in", "b out"], events  # b alone, c and d after it
    assert sorted(events[4:]) == ["c in", "c out", "d in", "d out"]
