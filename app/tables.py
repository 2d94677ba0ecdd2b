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
    BigInteger,
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
ACTIVATE_MODES = ("auto", "true", "false")
"""What a succeeded job activates (``AdaptationJob.activate``); ``models.guard`` decides it the same way."""
PHASES = ("setup", "adapting", "finishing")
"""A running job's phase: its reward repair and probes, its iterations, its last scores, calibrations and activation."""
VERDICTS = ("improved", "no better", "worse", "reward unreliable")
"""A finished job's answer to "did adapting make the answers better?" (``models.guard.VERDICTS``)."""
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
    num_labeled: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Exemplars uploaded as whole images with the object's box (``Exemplar.box``): the set's labeled
    examples. 0 for a set of plain crops."""
    num_pool_images: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Rows of ``pool_images`` of the set: changed only by a conditional UPDATE in the same transaction as the
    rows (``app.pool``), which is also what serializes the pool's writers (the cap holds under concurrency)."""
    pool_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    """Sum of ``pool_images.size`` of the set, kept like ``num_pool_images``."""
    calibration: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    """The base policy's calibration (``models.calibration.Calibration.to_dict``): score -> P(answer right);
    NULL for sets made before it existed, or made without a model in the API (``QLOC_INFERENCE=workers``)."""
    threshold: Mapped[float] = mapped_column(Float, default=0.5, server_default="0.5")
    """An answer is ``found`` when its calibrated confidence is at least this (the ``threshold`` form field)."""
    negatives: Mapped[bytes | None] = mapped_column(LargeBinary)
    """The negative exemplars' embeddings under the bundle's head, float32 ``[num_negatives, D]``; NULL: none."""
    num_negatives: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    active_checkpoint_id: Mapped[uuid.UUID | None] = mapped_column(
        Uuid, ForeignKey("checkpoints.id", use_alter=True, ondelete="SET NULL"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    @property
    def calibrated(self) -> bool:
        """Whether the set has a calibration of its base policy (``calibration`` not NULL)."""
        return self.calibration is not None

    @property
    def kind(self) -> str | None:
        """The known kind the bundle's verifier matched the set to (``models.verifier``), or None."""
        return ((self.calibration or {}).get("kind") or {}).get("kind")


EXEMPLAR_BOX_CHECK = (
    "(box_x1 IS NULL AND box_y1 IS NULL AND box_x2 IS NULL AND box_y2 IS NULL) OR "
    "(box_x1 IS NOT NULL AND box_y1 IS NOT NULL AND box_x2 IS NOT NULL AND box_y2 IS NOT NULL "
    "AND box_x1 < box_x2 AND box_y1 < box_y2)")
"""``ck_exemplars_box``: a box is all four coordinates or none, and is not empty."""


class Exemplar(Base):
    """An uploaded exemplar file. Without a box it is a crop of the object; with one (``box_*``), a whole
    image with the object's box: a *labeled example* (its crop, cut from the box, made the prototype)."""

    __tablename__ = "exemplars"
    __table_args__ = (CheckConstraint(EXEMPLAR_BOX_CHECK, name="box"),)

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    exemplar_set_id: Mapped[uuid.UUID] = mapped_column(
        Uuid, ForeignKey("exemplar_sets.id", ondelete="CASCADE"), index=True)
    position: Mapped[int] = mapped_column(Integer)
    filename: Mapped[str | None] = mapped_column(String(255))
    content_type: Mapped[str] = mapped_column(String(50))
    width: Mapped[int] = mapped_column(Integer)
    height: Mapped[int] = mapped_column(Integer)
    """Size of the stored file as decoded (PIL's frame of the bytes in ``blob``): the frame of the box."""
    sha256: Mapped[str] = mapped_column(String(64))
    blob: Mapped[str] = mapped_column(String(500))
    box_x1: Mapped[float | None] = mapped_column(Float)
    """The object's box ``[box_x1, box_y1, box_x2, box_y2]`` in the pixels of the stored image (x right,
    y down, within ``[0, width] x [0, height]``); all NULL for a plain crop."""
    box_y1: Mapped[float | None] = mapped_column(Float)
    box_x2: Mapped[float | None] = mapped_column(Float)
    box_y2: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    @property
    def box(self) -> tuple[float, float, float, float] | None:
        """``(x1, y1, x2, y2)`` in the stored image's pixels, or None for a plain crop."""
        if self.box_x1 is None or self.box_y1 is None or self.box_x2 is None or self.box_y2 is None:
            return None
        return (self.box_x1, self.box_y1, self.box_x2, self.box_y2)


class PoolImage(Base):
    """An unlabeled image in an exemplar set's pool: what adaptation jobs may use besides their own uploads.

    Its file is under the set's blob prefix (``app.storage.pool_image_key``), so deleting the set deletes it."""

    __tablename__ = "pool_images"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    exemplar_set_id: Mapped[uuid.UUID] = mapped_column(
        Uuid, ForeignKey("exemplar_sets.id", ondelete="CASCADE"), index=True)
    position: Mapped[int] = mapped_column(Integer)
    """Index in the request that added it; the pool's order is ``(created_at, position, id)``."""
    filename: Mapped[str | None] = mapped_column(String(255))
    content_type: Mapped[str] = mapped_column(String(50))
    width: Mapped[int] = mapped_column(Integer)
    height: Mapped[int] = mapped_column(Integer)
    size: Mapped[int] = mapped_column(Integer)
    """Bytes of the stored file."""
    sha256: Mapped[str] = mapped_column(String(64))
    blob: Mapped[str] = mapped_column(String(500))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class AdaptationJob(Base):
    __tablename__ = "adaptation_jobs"
    __table_args__ = (
        UniqueConstraint("owner", "idempotency_key", name="uq_adaptation_jobs_idempotency"),
        CheckConstraint(f"status IN ({', '.join(repr(s) for s in JOB_STATES)})", name="status"),
        CheckConstraint(f"activate IN ({', '.join(repr(s) for s in ACTIVATE_MODES)})", name="activate"),
        CheckConstraint(f"verdict IN ({', '.join(repr(s) for s in VERDICTS)})", name="verdict"),
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
    activate: Mapped[str] = mapped_column(String(8), default="auto")
    """``auto``: the best checkpoint, only if it beats the starting policy on the job's probes; ``true``: the
    final checkpoint, whatever the probes say; ``false``: none (``ACTIVATE_MODES``)."""
    num_images: Mapped[int] = mapped_column(Integer)
    """All the job's images: its uploads and the pool images it took."""
    num_pool_images: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Of ``num_images``, those taken from the set's pool when the job was created (a snapshot: ``job_images``
    rows with ``pool_image_id``)."""
    base_checkpoint_id: Mapped[uuid.UUID | None] = mapped_column(
        Uuid, ForeignKey("checkpoints.id", use_alter=True, ondelete="SET NULL"))
    """The policy the job starts from: the set's active checkpoint when the job was created."""
    # progress and outcome
    progress_iteration: Mapped[int] = mapped_column(Integer, default=0)
    mean_reward: Mapped[float | None] = mapped_column(Float)
    phase: Mapped[str | None] = mapped_column(String(16))
    """A running job's phase, one of ``PHASES``; NULL when it is not running (or ran before this column)."""
    checkpoint_id: Mapped[uuid.UUID | None] = mapped_column(
        Uuid, ForeignKey("checkpoints.id", use_alter=True, ondelete="SET NULL"))
    """The job's latest checkpoint; the final one once it succeeded."""
    validation: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    """Probe scores of the starting policy and of every checkpoint (``models.guard.Guard.decide``)."""
    verdict: Mapped[str | None] = mapped_column(String(32))
    """The job's plain answer, one of ``VERDICTS``; NULL until it finished (or for jobs run before)."""
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
    pool_image_id: Mapped[uuid.UUID | None] = mapped_column(
        Uuid, ForeignKey("pool_images.id", ondelete="SET NULL"), index=True)
    """For an image taken from the set's pool: that pool image (``blob`` is its file, not a copy). A pool image
    named by a queued or running job is not deleted (409); NULL for the job's own uploads."""


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
    calibration: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    """This policy's calibration (an adaptation job's refresh); NULL: the set's ``calibration`` is used."""
    blob: Mapped[str | None] = mapped_column(String(500))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class LabelStudioSetup(Base):
    """What Label Studio's latest ``/setup`` gave for a set and one of its projects: its address and token (to fetch
    the project's task images) and the backend's ``max_instances``. In the database, so that every API process and
    replica answers ``/predict`` and the webhook alike."""

    __tablename__ = "labelstudio_setups"

    exemplar_set_id: Mapped[uuid.UUID] = mapped_column(
        Uuid, ForeignKey("exemplar_sets.id", ondelete="CASCADE"), primary_key=True)
    project: Mapped[str] = mapped_column(String(64), primary_key=True)
    """Label Studio's project id (``app.labelstudio.project_id``), "" when the call named none."""
    url: Mapped[str | None] = mapped_column(String(2048))
    token: Mapped[str | None] = mapped_column(String(1024))
    max_instances: Mapped[int] = mapped_column(Integer, default=1)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
