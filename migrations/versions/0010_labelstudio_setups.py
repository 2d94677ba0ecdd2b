"""Label Studio's /setup per exemplar set and project: ``labelstudio_setups``.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01

Label Studio's address and token and the backend's ``max_instances``, as its latest ``/setup`` gave them, were
kept in the memory of the API process that received the call; with several API processes (the embedded default
runs one per core) ``/predict`` answered by the others with one region, and the webhook could not fetch images.
A new table, referenced by none: created and dropped on both databases without touching the others.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "labelstudio_setups",
        sa.Column("exemplar_set_id", sa.Uuid(), nullable=False),
        sa.Column("project", sa.String(64), nullable=False),
        sa.Column("url", sa.String(2048), nullable=True),
        sa.Column("token", sa.String(1024), nullable=True),
        sa.Column("max_instances", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["exemplar_set_id"], ["exemplar_sets.id"],
                                name=op.f("fk_labelstudio_setups_exemplar_set_id_exemplar_sets"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("exemplar_set_id", "project", name=op.f("pk_labelstudio_setups")),
    )


def downgrade() -> None:
    op.drop_table("labelstudio_setups")
