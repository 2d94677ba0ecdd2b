"""Service fixtures, shared with the other service test directory through ``tests/service_fixtures.py``."""

from service_fixtures import (  # noqa: F401 -- fixtures are used by name
    api,
    bundle_dir,
    client,
    ctx,
    db_settings,
    postgres_admin_url,
    postgres_url,
    redis_prefix,
    settings,
    versions,
)
