"""Image pools: ``pool_images``, the pool's count and bytes on ``exemplar_sets``, jobs that take pool images.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26

An exemplar set gets a pool of unlabeled images (``POST /v1/exemplar-sets/{id}/images``), filled over many
requests and capped: ``pool_images`` holds one row per image (its file under the set's blob prefix), and
``exemplar_sets.num_pool_images`` / ``pool_bytes`` count them, changed only by a conditional UPDATE in the
transaction that adds or deletes rows (that UPDATE is the cap's guard under concurrency). A job that adapts on
the pool records which images it took: ``job_images`` rows with ``pool_image_id`` (their ``blob`` is the pool's
file), and ``adaptation_jobs.num_pool_images`` counts them. Existing sets have an empty pool and existing jobs
took none (server defaults 0). Columns are added with ALTER TABLE on both databases and dropped in place (SQLite
>= 3.35), never by rebuilding a table that others reference: on SQLite, with foreign keys on, dropping the old
table of a rebuild would cascade-delete the rows that reference it. Only ``job_images``, which no table
references, is rebuilt there (batch mode) for its foreign key.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "pool_images",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("exemplar_set_id", sa.Uuid(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("filename", sa.String(255), nullable=True),
        sa.Column("content_type", sa.String(50), nullable=False),
        sa.Column("width", sa.Integer(), nullable=False),
        sa.Column("height", sa.Integer(), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("blob", sa.String(500), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["exemplar_set_id"], ["exemplar_sets.id"],
                                name=op.f("fk_pool_images_exemplar_set_id_exemplar_sets"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pool_images")),
    )
    op.create_index(op.f("ix_pool_images_exemplar_set_id"), "pool_images", ["exemplar_set_id"])
    with op.batch_alter_table("exemplar_sets") as batch:
        batch.add_column(sa.Column("num_pool_images", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("pool_bytes", sa.BigInteger(), nullable=False, server_default="0"))
    with op.batch_alter_table("adaptation_jobs") as batch:
        batch.add_column(sa.Column("num_pool_images", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("job_images") as batch:
        batch.add_column(sa.Column("pool_image_id", sa.Uuid(), nullable=True))
        batch.create_foreign_key(op.f("fk_job_images_pool_image_id_pool_images"), "pool_images",
                                 ["pool_image_id"], ["id"], ondelete="SET NULL")
        batch.create_index(op.f("ix_job_images_pool_image_id"), ["pool_image_id"])


def _drop_columns(table: str, *columns: str) -> None:
    """Drop plain columns without rebuilding the table on SQLite: a rebuild drops the old table, and with
    foreign keys on (``app.db``) that DROP deletes the rows that reference it (``ON DELETE CASCADE``: the set's
    exemplars, jobs, checkpoints). SQLite >= 3.35 drops a column that no index or constraint names in place."""
    if op.get_bind().dialect.name == "sqlite":
        for column in columns:
            op.execute(f'ALTER TABLE "{table}" DROP COLUMN "{column}"')
    else:
        for column in columns:
            op.drop_column(table, column)


def downgrade() -> None:
    # job_images is referenced by no table: rebuilding it (SQLite) loses nothing
    with op.batch_alter_table("job_images") as batch:
        batch.drop_index(op.f("ix_job_images_pool_image_id"))
        batch.drop_constraint(op.f("fk_job_images_pool_image_id_pool_images"), type_="foreignkey")
        batch.drop_column("pool_image_id")
    _drop_columns("adaptation_jobs", "num_pool_images")
    _drop_columns("exemplar_sets", "pool_bytes", "num_pool_images")
    op.drop_index(op.f("ix_pool_images_exemplar_set_id"), table_name="pool_images")
    op.drop_table("pool_images")
