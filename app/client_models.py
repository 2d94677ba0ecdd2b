"""The response models of ``app.client``: lenient pydantic models of the v1 API's JSON (fields this client does
not know are kept in ``model.model_extra``, not refused). Import them from ``app.client``."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

TERMINAL = frozenset({"succeeded", "failed", "canceled"})
"""Job states that do not change any more."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class ExemplarSet(_Model):
    id: uuid.UUID
    name: str | None = None
    num_exemplars: int = 0
    num_labeled: int = 0
    bundle: str = ""
    bundle_sha256: str | None = None
    active_checkpoint_id: uuid.UUID | None = None
    created_at: datetime | None = None


class Instance(_Model):
    box: list[float]
    """``[x1, y1, x2, y2]`` in the pixels of the image as sent."""
    score: float
    confidence: float | None = None
    found: bool = True


class Localization(_Model):
    filename: str | None = None
    width: int
    height: int
    box: list[float]
    """``[x1, y1, x2, y2]`` in the pixels of the image as sent."""
    score: float
    confidence: float | None = None
    """Calibrated probability that the box is right (``None``: the set has no calibration)."""
    found: bool = True
    """``confidence`` at or above the set's threshold (or the request's ``min_confidence``)."""
    reranked: bool = False
    """``box`` is a candidate chosen by ``rerank`` (the server's default ``templates``: a second look where the
    agent's answer is doubtful, template matching's best window among the candidates), not the agent's own answer."""
    trajectory: list[list[float]] | None = None
    instances: list[Instance] | None = None
    """With ``max_instances``: up to that many objects, best first."""


class LocalizeResponse(_Model):
    exemplar_set_id: uuid.UUID
    checkpoint_id: uuid.UUID
    bundle: str = ""
    samples: int = 0
    nearest: bool = False
    refined: bool = False
    """The answers were refined on the checkpoint's repaired reward (a grayscale bundle's job whose repair was kept)."""
    results: list[Localization]
    kept: list[uuid.UUID] | None = None
    """With ``keep=True``: the ids of the images added to the set's pool."""


class Progress(_Model):
    iteration: int = 0
    total: int = 0
    mean_reward: float | None = None
    phase: str | None = None
    """A running job's ``setup`` (reward repair and probes), ``adapting`` or ``finishing``; else ``None``."""


class AdaptationJob(_Model):
    id: uuid.UUID
    exemplar_set_id: uuid.UUID
    status: str
    progress: Progress = Progress()
    checkpoint_id: uuid.UUID | None = None
    error: str | None = None
    params: dict[str, Any] = {}
    verdict: str | None = None
    validation: dict[str, Any] | None = None
    attempts: int = 0
    cancel_requested: bool = False
    created_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None

    @property
    def done(self) -> bool:
        return self.status in TERMINAL


class Checkpoint(_Model):
    id: uuid.UUID
    exemplar_set_id: uuid.UUID
    parent_id: uuid.UUID | None = None
    job_id: uuid.UUID | None = None
    kind: str
    iteration: int = 0
    sha256: str = ""
    metrics: dict[str, Any] = {}
    active: bool = False
    created_at: datetime | None = None


class PoolImage(_Model):
    id: uuid.UUID
    exemplar_set_id: uuid.UUID
    filename: str | None = None
    content_type: str = ""
    width: int = 0
    height: int = 0
    size: int = 0
    sha256: str = ""
    created_at: datetime | None = None


class PoolImages(_Model):
    """A page of a set's image pool (``count``/``limit``/``offset`` when listed), with the pool's totals as the
    server gives them (in ``model_extra``)."""

    data: list[PoolImage]


T = TypeVar("T", bound=BaseModel)


class Page(_Model, Generic[T]):  # noqa: UP046 -- Python 3.11
    data: list[T]
    count: int
    limit: int
    offset: int
