"""Pydantic v2 schemas of the v1 API (what clients see; the tables are in ``app.tables``)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.jobstates import JobState

Box = Annotated[list[float], Field(min_length=4, max_length=4, description="[x1, y1, x2, y2] in uploaded pixels")]


class ErrorDetail(BaseModel):
    """Every error the API answers: a JSON object with a human-readable ``detail``."""

    detail: str


class ValidationIssue(BaseModel):
    """One item of a request validation error (FastAPI's format)."""

    loc: list[str | int]
    msg: str
    type: str
    input: Any = None
    ctx: dict[str, Any] | None = None


class ValidationErrorDetail(BaseModel):
    """422: the request's fields did not validate (a list of issues), or a value was refused by the service
    (a message: an unknown bundle, more iterations than the server allows, no file)."""

    detail: list[ValidationIssue] | str


class Page(BaseModel):
    count: int = Field(description="Items in total, across all pages")
    limit: int
    offset: int


class ExemplarSetPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID
    name: str | None
    num_exemplars: int
    num_labeled: int = Field(description=(
        "Exemplars uploaded as whole images with the object's box (`boxes`): the set's labeled examples, which "
        "adaptation jobs use to check themselves. 0 for a set of plain crops."))
    bundle: str
    bundle_sha256: str | None = Field(description=(
        "sha256 of the bundle file that made the set's prototype. Once another file is installed under the "
        "bundle's name, the set answers 409 until that file is back: re-create the set from its crops to use "
        "the new one. null: a set made before it was recorded, served by the file installed now."))
    active_checkpoint_id: uuid.UUID | None
    created_at: datetime


class ExemplarSetsPublic(Page):
    data: list[ExemplarSetPublic]


class LocalizationResult(BaseModel):
    filename: str | None
    width: int
    height: int
    box: Box
    score: float = Field(description="Embedding distance of the final box to the prototype (lower is closer)")
    trajectory: list[Box] | None = Field(None, description="Boxes from the whole image to the final one")


class LocalizeResponse(BaseModel):
    exemplar_set_id: uuid.UUID
    checkpoint_id: uuid.UUID
    bundle: str
    samples: int = Field(description="Extra sampled episodes per image (best-of-N search); 0 = greedy only")
    nearest: bool = Field(description="The answer is the visited box nearest the exemplars, not the last one")
    results: list[LocalizationResult]


class Progress(BaseModel):
    iteration: int
    total: int
    mean_reward: float | None


class JobParams(BaseModel):
    iterations: int
    learning_rate: float
    seed: int
    activate: bool
    num_images: int
    base_checkpoint_id: uuid.UUID | None


class AdaptationJobPublic(BaseModel):
    id: uuid.UUID
    exemplar_set_id: uuid.UUID
    status: JobState
    progress: Progress
    checkpoint_id: uuid.UUID | None
    error: str | None
    params: JobParams
    attempts: int
    cancel_requested: bool
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class AdaptationJobsPublic(Page):
    data: list[AdaptationJobPublic]


class CheckpointPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID
    exemplar_set_id: uuid.UUID
    parent_id: uuid.UUID | None = Field(description="Lineage: the checkpoint this one was trained from")
    job_id: uuid.UUID | None
    kind: Literal["base", "adapted"]
    iteration: int
    sha256: str
    metrics: dict[str, float | int | str | None]
    active: bool
    created_at: datetime


class CheckpointsPublic(Page):
    data: list[CheckpointPublic]


class HealthStatus(BaseModel):
    status: Literal["ok"]


class ReadyStatus(BaseModel):
    status: Literal["ok", "unavailable"]
    checks: dict[str, str]
