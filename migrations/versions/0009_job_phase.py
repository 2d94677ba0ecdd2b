"""A running job's phase: ``adaptation_jobs.phase``.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01

``setup`` (reward repair and probes, before the first iteration: about a minute on 2 CPU cores), ``adapting``
(the iterations), ``finishing`` (the last checkpoints scored and calibrated, the activation); NULL for a job that
is not running, and for jobs run before. A plain column, added with ALTER TABLE and dropped in place (SQLite
>= 3.35), never by rebuilding a referenced table (see 0007).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("adaptation_jobs", sa.Column("phase", sa.String(16), nullable=True))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute('ALTER TABLE "adaptation_jobs" DROP COLUMN "phase"')
    else:
        op.drop_column("adaptation_jobs", "phase")
