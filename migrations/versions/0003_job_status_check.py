"""Adaptation job states as a CHECK constraint: ``ck_adaptation_jobs_status``.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-27

``adaptation_jobs.status`` may hold only the job states that ``app.jobstates`` declares (queued,
running, succeeded, failed, canceled). The list is written out here, not imported: a migration is a
snapshot of the schema at its revision. Batch mode, so the same migration runs on SQLite and PostgreSQL.
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JOB_STATES = ("queued", "running", "succeeded", "failed", "canceled")


def upgrade() -> None:
    allowed = ", ".join(f"'{state}'" for state in JOB_STATES)
    with op.batch_alter_table("adaptation_jobs") as batch:
        batch.create_check_constraint(op.f("ck_adaptation_jobs_status"), f"status IN ({allowed})")


def downgrade() -> None:
    with op.batch_alter_table("adaptation_jobs") as batch:
        batch.drop_constraint(op.f("ck_adaptation_jobs_status"), type_="check")
