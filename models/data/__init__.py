"""Datasets: the types handed to training (``types``), corrupted MNIST (``cmnist``), offline photos
(``photos``) and the Debian package fetcher behind them.

Data is found through one setting, ``QLOC_DATA_DIR`` (default: ``data`` in the working directory,
i.e. the checkout's ``data/`` when commands run from its root): MNIST in ``<dir>/mnist``, the
fetched photos in ``<dir>/photos``. Nothing here is resolved relative to the installed code.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "QLOC_DATA_DIR"


def data_dir() -> Path:
    """``$QLOC_DATA_DIR``, else ``./data``."""
    return Path(os.environ.get(DATA_DIR_ENV) or "data")


def photo_cache_dir() -> Path:
    """Where ``qloc fetch-photos`` writes, and photo commands read, the offline photos: ``<data dir>/photos``."""
    return data_dir() / "photos"
