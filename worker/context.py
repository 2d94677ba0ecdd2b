"""What a worker process holds: settings, database, blob store and bundles (each loaded once).

One context per process (keyed by pid): a forked pool process builds its own engine instead of
sharing the parent's connections.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from app.config import Settings, get_settings
from app.db import make_engine, make_sessionmaker
from app.inference import BundleRegistry
from app.storage import BlobStore


@dataclass
class WorkerContext:
    settings: Settings
    engine: Engine
    session_factory: sessionmaker[Session]
    store: BlobStore
    bundles: BundleRegistry

    @classmethod
    def create(cls, settings: Settings) -> WorkerContext:
        engine = make_engine(settings.database_url)
        return cls(settings, engine, make_sessionmaker(engine), BlobStore(settings.storage_dir),
                   BundleRegistry(settings.bundle_dir, settings.device,
                                  fast_episode=settings.compile_episode))


_lock = threading.Lock()
_contexts: dict[int, WorkerContext] = {}


def worker_context() -> WorkerContext:
    """This process's context, created on first use."""
    pid = os.getpid()
    with _lock:
        if pid not in _contexts:
            _contexts[pid] = WorkerContext.create(get_settings())
        return _contexts[pid]


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"
