"""Exemplar sets known by their bundle's content: ``exemplar_sets.bundle_sha256``.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-27

The sha256 of the bundle file that made the set's prototype. A set whose bundle file was replaced
under the same name since is refused (409) until that file is back; re-creating it from its crops
makes a set of the new file. Rows that exist at upgrade time get NULL (unknown): such a set is served
by whatever file is installed under its bundle's name, as before this revision. Batch mode, so the
same migration runs on SQLite and PostgreSQL.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("exemplar_sets") as batch:
        batch.add_column(sa.Column("bundle_sha256", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("exemplar_sets") as batch:
        batch.drop_column("bundle_sha256")
