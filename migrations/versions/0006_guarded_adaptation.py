"""Guarded adaptation: ``adaptation_jobs.activate`` becomes a mode, and jobs keep their probe validation.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26

``activate`` was a boolean (make the final checkpoint active, or not). It becomes ``auto`` | ``true`` |
``false`` (a CHECK, ``ck_adaptation_jobs_activate``): ``auto`` activates the best checkpoint only if it
beats the starting policy on the job's probes. Existing jobs keep what they asked for (true -> ``true``,
false -> ``false``). ``validation`` (JSON) holds the probe scores of the start and of each checkpoint,
and ``verdict`` the job's plain answer (``improved`` | ``no better`` | ``worse`` | ``reward unreliable``);
both NULL for jobs that ran before. Batch mode, so the same migration runs on SQLite and PostgreSQL.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MODES = "activate IN ('auto', 'true', 'false')"
VERDICTS = "verdict IN ('improved', 'no better', 'worse', 'reward unreliable')"


def upgrade() -> None:
    with op.batch_alter_table("adaptation_jobs") as batch:
        batch.add_column(sa.Column("activate_mode", sa.String(8), nullable=True))
        batch.add_column(sa.Column("validation", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("verdict", sa.String(32), nullable=True))
    jobs = sa.table("adaptation_jobs", sa.column("activate", sa.Boolean()), sa.column("activate_mode", sa.String(8)))
    op.execute(jobs.update().values(activate_mode=sa.case((jobs.c.activate.is_(sa.true()), "true"), else_="false")))
    with op.batch_alter_table("adaptation_jobs") as batch:
        batch.drop_column("activate")
        batch.alter_column("activate_mode", new_column_name="activate", existing_type=sa.String(8), nullable=False)
        batch.create_check_constraint(op.f("ck_adaptation_jobs_activate"), MODES)
        batch.create_check_constraint(op.f("ck_adaptation_jobs_verdict"), VERDICTS)


def downgrade() -> None:
    with op.batch_alter_table("adaptation_jobs") as batch:
        batch.drop_constraint(op.f("ck_adaptation_jobs_verdict"), type_="check")
        batch.drop_constraint(op.f("ck_adaptation_jobs_activate"), type_="check")
        batch.add_column(sa.Column("activate_bool", sa.Boolean(), nullable=True))
    jobs = sa.table("adaptation_jobs", sa.column("activate", sa.String(8)), sa.column("activate_bool", sa.Boolean()))
    op.execute(jobs.update().values(activate_bool=jobs.c.activate != "false"))
    with op.batch_alter_table("adaptation_jobs") as batch:
        batch.drop_column("activate")
        batch.alter_column("activate_bool", new_column_name="activate", existing_type=sa.Boolean(), nullable=False)
        batch.drop_column("verdict")
        batch.drop_column("validation")
