"""Exemplar sets may carry boxes: ``exemplars.box_x1 .. box_y2`` and ``exemplar_sets.num_labeled``.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-28

An exemplar uploaded as a whole image with the object's box (``POST /v1/exemplar-sets`` with ``boxes``)
keeps the box in the pixels of the stored image, four nullable floats; a plain crop has none (all four
NULL: a CHECK, ``ck_exemplars_box``, wants all four or none, and x1 < x2, y1 < y2). ``num_labeled``
counts a set's boxed exemplars (its labeled examples). Rows that exist at upgrade time are plain crops:
NULL boxes, ``num_labeled`` 0. The CHECK is written out here, not imported: a migration is a snapshot of
the schema at its revision. Batch mode, so the same migration runs on SQLite and PostgreSQL.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BOX = ("box_x1", "box_y1", "box_x2", "box_y2")
BOX_CHECK = (
    "(box_x1 IS NULL AND box_y1 IS NULL AND box_x2 IS NULL AND box_y2 IS NULL) OR "
    "(box_x1 IS NOT NULL AND box_y1 IS NOT NULL AND box_x2 IS NOT NULL AND box_y2 IS NOT NULL "
    "AND box_x1 < box_x2 AND box_y1 < box_y2)")


def upgrade() -> None:
    with op.batch_alter_table("exemplars") as batch:
        for name in BOX:
            batch.add_column(sa.Column(name, sa.Float(), nullable=True))
        batch.create_check_constraint(op.f("ck_exemplars_box"), BOX_CHECK)
    with op.batch_alter_table("exemplar_sets") as batch:
        batch.add_column(sa.Column("num_labeled", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("exemplar_sets") as batch:
        batch.drop_column("num_labeled")
    with op.batch_alter_table("exemplars") as batch:
        batch.drop_constraint(op.f("ck_exemplars_box"), type_="check")
        for name in reversed(BOX):
            batch.drop_column(name)
