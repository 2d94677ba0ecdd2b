"""Adaptation jobs as a transactional outbox: ``adaptation_jobs.enqueued_at``.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-26

NULL means no send of the job's task message is known to have happened; the reaper sends such a
``queued`` job once it is older than ``enqueue_grace``, and sends a ``queued`` job again once its last
send is older than ``requeue_after``. Rows that exist at upgrade time get NULL: a job still ``queued``
is sent once more by the reaper (a duplicate message is harmless, a stranded job is run at last).
Batch mode, so the same migration runs on SQLite and PostgreSQL.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("adaptation_jobs") as batch:
        batch.add_column(sa.Column("enqueued_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("adaptation_jobs") as batch:
        batch.drop_column("enqueued_at")
