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


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_image_pool_migration_keeps_sets_and_jobs_both_ways(backend, tmp_path, request, bundle_dir):
    """0007 (image pools) down and up again on a database with a pool and a job that took it: sets, jobs and
    job images stay; the pool's rows go with its table and come back empty (counts 0), with no drift."""
    from fastapi.testclient import TestClient
    from service_fixtures import files, make_test_settings, migrate, png_bytes, row_counts

    from app.main import create_app

    url = f"sqlite:///{tmp_path}/m.db" if backend == "sqlite" else request.getfixturevalue("postgres_url")
    settings = make_test_settings(tmp_path, bundle_dir, database_url=url)
    migrate(url)
    app = create_app(settings)
    with TestClient(app) as c:
        set_id = c.post("/v1/exemplar-sets", files=files(png_bytes(28, 28))).json()["id"]
        r = c.post(f"/v1/exemplar-sets/{set_id}/images", files=files(png_bytes(), png_bytes(seed=1)))
        assert r.status_code == 201
        assert c.post(f"/v1/exemplar-sets/{set_id}/adaptations", data={"source": "pool"}).status_code == 202
    app.state.engine.dispose()
    before = row_counts(url)
    assert before["pool_images"] == 2 and before["job_images"] == 2

    cfg = alembic_config(url)
    command.downgrade(cfg, "0006")
    assert "pool_images" not in table_names(url)
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            cols = {c["name"] for c in inspect(conn).get_columns("job_images")}
            assert "pool_image_id" not in cols
            assert conn.exec_driver_sql("SELECT count(*) FROM job_images").scalar() == 2
            assert conn.exec_driver_sql("SELECT count(*) FROM exemplar_sets").scalar() == 1
    finally:
        engine.dispose()

    command.upgrade(cfg, "head")
    assert schema_drift(url) == []
    after = row_counts(url)
    assert after == {**before, "pool_images": 0}
    app = create_app(settings)
    with TestClient(app) as c:
        es = c.get(f"/v1/exemplar-sets/{set_id}").json()
        assert es["num_pool_images"] == 0 and es["pool_bytes"] == 0
    app.state.engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_downgrades_that_rebuild_tables_keep_the_rows_that_reference_them(backend, tmp_path, request, bundle_dir):
    """Down to 0004 and up again (0005 and 0006 rebuild ``exemplar_sets`` and ``adaptation_jobs`` on SQLite): a
    set, its exemplars, a job and its images survive both ways. With SQLite's foreign keys on while migrating,
    the rebuild's DROP TABLE cascaded and emptied ``job_images`` (migrations/env.py turns them off)."""
    from fastapi.testclient import TestClient
    from service_fixtures import files, make_test_settings, migrate, png_bytes, row_counts

    from app.main import create_app

    url = f"sqlite:///{tmp_path}/m.db" if backend == "sqlite" else request.getfixturevalue("postgres_url")
    settings = make_test_settings(tmp_path, bundle_dir, database_url=url)
    migrate(url)
    app = create_app(settings)
    with TestClient(app) as c:
        set_id = c.post("/v1/exemplar-sets", files=files(png_bytes(28, 28))).json()["id"]
        r = c.post(f"/v1/exemplar-sets/{set_id}/adaptations", files=files(png_bytes(), png_bytes(seed=1)))
        assert r.status_code == 202
    app.state.engine.dispose()
    before = row_counts(url)
    assert before["job_images"] == 2 and before["exemplars"] == 1

    cfg = alembic_config(url)
    command.downgrade(cfg, "0004")
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            for table, n in (("job_images", 2), ("exemplars", 1), ("adaptation_jobs", 1), ("exemplar_sets", 1)):
                assert conn.exec_driver_sql(f"SELECT count(*) FROM {table}").scalar() == n, table
    finally:
        engine.dispose()
    command.upgrade(cfg, "head")
    assert schema_drift(url) == []
    assert row_counts(url) == before
