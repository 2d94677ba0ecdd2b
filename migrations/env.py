"""Alembic environment: the URL from the service's settings, the tables' metadata for autogenerate.

``render_as_batch`` lets the same migrations alter tables on SQLite (which rebuilds the table) and
on PostgreSQL (plain ALTER TABLE).

On SQLite, foreign keys are off while migrating: a batch rebuild drops the old table, and with them on,
that drop cascades into every table referencing it (0006's downgrade emptied ``job_images`` that way).
``PRAGMA foreign_key_check`` then checks the result before it is committed.
"""

from __future__ import annotations

import logging.config

from alembic import context
from sqlalchemy import event, text

from app.config import get_settings
from app.db import make_engine
from app.tables import Base

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    logging.config.fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def database_url() -> str:
    return config.attributes.get("database_url") or get_settings().database_url


def run_migrations_offline() -> None:
    context.configure(url=database_url(), target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(database_url())
    sqlite = engine.dialect.name == "sqlite"
    if sqlite:
        @event.listens_for(engine, "connect")
        def _no_cascades(dbapi_connection, _record) -> None:  # noqa: ANN001 -- after make_engine's own hook
            cur = dbapi_connection.cursor()
            cur.execute("PRAGMA foreign_keys=OFF")
            cur.close()
    try:
        with engine.connect() as connection:
            context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True,
                              compare_type=True)
            with context.begin_transaction():
                context.run_migrations()
                if sqlite:
                    broken = connection.execute(text("PRAGMA foreign_key_check")).fetchall()
                    if broken:
                        raise RuntimeError(f"migration left rows whose foreign keys point nowhere: {broken[:5]}")
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
