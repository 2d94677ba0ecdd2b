"""The one settings object of the service and its worker (env prefix ``QLOC_``).

The defaults are the embedded setup: SQLite, Celery over its SQLAlchemy transport on a second SQLite
file, blobs under ``var/``, bundles from ``bundles/``. Point ``QLOC_DATABASE_URL`` and
``QLOC_BROKER_URL`` at PostgreSQL and Redis for the distributed one; the code path is the same.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

MiB = 1024 * 1024
MAX_SAMPLES = 63
"""Most extra sampled episodes per image a localize request may ask for (64 episodes in all)."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="QLOC_", extra="ignore")

    # --- where things live
    database_url: str = "sqlite:///var/qloc.db"
    broker_url: str = "sqla+sqlite:///var/celery-broker.db"
    broker_transport_options: dict[str, Any] = Field(default_factory=dict)
    """Extra kombu transport options (JSON), e.g. ``{"global_keyprefix": "qloc:"}`` for Redis."""
    queue: str = Field("qloc", pattern=r"^[A-Za-z0-9_.:-]{1,100}$")
    """Name of the Celery queue the adaptation tasks go to."""
    storage_dir: Path = Path("var")
    """Root of the blob store (uploaded images, checkpoints)."""
    bundle_dir: Path = Path("bundles")
    """Every ``<name>.pt`` here can be served as bundle ``<name>``."""
    default_bundle: str = "mnist-digit4"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    localize_samples: int = Field(0, ge=0, le=MAX_SAMPLES)
    """Default of localize's ``samples``: extra sampled episodes per image for the best-of-N search
    (0 = the greedy episode alone; 15 is the benchmarks' best of 16)."""
    localize_nearest: bool | None = None
    """Default of localize's ``nearest``: answer with the visited box nearest the exemplars instead of the
    episode's last box. Unset: each bundle's own default (``env.answer``: on for photo bundles)."""

    # --- auth: empty = off; on, each key sees only what it created
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)

    # --- upload limits
    max_file_bytes: int = Field(10 * MiB, ge=1)
    max_image_pixels: int = Field(16_000_000, ge=1)
    """Width x height above which an image is refused before decoding (decompression bombs)."""
    max_files_per_request: int = Field(64, ge=1)

    # --- job limits
    default_iterations: int = Field(200, ge=1)
    max_iterations: int = Field(5000, ge=1)
    default_learning_rate: float = Field(1e-3, gt=0)
    checkpoint_every: int = Field(25, ge=1)
    adapt_batch_size: int = Field(32, ge=1)
    """Images per adaptation iteration (at most the job's images)."""
    synthetic_probes: int = Field(128, ge=8, le=4096)
    """Synthetic probes per job: the set's exemplar crops pasted into the job's images, boxes known. With the
    set's labeled examples they score the starting policy and every checkpoint (``activate=auto``)."""
    job_soft_time_limit: float = Field(3600.0, gt=0)
    """Seconds; the job is marked failed (its checkpoints kept) when it runs longer."""
    job_time_limit: float = Field(3660.0, gt=0)
    """Seconds; the worker process is killed past this (the reaper then fails or resumes the job)."""
    heartbeat_interval: float = Field(5.0, gt=0)
    heartbeat_timeout: float = Field(60.0, gt=0)
    """A running job whose heartbeat is older than this is considered abandoned by a dead worker."""
    reaper_interval: float = Field(15.0, gt=0)
    """Seconds between two rounds of each worker's reaper (abandoned running jobs, unsent queued ones)."""
    enqueue_grace: float = Field(30.0, gt=0)
    """Seconds a new job may stay ``queued`` with no confirmed send (``enqueued_at`` NULL) before the reaper
    sends its task itself: the API died between committing the job and sending it. Longer than a send
    takes, or the reaper and the API may both send (a duplicate, skipped by the worker)."""
    requeue_after: float = Field(300.0, gt=0)
    """Seconds after its last send that a job still ``queued`` is sent again (the broker lost the message).
    Sent at most once per this bound; behind a long backlog this only adds duplicates, each skipped at once."""
    max_job_attempts: int = Field(3, ge=1)
    """A job abandoned this many times is marked failed instead of being requeued."""
    worker_concurrency: int = Field(1, ge=1)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [k.strip() for k in v.split(",") if k.strip()]
        return v

    @model_validator(mode="after")
    def _check_limits(self) -> Settings:
        if self.job_time_limit <= self.job_soft_time_limit:
            raise ValueError("job_time_limit (hard) must exceed job_soft_time_limit")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError("heartbeat_timeout must exceed heartbeat_interval")
        if self.default_iterations > self.max_iterations:
            raise ValueError("default_iterations must not exceed max_iterations")
        if any(len(k) < 16 for k in self.api_keys):
            raise ValueError("API keys must be at least 16 characters long")
        return self

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    @property
    def max_request_bytes(self) -> int:
        """The whole multipart body: every file at its limit plus room for the form's overhead."""
        return self.max_files_per_request * self.max_file_bytes + MiB

    @property
    def broker_visibility_timeout(self) -> int:
        """Redis redelivers an unacknowledged task after this: it must exceed the longest job."""
        return int(self.job_time_limit) + 600


@functools.cache
def get_settings() -> Settings:
    """The process's settings, read from the environment once."""
    return Settings()
