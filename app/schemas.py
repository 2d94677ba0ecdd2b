"""Pydantic v2 schemas of the v1 API (what clients see; the tables are in ``app.tables``)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.jobstates import JobState

Box = Annotated[list[float], Field(min_length=4, max_length=4, description="[x1, y1, x2, y2] in uploaded pixels")]

Rerank = Literal["auto", "templates", "true", "false"]
"""localize's ``rerank``: ``true`` answers with the likeliest candidate; ``auto`` does so only where the agent's answer
is clearly unlikely (its confidence below half the set's threshold) and a candidate is likely (at or above it): a
second look, on grayscale bundles' sets (their confidence is the NCC with the exemplars: evidence of its own, not the
agent's embedding); ``templates`` (the default): ``auto`` with template matching's window as one more candidate of
the second look (taken only if its confidence reaches ``app.calibration.TEMPLATE_BAR``); ``false``: the agent's
answer."""


class ErrorDetail(BaseModel):
    """Every error the API answers: a JSON object with a human-readable ``detail``."""

    detail: str = Field(description="What went wrong and what to fix, for a person to read")


class ValidationIssue(BaseModel):
    """One item of a request validation error (FastAPI's format)."""

    loc: list[str | int] = Field(description=(
        "Where the issue is: the part of the request (`body`, `query`, `path`, `header`) and the field's name"))
    msg: str = Field(description="What is wrong with the value, for a person to read")
    type: str = Field(description=(
        "The kind of issue, for a program to read (pydantic's error type, e.g. `missing`, `int_parsing`)"))
    input: Any = Field(None, description="The value refused")
    ctx: dict[str, Any] | None = Field(None, description=(
        "The rule's parameters, where it has some (e.g. `{\"le\": 32}`)"))


class ValidationErrorDetail(BaseModel):
    """422: the request's fields did not validate (a list of issues), or a value was refused by the service
    (a message: an unknown bundle, more iterations than the server allows, no file)."""

    detail: list[ValidationIssue] | str = Field(description=(
        "The issues, one per field; or a message where the service refused a value"))


class Page(BaseModel):
    count: int = Field(description="Items in total, across all pages")
    limit: int = Field(description="Items per page, as asked (`limit`, at most 200)")
    offset: int = Field(description="Items skipped before this page, as asked (`offset`)")


class ExemplarSetChange(BaseModel):
    """``PATCH /v1/exemplar-sets/{id}``: what to change; a field left out is left as it is."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1})

    name: str | None = Field(None, min_length=1, max_length=200, pattern=r"\S",
                             description="The set's new name (some text besides spaces, trimmed as at creation); "
                                         "null clears it")
    threshold: float = Field(None, ge=0.0, le=1.0, allow_inf_nan=False, strict=True,  # type: ignore[assignment]
                             validate_default=False, description=(
        "Calibrated confidence in [0, 1] from which an answer is `found`: takes effect on the next request, for "
        "every checkpoint of the set (the calibration is not refit: it gives the confidence, the threshold reads "
        "it)"))


    @field_validator("name", mode="before")
    @classmethod
    def _trimmed(cls, v: object) -> object:
        """Trimmed as a set's name is at creation; only spaces is refused in the words creation uses."""
        if isinstance(v, str):
            v = v.strip()
            if not v:
                raise ValueError("name is empty (only spaces): give it some text, or null to clear it")
        return v

    @field_validator("threshold")
    @classmethod
    def _no_negative_zero(cls, v: float) -> float:
        return v + 0.0  # -0.0 is stored and shown as 0.0


class ExemplarSetPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID = Field(description="The set's id: the `{set_id}` of its routes")
    name: str | None = Field(description="The set's name as given (trimmed), or null")
    num_exemplars: int = Field(description=(
        "Exemplar crops the prototype is the mean of (crops uploaded, and crops cut from `boxes`)"))
    num_labeled: int = Field(description=(
        "Exemplars uploaded as whole images with the object's box (`boxes`): the set's labeled examples, which "
        "adaptation jobs use to check themselves. 0 for a set of plain crops."))
    num_pool_images: int = Field(0, description=(
        "Images in the set's pool (`/v1/exemplar-sets/{id}/images`): unlabeled images adaptation jobs may use "
        "(`source=pool|both`), at most QLOC_MAX_POOL_IMAGES"))
    pool_bytes: int = Field(0, description="Bytes of the pool's images as uploaded, at most QLOC_MAX_POOL_BYTES")
    num_negatives: int = Field(0, description=(
        "Negative exemplars (`negative_files`): crops of look-alikes the answers should avoid"))
    threshold: float = Field(0.5, description=(
        "Calibrated confidence from which an answer is `found` (the `threshold` form field; default 0.5)"))
    calibrated: bool = Field(False, description=(
        "Whether the set has a calibration of its base policy, which gives answers their `confidence`: made "
        "with the set in QLOC_INFERENCE=local mode; false for sets made before, or by an API without a model"))
    kind: str | None = Field(None, description=(
        "The kind of object the bundle's known-kinds verifier matched the set's crops to (`mnist-general`: a digit, "
        "'0'-'9'), or null: not a kind it was trained on, or a bundle without one. With a kind, an answer's "
        "`confidence` is the verifier's probability that its box is the set's kind rather than another kind it "
        "knows, the background or a negative exemplar, so `found` tells the query digit from other digits; without, "
        "the set's calibrated fit decides"))
    bundle: str = Field(description="The model bundle the set was made with, and localizes with (`/v1/bundles`)")
    bundle_sha256: str | None = Field(description=(
        "sha256 of the bundle file that made the set's prototype. Once another file is installed under the "
        "bundle's name, the set answers 409 until that file is back: re-create the set from its crops to use "
        "the new one. null: a set made before it was recorded, served by the file installed now."))
    active_checkpoint_id: uuid.UUID | None = Field(description=(
        "The checkpoint localize uses by default (`checkpoint=active`): the base policy until an adaptation job or "
        "`/v1/checkpoints/{id}/activate` changes it"))
    created_at: datetime = Field(description="When the set was created (UTC)")


class ExemplarSetsPublic(Page):
    data: list[ExemplarSetPublic] = Field(description="The page's sets, oldest first")


class InstanceResult(BaseModel):
    """One object found in an image (``max_instances``)."""

    box: Box
    score: float = Field(description="Embedding distance of the box to the prototype (lower is closer)")
    confidence: float | None = Field(None, ge=0, le=1, description=(
        "Calibrated probability that the box is on an instance of the object (IoU >= 0.5), as the answer's; null "
        "without a calibration"))
    found: bool = Field(True, description="confidence >= the set's threshold (true without a calibration)")


class LocalizationResult(BaseModel):
    filename: str | None = Field(description="The uploaded file's name (as sent; null without one)")
    width: int = Field(description=(
        "The image's width in pixels, upright (EXIF orientation applied): the frame of `box`"))
    height: int = Field(description="The image's height in pixels, upright (EXIF orientation applied)")
    box: Box
    score: float = Field(description="Embedding distance of the final box to the prototype (lower is closer)")
    confidence: float | None = Field(None, ge=0, le=1, description=(
        "Calibrated probability that the box is on the object (IoU >= 0.5), in [0, 1], higher is better: the "
        "calibration of the checkpoint served (or the set's). With negative exemplars, it also weighs how near "
        "the box is to the look-alikes. For a set with a `kind` (the bundle's known-kinds verifier), the verifier's "
        "probability that the box is the set's kind rather than another kind it knows, the background or a "
        "negative exemplar. null when neither the checkpoint nor the set has a calibration"))
    found: bool = Field(True, description=(
        "confidence >= the set's threshold (and >= min_confidence when given); the box is returned either way. "
        "true when there is no calibration (as before calibrations existed)"))
    reranked: bool | None = Field(None, description=(
        "true: `box` is not the agent's own answer but the likeliest of the several-instances candidates (with "
        "`rerank=templates`, the default, or template matching's window), chosen by `rerank` (with `templates` and "
        "`auto`: the agent's answer was below half the set's threshold and this candidate reaches it, the window "
        "0.8). Absent otherwise"))
    trajectory: list[Box] | None = Field(None, description="Boxes from the whole image to the final one")
    instances: list[InstanceResult] | None = Field(None, description=(
        "With `max_instances`: up to that many objects in the image, best (lowest score) first, none overlapping "
        "another by more than IoU 0.3; the agent's answer (`box`) is one of them unless a closer box overlaps it. "
        "With `min_confidence`, those below it are left out. Absent without `max_instances`"))


class LocalizeResponse(BaseModel):
    exemplar_set_id: uuid.UUID = Field(description="The set asked")
    checkpoint_id: uuid.UUID = Field(description=(
        "The checkpoint that answered (the set's active one, unless `checkpoint` named another)"))
    bundle: str = Field(description="The set's model bundle")
    samples: int = Field(description="Extra sampled episodes per image (best-of-N search); 0 = greedy only")
    nearest: bool = Field(description="The answer is the visited box nearest the exemplars, not the last one")
    refined: bool = Field(False, description=(
        "The answers were refined by a small local search around the agent's box on the checkpoint's repaired "
        "reward: checkpoints of adaptation jobs whose reward repair was kept (`validation.reward` is "
        "`repaired head`) on a grayscale bundle, as the job's guard scored them. false for the base policy, "
        "photo bundles and other checkpoints"))
    results: list[LocalizationResult] = Field(description="One per uploaded image, in upload order")
    kept: list[uuid.UUID] | None = Field(None, description=(
        "With `keep=true`: the ids of the pool images the uploaded images became, in upload order"))


class CocoImage(BaseModel):
    id: int = Field(description="The image's id: `image_ids`' in upload order, else 1, 2, ... in upload order")
    file_name: str | None = Field(description="The uploaded file's name (as sent; null without one)")
    width: int = Field(description="The image's width in pixels, upright")
    height: int = Field(description="The image's height in pixels, upright")


class CocoCategory(BaseModel):
    id: int = Field(description="`category_id` (default 1)")
    name: str = Field(description="The set's name, or `object` for a set without one")


class CocoDetection(BaseModel):
    image_id: int = Field(description="The `id` of its image in `images`")
    category_id: int = Field(description="The `id` of the set's category")
    bbox: list[float] = Field(description="[x, y, width, height] in the full image's pixels")
    score: float = Field(description="The calibrated confidence (higher is better)")


class CocoResults(BaseModel):
    """``format=coco``: ``annotations`` is a COCO results list, what pycocotools' ``COCO.loadRes`` takes."""

    images: list[CocoImage] = Field(description="One per uploaded image, in upload order")
    categories: list[CocoCategory] = Field(description="The set's category: one")
    annotations: list[CocoDetection] = Field(description=(
        "The detections: each image's answer (with `max_instances`, each instance); with `min_confidence`, those not "
        "`found` left out"))


class LabelStudioTask(BaseModel):
    """``format=labelstudio``: one task per image, with one prediction (``rectanglelabels`` in percent)."""

    model_config = ConfigDict(extra="allow")

    data: dict[str, Any] = Field(description="The task's data: `image`, the uploaded file's name")
    predictions: list[dict[str, Any]] = Field(description=(
        "One prediction (`model_version`: the checkpoint's id; `score`: the answer's confidence): `result` holds a "
        "`rectanglelabels` region, in percent of the image, per `found` answer (per instance with `max_instances`)"))


class Progress(BaseModel):
    iteration: int = Field(description="Iterations done (0 while the job sets up: reward repair and probes)")
    total: int = Field(description="Iterations asked for (`params.iterations`)")
    mean_reward: float | None = Field(description=(
        "The mean episode return of the last iteration done (higher is better: the reward is the embedding's "
        "distance gain; a checkpoint's `metrics.mean_reward` is the same number at its iteration); null before the "
        "first"))
    phase: Literal["setup", "adapting", "finishing"] | None = Field(None, description=(
        "What a running job does now: `setup` (reward repair and probes, before iteration 1: about a minute on 2 "
        "CPU cores), `adapting` (the iterations), `finishing` (the last scores, calibrations and the activation); "
        "null when the job is not running"))


class JobParams(BaseModel):
    iterations: int = Field(description="Adaptation iterations asked for (default QLOC_DEFAULT_ITERATIONS)")
    learning_rate: float = Field(description="Adam's learning rate (default QLOC_DEFAULT_LEARNING_RATE)")
    seed: int = Field(description="The seed of the job's random draws: episodes sampled, probes made (default 0)")
    activate: Literal["auto", "true", "false"] = Field(
        description="auto: the best checkpoint, only if it beats the starting policy on the job's probes (on a photo "
                    "bundle the set's labeled examples must agree: pasted probes alone never activate there); "
                    "true: the final checkpoint, whatever the probes say; false: none. A photo bundle's checkpoint "
                    "whose job repaired its reward answers paired with the job's starting policy (QLOC_PAIR_START): "
                    "its own box only where both heads prefer it, the start's elsewhere (QLOC_PAIR_RULE=consensus: "
                    "the answer the start, the job's checkpoints up to this one and this one overlap on most)")
    num_images: int = Field(description="Images the job adapts on: its uploads and the pool images it took")
    num_pool_images: int = Field(0, description=(
        "Of num_images, those taken from the set's pool when the job was created (a snapshot: images added to "
        "the pool later are not the job's)"))
    base_checkpoint_id: uuid.UUID | None = Field(description=(
        "The checkpoint the job started from: the set's active one when it was created"))


class ProbeScore(BaseModel):
    corloc: float = Field(description="% of probes whose answer has IoU >= 0.5 with the known box")
    mean_iou: float = Field(description="Mean IoU of the answers with the known boxes, in [0, 1]")
    n: int = Field(description="Probes scored")


class PolicyScore(BaseModel):
    select: ProbeScore = Field(description="On the probes that choose the checkpoint and decide")
    held: ProbeScore = Field(description="On the held-out probes, which only report")
    labeled: ProbeScore | None = Field(None, description=(
        "On the set's labeled examples alone (also among the probes); null for a set without them"))


class CheckpointScore(PolicyScore):
    iteration: int = Field(description="The checkpoint's iteration")
    gain: float = Field(description="Selection CorLoc minus the starting policy's, in points")
    noise: float = Field(description=(
        "Twice the standard error of that paired difference, in points, and at least one probe's worth (100 / n): "
        "a gain no probe has shown is no gain"))
    held_gain: float = Field(description="Held-out CorLoc minus the starting policy's, in points")
    held_noise: float = Field(description="As `noise`, on the held-out probes")
    labeled_gain: float | None = Field(None, description=(
        "CorLoc on the set's labeled examples minus the starting policy's, in points (null without them)"))
    labeled_noise: float | None = Field(None, description=(
        "As `noise`, on the labeled examples (at least 100 / their number): on a photo (RGB) bundle "
        "`activate=auto` needs `labeled_gain` above it (null without labeled examples, and for jobs made before)"))


class Validation(BaseModel):
    """How the job checked itself: the starting policy and every checkpoint scored on labeled probes."""

    probes: dict[str, int | bool | str] = Field(description=(
        "Probe counts: labeled (the set's boxed examples), synthetic (exemplar crops pasted into the job's images), "
        "select, held; and the rule that applied: `synthetic_confirms` (whether pasted probes may confirm a gain on "
        "their own: grayscale bundles) and `labeled_rule` (`beyond_noise`: the labeled examples must confirm it "
        "beyond their noise; absent for jobs made before)"))
    faithfulness: dict[str, float] = Field(description="How well the reward's embedding orders boxes by overlap "
                                                       "on the probes: OrdAcc (%) and Spearman rho (negative is good)")
    base: PolicyScore = Field(description="The starting policy's scores")
    best: CheckpointScore | None = Field(description=(
        "The checkpoint with the best selection score (null before the first)"))
    checkpoints: list[CheckpointScore] = Field(description="Every checkpoint's scores, by iteration")
    stopped_early: bool = Field(description=(
        "Whether the job stopped before its last iteration because its probes kept falling "
        "(QLOC_EARLY_STOP_PATIENCE)"))
    activated_iteration: int | None = Field(description="The iteration of the checkpoint the job made active, if any")
    activated_checkpoint_id: uuid.UUID | None = Field(None, description=(
        "The checkpoint the job made active, if any (null for jobs made before this field)"))
    message: str = Field(description="The verdict in words: what was measured and what was activated")
    reward: Literal["repaired head", "bundle head"] | None = Field(None, description=(
        "The head of the job's embedding reward: `repaired head` when reward repair (QLOC_REWARD_REPAIR) trained "
        "the projection head on probes and held-out probes confirmed it orders boxes better (its checkpoints then "
        "carry that head and prototype, and localize uses them), else `bundle head`. The policy adapted on it unless "
        "`reward_choice` chose another reward. Null for jobs made before."))
    repair: dict[str, Any] | None = Field(None, description=(
        "What reward repair measured: `kept`, probe OrdAcc / Spearman `before` and `after`, `best_epoch`, "
        "`epochs`, `train_probes`, `val_probes`, `seconds`. Null when repair is off."))
    reward_choice: dict[str, Any] | None = Field(None, description=(
        "The reward the policy adapted on, chosen on the job's selection probes (QLOC_REWARD_CHOICE): `chosen` "
        "(`embedding`: the `reward` head's distance; `ncc`: normalized cross-correlation with the exemplar crops; "
        "`features`: cosine of frozen backbone features), `candidates` (each one's probe `ordacc` and `spearman`), "
        "`current`, `margin`, `rule`, `probes`. Localize still serves with the `reward` head. Null when the choice "
        "is off."))


class AdaptationJobPublic(BaseModel):
    id: uuid.UUID = Field(description="The job's id: the `{job_id}` of its routes")
    exemplar_set_id: uuid.UUID = Field(description="The set the job adapts")
    status: JobState = Field(description="`queued`, `running`, then `succeeded`, `failed` or `canceled`")
    progress: Progress = Field(description="How far the job is")
    checkpoint_id: uuid.UUID | None = Field(description=(
        "The last checkpoint the job wrote (not necessarily the one it activated: "
        "`validation.activated_checkpoint_id`)"))
    error: str | None = Field(description="Why the job failed, or `canceled on request`; null otherwise")
    params: JobParams = Field(description="What the job was asked")
    verdict: Literal["improved", "no better", "worse", "reward unreliable"] | None = Field(
        description="Did adapting make the answers better, by the job's probes (null until it finished)")
    validation: Validation | None = Field(description=(
        "How the job checked itself on its probes; null until it has finished"))
    attempts: int = Field(description=(
        "Runs of the job a worker started (more than 1: it was resumed after a worker died)"))
    cancel_requested: bool = Field(description="Whether `POST /v1/adaptations/{id}/cancel` was called")
    created_at: datetime = Field(description="When the job was queued (UTC)")
    started_at: datetime | None = Field(description="When a worker first started it (UTC); null while queued")
    finished_at: datetime | None = Field(description="When it ended (UTC); null until then")


class AdaptationJobsPublic(Page):
    data: list[AdaptationJobPublic] = Field(description="The page's jobs, oldest first")


class CheckpointPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID = Field(description=(
        "The checkpoint's id: the `{checkpoint_id}` of its routes, and localize's `checkpoint`"))
    exemplar_set_id: uuid.UUID = Field(description="The set it belongs to")
    parent_id: uuid.UUID | None = Field(description="Lineage: the checkpoint this one was trained from")
    job_id: uuid.UUID | None = Field(description="The adaptation job that wrote it; null for the base policy")
    kind: Literal["base", "adapted"] = Field(description=(
        "`base`: the bundle's policy, made with the set; `adapted`: written by an adaptation job"))
    iteration: int = Field(description="The job's iteration it was written at (0 for the base policy)")
    sha256: str = Field(description="sha256 of its file")
    metrics: dict[str, float | int | str | None] = Field(description=(
        "The job's mean reward and the checkpoint's probe scores (`probe_corloc`, `probe_mean_iou`, "
        "`probe_held_corloc`, `probe_gain`, `probe_noise`); `answers` where localize answers with it beside its "
        "job's starting policy (QLOC_PAIR_START): `paired with its start` (QLOC_PAIR_RULE `agree`, the default: its "
        "own box only where both heads prefer it) or `consensus of its start and its job's checkpoints` (`consensus`: "
        "each image's answer is the one the start, the job's earlier checkpoints and this one overlap on most)"))
    active: bool = Field(description="Whether localize uses it by default (`checkpoint=active`)")
    created_at: datetime = Field(description="When it was written (UTC)")


class CheckpointsPublic(Page):
    data: list[CheckpointPublic] = Field(description="The page's checkpoints, oldest first")


class HealthStatus(BaseModel):
    status: Literal["ok"] = Field(description="`ok`: the process answers")


class ReadyStatus(BaseModel):
    status: Literal["ok", "unavailable"] = Field(description=(
        "`ok` when every check passed, else `unavailable` (with a 503)"))
    checks: dict[str, str] = Field(description="Each dependency's state: `ok`, or what is wrong (`error: ...`)")


class PoolImagePublic(BaseModel):
    """An unlabeled image in an exemplar set's pool."""

    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID = Field(description="The image's id: the `{image_id}` of its route")
    exemplar_set_id: uuid.UUID = Field(description="The set whose pool holds it")
    filename: str | None = Field(description="The uploaded file's name (as sent; null without one)")
    content_type: str = Field(description="Its media type (`image/png`, `image/jpeg`, `image/webp`)")
    width: int = Field(description="Width in pixels, upright (EXIF orientation applied)")
    height: int = Field(description="Height in pixels, upright")
    size: int = Field(description="Bytes as uploaded")
    sha256: str = Field(description="sha256 of its bytes as uploaded")
    created_at: datetime = Field(description="When it was added (UTC)")


class PoolState(BaseModel):
    num_pool_images: int = Field(description="Images in the set's pool now")
    pool_bytes: int = Field(description="Their bytes as uploaded")
    max_pool_images: int = Field(description="The cap on images per pool (QLOC_MAX_POOL_IMAGES)")
    max_pool_bytes: int = Field(description="The cap on bytes per pool (QLOC_MAX_POOL_BYTES)")


class PoolImagesPublic(Page, PoolState):
    data: list[PoolImagePublic] = Field(description="The page's images, oldest first")


class PoolImagesAdded(PoolState):
    data: list[PoolImagePublic] = Field(description="The images this request added, in upload order")
