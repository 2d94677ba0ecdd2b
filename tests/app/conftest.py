"""Service fixtures, shared with the other service test directory through ``tests/service_fixtures.py``."""

import uuid
from collections.abc import Iterator

import pytest
from labelstudio_fake import fake_ls  # noqa: F401 -- a fixture, used by name
from service_fixtures import (  # noqa: F401 -- fixtures are used by name
    PG_ADMIN_URL,
    bundle_dir,
    client,
    db_settings,
    migrate,
    postgres_admin_url,
    postgres_url,
    redis_prefix,
    settings,
    versions,
)

from app.db import make_engine, make_sessionmaker
from app.storage import BlobStore


@pytest.fixture
def store(tmp_path) -> BlobStore:  # type: ignore[no-untyped-def]
    """A blob store in the test's own directory (the routes' by-value tests)."""
    return BlobStore(tmp_path / "blobs")


@pytest.fixture(scope="module")
def module_postgres_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database shared by one test module (``postgres_url`` is one per test);
    dropped afterwards. Its tests must not expect an empty database."""
    import psycopg

    admin = request.getfixturevalue("postgres_admin_url")
    name = f"qloc_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"{PG_ADMIN_URL.rsplit('/', 1)[0]}/{name}"
    migrate(url)
    yield url
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Sessions on a migrated database shared by one test module, once on SQLite and once on PostgreSQL (its tests
    must not expect an empty database). A module may define a ``db`` of its own (``test_app_jobstates.py``)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('module-db')}/qloc.db"
        migrate(url)
    else:
        url = request.getfixturevalue("module_postgres_url")
    engine = make_engine(url)
    yield make_sessionmaker(engine)
    engine.dispose()
