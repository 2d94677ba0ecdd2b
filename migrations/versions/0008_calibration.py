"""Calibrated confidence and negative exemplars: calibrations on sets and checkpoints, negatives on sets.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26

``exemplar_sets.calibration`` (JSON, NULL: none; ``models.calibration.Calibration.to_dict``) maps the answers'
scores of the set's base policy to a probability that the answer is right, fitted when the set is made;
``checkpoints.calibration`` is the same for an adapted checkpoint (an adaptation job's refresh; NULL: the set's
is used). ``exemplar_sets.threshold`` (default 0.5) is the confidence from which an answer is ``found``.
``exemplar_sets.negatives`` holds the negative exemplars' embeddings (float32 ``[num_negatives, D]``, NULL:
none) and ``num_negatives`` counts them. Existing sets and checkpoints have no calibration. Plain columns, added
with ALTER TABLE and dropped in place (SQLite >= 3.35), never by rebuilding a referenced table.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("exemplar_sets", sa.Column("calibration", sa.JSON(), nullable=True))
    op.add_column("exemplar_sets", sa.Column("threshold", sa.Float(), nullable=False, server_default="0.5"))
    op.add_column("exemplar_sets", sa.Column("negatives", sa.LargeBinary(), nullable=True))
    op.add_column("exemplar_sets", sa.Column("num_negatives", sa.Integer(), nullable=False, server_default="0"))
    op.add_column("checkpoints", sa.Column("calibration", sa.JSON(), nullable=True))


def _drop_columns(table: str, *columns: str) -> None:
    """Without rebuilding the table on SQLite (a rebuild drops the old table: see 0007)."""
    if op.get_bind().dialect.name == "sqlite":
        for column in columns:
            op.execute(f'ALTER TABLE "{table}" DROP COLUMN "{column}"')
    else:
        for column in columns:
            op.drop_column(table, column)


def downgrade() -> None:
    _drop_columns("checkpoints", "calibration")
    _drop_columns("exemplar_sets", "num_negatives", "negatives", "threshold", "calibration")
