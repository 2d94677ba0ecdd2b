"""SQLAlchemy tables (not "models": that name is the ML package). Alembic owns the schema.

Ownership: ``owner`` is a digest of the API key that created the row ("" with auth off). Checkpoints
and job images belong to their exemplar set / job and are reached only through them.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    Uuid,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"


JOB_STATES: tuple[str, ...] = tuple(s.value for s in JobState)
FINISHED_STATES: tuple[str, ...] = (JobState.SUCCEEDED.value, JobState.FAILED.value, JobState.CANCELED.value)
"""The end states: a job in one of them is never claimed, requeued or changed again."""


NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite stores them naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTCDateTime column")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class ExemplarSet(Base):
    __tablename__ = "exemplar_sets"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    owner: Mapped[str] = mapped_column(String(64), index=True, default="")
    name: Mapped[str | None] = mapped_column(String(200))
    bundle: Mapped[str] = mapped_column(String(100))
    """Name of the model bundle that made the prototype; the set localizes only with it."""
    bundle_sha256: Mapped[str | None] = mapped_column(String(64))
    """sha256 of that bundle's file: the set is refused once another file is installed under the name
    (NULL: a set made before this was recorded, served by whatever file is installed)."""
    prototype: Mapped[bytes] = mapped_column(LargeBinary)
    """Mean exemplar embedding, float32 little-endian bytes, ``[D]``."""
    prototype_dim: Mapped[int] = mapped_column(Integer)
    num_exemplars: Mapped[int] = mapped_column(Integer)
    active_checkpoint_id: Mapped[uuid.UUID | None] = mapped_column(
        Uuid, ForeignKey("checkpoints.id", use_alter=True, ondelete="SET NULL"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Exemplar(Base):
    __tablename__ = "exemplars"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    exemplar_set_id: Mapped[uuid.UUID] = mapped_column(
        Uuid, ForeignKey("exemplar_sets.id", ondelete="CASCADE"), index=True)
    position: Mapped[int] = mapped_column(Integer)
    filename: Mapped[str | None] = mapped_column(String(255))
    content_type: Mapped[str] = mapped_column(String(50))
    width: Mapped[int] = mapped_column(Integer)
    height: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))
    blob: Mapped[str] = mapped_column(String(500))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class AdaptationJob(Base):
    __tablename__ = "adaptation_jobs"
    __table_args__ = (
        UniqueConstraint("owner", "idempotency_key", name="uq_adaptation_jobs_idempotency"),
        CheckConstraint(f"status IN ({', '.join(repr(s) for s in JOB_STATES)})", name="status"),
    )

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    exemplar_set_id: Mapped[uuid.UUID] = mapped_column(
        Uuid, ForeignKey("exemplar_sets.id", ondelete="CASCADE"), index=True)
    owner: Mapped[str] = mapped_column(String(64), index=True, default="")
    status: Mapped[str] = mapped_column(String(16), index=True, default=JobState.QUEUED.value)
    """One of ``JOB_STATES`` (a CHECK constraint, ``ck_adaptation_jobs_status``); only
    ``app.jobstates`` changes it."""
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    request_sha256: Mapped[str] = mapped_column(String(64))
    """Digest of the request (files and parameters): a reused Idempotency-Key must repeat it."""
    # parameters
    iterations: Mapped[int] = mapped_column(Integer)
    learning_rate: Mapped[float] = mapped_column(Float)
    seed: Mapped[int] = mapped_column(Integer)
    activate: Mapped[bool] = mapped_column(Boolean, default=True)
    num_images: Mapped[int] = mapped_column(Integer)
    base_checkpoint_id: Mapped[uuid.UUID | None] = mapped_column(
        Uuid, ForeignKey("checkpoints.id", use_alter=True, ondelete="SET NULL"))
    """The policy the job starts from: the set's active checkpoint when the job was created."""
    # progress and outcome
    progress_iteration: Mapped[int] = mapped_column(Integer, default=0)
    mean_reward: Mapped[float | None] = mapped_column(Float)
    checkpoint_id: Mapped[uuid.UUID | None] = mapped_column(
        Uuid, ForeignKey("checkpoints.id", use_alter=True, ondelete="SET NULL"))
    """The job's latest checkpoint; the final one once it succeeded."""
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    error: Mapped[str | None] = mapped_column(Text)
    # execution
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    """Times a worker claimed the job; also the fencing token of the current run."""
    worker: Mapped[str | None] = mapped_column(String(255))
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    enqueued_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    """When the job's task message was last sent (the row is its own outbox). NULL: no send is known to
    have happened since the job was (re)queued, and the reaper sends it; while ``queued``, a send older
    than ``requeue_after`` is repeated (the broker may have lost it)."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class JobImage(Base):
    __tablename__ = "job_images"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    job_id: Mapped[uuid.UUID] = mapped_column(Uuid, ForeignKey("adaptation_jobs.id", ondelete="CASCADE"), index=True)
    position: Mapped[int] = mapped_column(Integer)
    filename: Mapped[str | None] = mapped_column(String(255))
    content_type: Mapped[str] = mapped_column(String(50))
    width: Mapped[int] = mapped_column(Integer)
    height: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))
    blob: Mapped[str] = mapped_column(String(500))


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "iteration", name="uq_checkpoints_job_iteration"),)

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    exemplar_set_id: Mapped[uuid.UUID] = mapped_column(
        Uuid, ForeignKey("exemplar_sets.id", ondelete="CASCADE"), index=True)
    parent_id: Mapped[uuid.UUID | None] = mapped_column(Uuid, ForeignKey("checkpoints.id", ondelete="SET NULL"))
    """Lineage: the checkpoint this one was trained from (None for the set's base policy)."""
    job_id: Mapped[uuid.UUID | None] = mapped_column(
        Uuid, ForeignKey("adaptation_jobs.id", ondelete="SET NULL"), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    """``base`` (the bundle's own policy, no blob) or ``adapted``."""
    iteration: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))
    """Of the checkpoint file (for ``base``: of the bundle file)."""
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    blob: Mapped[str | None] = mapped_column(String(500))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
