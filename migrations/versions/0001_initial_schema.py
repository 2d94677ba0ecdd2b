"""Initial schema: exemplar sets, exemplars, adaptation jobs, job images, checkpoints.

Revision ID: 0001
Revises:
Create Date: 2026-11-25

The three foreign keys into ``checkpoints`` from tables created before it (the set's active
checkpoint, a job's base and latest checkpoint) are added at the end, in batch mode for SQLite.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UTC_DATETIME = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "exemplar_sets",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("owner", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("bundle", sa.String(length=100), nullable=False),
        sa.Column("prototype", sa.LargeBinary(), nullable=False),
        sa.Column("prototype_dim", sa.Integer(), nullable=False),
        sa.Column("num_exemplars", sa.Integer(), nullable=False),
        sa.Column("active_checkpoint_id", sa.Uuid(), nullable=True),
        sa.Column("created_at", UTC_DATETIME, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_exemplar_sets")),
    )
    op.create_index(op.f("ix_exemplar_sets_owner"), "exemplar_sets", ["owner"])

    op.create_table(
        "adaptation_jobs",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("exemplar_set_id", sa.Uuid(), nullable=False),
        sa.Column("owner", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("idempotency_key", sa.String(length=255), nullable=True),
        sa.Column("request_sha256", sa.String(length=64), nullable=False),
        sa.Column("iterations", sa.Integer(), nullable=False),
        sa.Column("learning_rate", sa.Float(), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("activate", sa.Boolean(), nullable=False),
        sa.Column("num_images", sa.Integer(), nullable=False),
        sa.Column("base_checkpoint_id", sa.Uuid(), nullable=True),
        sa.Column("progress_iteration", sa.Integer(), nullable=False),
        sa.Column("mean_reward", sa.Float(), nullable=True),
        sa.Column("checkpoint_id", sa.Uuid(), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(length=255), nullable=True),
        sa.Column("heartbeat_at", UTC_DATETIME, nullable=True),
        sa.Column("created_at", UTC_DATETIME, nullable=False),
        sa.Column("started_at", UTC_DATETIME, nullable=True),
        sa.Column("finished_at", UTC_DATETIME, nullable=True),
        sa.ForeignKeyConstraint(["exemplar_set_id"], ["exemplar_sets.id"],
                                name=op.f("fk_adaptation_jobs_exemplar_set_id_exemplar_sets"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adaptation_jobs")),
        sa.UniqueConstraint("owner", "idempotency_key", name="uq_adaptation_jobs_idempotency"),
    )
    op.create_index(op.f("ix_adaptation_jobs_exemplar_set_id"), "adaptation_jobs", ["exemplar_set_id"])
    op.create_index(op.f("ix_adaptation_jobs_owner"), "adaptation_jobs", ["owner"])
    op.create_index(op.f("ix_adaptation_jobs_status"), "adaptation_jobs", ["status"])

    op.create_table(
        "exemplars",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("exemplar_set_id", sa.Uuid(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=True),
        sa.Column("content_type", sa.String(length=50), nullable=False),
        sa.Column("width", sa.Integer(), nullable=False),
        sa.Column("height", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("blob", sa.String(length=500), nullable=False),
        sa.Column("created_at", UTC_DATETIME, nullable=False),
        sa.ForeignKeyConstraint(["exemplar_set_id"], ["exemplar_sets.id"],
                                name=op.f("fk_exemplars_exemplar_set_id_exemplar_sets"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_exemplars")),
    )
    op.create_index(op.f("ix_exemplars_exemplar_set_id"), "exemplars", ["exemplar_set_id"])

    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("exemplar_set_id", sa.Uuid(), nullable=False),
        sa.Column("parent_id", sa.Uuid(), nullable=True),
        sa.Column("job_id", sa.Uuid(), nullable=True),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("iteration", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("blob", sa.String(length=500), nullable=True),
        sa.Column("created_at", UTC_DATETIME, nullable=False),
        sa.ForeignKeyConstraint(["exemplar_set_id"], ["exemplar_sets.id"],
                                name=op.f("fk_checkpoints_exemplar_set_id_exemplar_sets"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["job_id"], ["adaptation_jobs.id"],
                                name=op.f("fk_checkpoints_job_id_adaptation_jobs"), ondelete="SET NULL"),
        sa.ForeignKeyConstraint(["parent_id"], ["checkpoints.id"],
                                name=op.f("fk_checkpoints_parent_id_checkpoints"), ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("job_id", "iteration", name="uq_checkpoints_job_iteration"),
    )
    op.create_index(op.f("ix_checkpoints_exemplar_set_id"), "checkpoints", ["exemplar_set_id"])
    op.create_index(op.f("ix_checkpoints_job_id"), "checkpoints", ["job_id"])

    op.create_table(
        "job_images",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=True),
        sa.Column("content_type", sa.String(length=50), nullable=False),
        sa.Column("width", sa.Integer(), nullable=False),
        sa.Column("height", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("blob", sa.String(length=500), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["adaptation_jobs.id"],
                                name=op.f("fk_job_images_job_id_adaptation_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_images")),
    )
    op.create_index(op.f("ix_job_images_job_id"), "job_images", ["job_id"])

    with op.batch_alter_table("exemplar_sets") as batch:
        batch.create_foreign_key(op.f("fk_exemplar_sets_active_checkpoint_id_checkpoints"), "checkpoints",
                                 ["active_checkpoint_id"], ["id"], ondelete="SET NULL")
    with op.batch_alter_table("adaptation_jobs") as batch:
        batch.create_foreign_key(op.f("fk_adaptation_jobs_base_checkpoint_id_checkpoints"), "checkpoints",
                                 ["base_checkpoint_id"], ["id"], ondelete="SET NULL")
        batch.create_foreign_key(op.f("fk_adaptation_jobs_checkpoint_id_checkpoints"), "checkpoints",
                                 ["checkpoint_id"], ["id"], ondelete="SET NULL")


def downgrade() -> None:
    with op.batch_alter_table("adaptation_jobs") as batch:
        batch.drop_constraint(op.f("fk_adaptation_jobs_checkpoint_id_checkpoints"), type_="foreignkey")
        batch.drop_constraint(op.f("fk_adaptation_jobs_base_checkpoint_id_checkpoints"), type_="foreignkey")
    with op.batch_alter_table("exemplar_sets") as batch:
        batch.drop_constraint(op.f("fk_exemplar_sets_active_checkpoint_id_checkpoints"), type_="foreignkey")
    op.drop_table("job_images")
    op.drop_table("checkpoints")
    op.drop_table("exemplars")
    op.drop_table("adaptation_jobs")
    op.drop_table("exemplar_sets")
