"""Engines and sessions. SQLite gets WAL, a busy timeout, foreign keys and ``BEGIN IMMEDIATE``.

Two processes (API and worker) write the embedded SQLite file. A deferred SQLite transaction that
reads and then writes can fail at once with "database is locked" when another process wrote in
between; ``BEGIN IMMEDIATE`` takes the write lock up front, so writers queue on the busy timeout
instead. Every transaction is kept short for that reason.

A transaction that only reads may say so (``begin_read``): on SQLite it then begins deferred, and under WAL
it neither waits for the write lock nor holds it (the localize path: concurrent requests read the set at once
instead of one after another).
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker


def make_engine(url: str) -> Engine:
    """An engine for ``url``; for a SQLite file, its directory is created."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    if u.database and u.database != ":memory:":
        Path(u.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": 30})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):  # type: ignore[no-untyped-def]
        dbapi_connection.isolation_level = None  # we emit BEGIN ourselves (below)
        cur = dbapi_connection.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):  # type: ignore[no-untyped-def]
        conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get(_READ_ONLY) else "BEGIN IMMEDIATE")

    return engine


_READ_ONLY = "qloc_read_only"


def begin_read(session: Session) -> None:
    """Begin ``session``'s transaction as one that only reads (call it first; the transaction must not write):
    on SQLite a deferred ``BEGIN``, which takes no write lock. The session's next transaction, after a commit
    or rollback, is an ordinary one again. On other databases nothing changes."""
    session.connection(execution_options={_READ_ONLY: True})


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
