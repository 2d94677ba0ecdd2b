"""What every test shares: the ``exclusive`` marker, for tests that time a floor, when the suite runs on several
pytest-xdist workers (``./scripts/test`` runs two, ``QLOC_TEST_WORKERS``).

An ``exclusive`` test runs with no other test beside it: it waits until the tests running on the other workers end,
and no test starts until it has ended (``turns.turn``). The other tests share the machine with each other as
usual. Without xdist (one process) nothing waits.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/: turns, and service_fixtures for every directory

from turns import turn  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "exclusive: runs with no other test beside it (it times a floor)")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under mutmut (``scripts/mutation``), every ``functools`` cache emptied, and the action tables
    (``models.core.actions._TABLES``, the one cache of the models kept by hand): each mutant's tests run in a process
    forked from the one that ran the clean tests, and a cached answer computed there would stand in for the mutated
    function's."""
    if os.environ.get("MUTANT_UNDER_TEST"):
        import functools
        import gc

        for obj in gc.get_objects():
            if isinstance(obj, functools._lru_cache_wrapper):
                obj.cache_clear()
        actions = sys.modules.get("models.core.actions")
        if actions is not None:
            actions._TABLES.clear()


@pytest.fixture(autouse=True)
def _exclusive_turns(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    shared = tmp_path_factory.getbasetemp().parent  # each worker's base temp lies in the run's one directory
    with turn(shared, exclusive=request.node.get_closest_marker("exclusive") is not None):
        yield
