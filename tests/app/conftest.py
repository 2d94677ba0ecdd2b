"""Service fixtures, shared with the other service test directory through ``tests/service_fixtures.py``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for service_fixtures

from service_fixtures import (  # noqa: E402,F401 -- fixtures are used by name
    bundle_dir,
    client,
    db_settings,
    postgres_admin_url,
    postgres_url,
    redis_prefix,
    settings,
    versions,
)
