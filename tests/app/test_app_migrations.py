"""Alembic owns the schema: the migrations build exactly the tables, on SQLite and PostgreSQL alike."""

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from service_fixtures import REPO
from sqlalchemy import inspect

from app.db import make_engine
from app.tables import Base


def alembic_config(url):
    cfg = Config(str(REPO / "alembic.ini"))
    cfg.attributes["database_url"] = url
    cfg.attributes["configure_logger"] = False
    return cfg


def schema_drift(url):
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True, "render_as_batch": True})
            return compare_metadata(ctx, Base.metadata)
    finally:
        engine.dispose()


def table_names(url):
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_upgrade_downgrade_upgrade_without_drift(backend, tmp_path, request):
    # postgres_url is migrated already; start that one from base
    url = f"sqlite:///{tmp_path}/m.db" if backend == "sqlite" else request.getfixturevalue("postgres_url")
    cfg = alembic_config(url)
    command.downgrade(cfg, "base")
    assert table_names(url) <= {"alembic_version"}
    command.upgrade(cfg, "head")
    assert table_names(url) == set(Base.metadata.tables) | {"alembic_version"}
    assert schema_drift(url) == []
    command.downgrade(cfg, "base")
    command.upgrade(cfg, "head")
    assert schema_drift(url) == []
