"""Exemplar sets: register crops (-> prototype), list, read, delete, and localize with a set."""

from __future__ import annotations

import json
import logging
import math
import threading
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, HTTPException, Query, Request, Response, UploadFile, status
from fastapi.responses import JSONResponse
from sqlalchemy import select
from sqlalchemy.orm import Session

from app import crud, export, pool
from app.calibration import RERANK_CANDIDATES, calibrate_new_set, judge
from app.config import MAX_INSTANCES, MAX_SAMPLES, Settings
from app.db import begin_read
from app.deps import BundlesDep, Caller, CallerDep, ServingDep, SessionDep, SettingsDep, StoreDep
from app.export import AnswerOptions
from app.images import DecodedImage
from app.inference import (
    BundleMismatch,
    BundleRegistry,
    LoadedBundle,
    UnknownBundle,
    bundle_for_set,
    prototype_to_bytes,
)
from app.metrics import Metrics
from app.remote import MadePrototype, RemoteDep, answer_refusal
from app.routes.errors import UNAUTHORIZED, UPLOAD_ERRORS, error, invalid
from app.routes.pool import add_to_pool
from app.routes.pool import limits as pool_limits
from app.routes.uploads import check_text, read_images
from app.schemas import (
    CocoResults,
    ExemplarSetPublic,
    ExemplarSetsPublic,
    InstanceResult,
    LabelStudioTask,
    LocalizationResult,
    LocalizeResponse,
)
from app.serving import CheckpointRef, InferenceBackend, InferenceRefused, LocalizeCall
from app.storage import BlobStore, exemplar_key, exemplar_set_prefix
from app.tables import Checkpoint, ExemplarSet

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/exemplar-sets", tags=["exemplar-sets"], responses=UNAUTHORIZED)

UNKNOWN = {404: error("Unknown exemplar set")}
NOT_FOUND = "exemplar set not found"

Box = tuple[float, float, float, float]
MIN_BOX_SIDE = 2.0
"""A box must be at least this many pixels wide and high."""
BOXES_FORMAT = "a JSON list of [x1, y1, x2, y2] (4 numbers, in the pixels of the uploaded image), one per file"
BOXES_DESCRIPTION = (
    "Optional: the files are whole images, and this is the object's box in each: " + BOXES_FORMAT + ", in upload "
    "order. Pixels of the full image as a viewer shows it (its EXIF orientation applied: a phone photo stored "
    "sideways is upright): origin top-left, x right, y down; 0 <= x1 < x2 <= width, "
    f"0 <= y1 < y2 <= height, at least {MIN_BOX_SIDE:g} pixels on each side. The crops that make the prototype "
    "are cut from the boxes (edges rounded to the nearest pixel); the whole images are kept, with their boxes, "
    "as the set's labeled examples (`num_labeled`), which adaptation jobs use to check themselves. "
    "Example: `[[10, 20, 60, 90]]`. Absent (or empty): the files are crops.")
NEGATIVES_DESCRIPTION = (
    "Optional: crops of look-alikes the answers should avoid (PNG/JPEG/WebP, checked as `files`; QLOC_INFERENCE=local "
    "only). Their embeddings are kept with the set (`num_negatives`), not the files. They enter the calibration "
    "(pasted into its backgrounds as wrong answers) and, through it, every answer's `confidence`: a box nearer a "
    "look-alike than the exemplars gets a lower one; `rerank=true` on localize also picks the visited box the "
    "calibration likes best. The agent's policy itself is not trained on them.")
THRESHOLD_DESCRIPTION = (
    "Calibrated confidence in [0, 1] from which an answer is `found` (default 0.5: more likely right than "
    "wrong). Localize's `min_confidence` can only raise it per request.")


def to_public(es: ExemplarSet) -> ExemplarSetPublic:
    return ExemplarSetPublic.model_validate(es)


def get_bundle(bundles: BundleRegistry, name: str, *, explicit: bool, exemplar_set: ExemplarSet | None = None
               ) -> LoadedBundle:
    """The bundle installed as ``name``; for an ``exemplar_set``, 409 unless it is the file that made the set."""
    try:
        return bundle_for_set(bundles, exemplar_set) if exemplar_set is not None else bundles.get(name)
    except BundleMismatch as e:
        raise HTTPException(status.HTTP_409_CONFLICT, str(e)) from e
    except UnknownBundle as e:
        if explicit:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(e)) from e
        which = "the set's bundle" if exemplar_set is not None else "default bundle"
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"{which} unavailable: {e}") from e
    except (OSError, ValueError, RuntimeError) as e:
        log.exception("bundle %s cannot be loaded", name)
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"bundle {name!r} cannot be loaded") from e


def set_bundle(bundles: BundleRegistry, es: ExemplarSet) -> LoadedBundle:
    """The bundle of an existing set, refused with 409 if its file was replaced since the set was made."""
    return get_bundle(bundles, es.bundle, explicit=False, exemplar_set=es)


def _unprocessable(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail)


def _number(value: object) -> float | None:
    """A finite JSON number as a float, else None (booleans are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        f = float(value)
    except OverflowError:  # an integer beyond float's range
        return None
    return f if math.isfinite(f) else None


def _fmt(box: Box) -> str:
    return "[" + ", ".join(f"{v:g}" for v in box) + "]"


def parse_boxes(raw: str, images: list[DecodedImage]) -> list[Box]:
    """The ``boxes`` form field -> one box per image, each checked against its image; 422 otherwise, naming the
    file (position and filename) and its size. Writes nothing: called before anything is stored."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; RecursionError: deep nesting
        raise _unprocessable(f"boxes is not JSON ({e}); it must be {BOXES_FORMAT}") from e
    if not isinstance(value, list):
        raise _unprocessable(f"boxes must be {BOXES_FORMAT}; got a JSON {type(value).__name__}")
    if len(value) != len(images):
        n, m = len(value), len(images)
        raise _unprocessable(f"boxes has {n} box{'' if n == 1 else 'es'} for {m} file{'' if m == 1 else 's'}: "
                             "it must have one box per file, in upload order")
    out: list[Box] = []
    for i, (item, im) in enumerate(zip(value, images, strict=True)):
        where = (f"boxes[{i}], for file {i + 1} of {len(images)} ({im.filename or 'upload'!r}, "
                 f"{im.width}x{im.height} pixels)")
        numbers = [_number(v) for v in item] if isinstance(item, list) else []
        if len(numbers) != 4 or any(v is None for v in numbers):
            shown = json.dumps(item)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise _unprocessable(f"{where}: must be [x1, y1, x2, y2], 4 finite numbers; got {shown}")
        box: Box = (numbers[0], numbers[1], numbers[2], numbers[3])  # type: ignore[assignment]
        x1, y1, x2, y2 = box
        if not (x1 < x2 and y1 < y2):
            raise _unprocessable(f"{where}: {_fmt(box)} is not a box: x1 < x2 and y1 < y2 are needed")
        if x1 < 0 or y1 < 0 or x2 > im.width or y2 > im.height:
            raise _unprocessable(f"{where}: {_fmt(box)} is not inside the image: 0 <= x1 < x2 <= {im.width} and "
                                 f"0 <= y1 < y2 <= {im.height} are needed")
        if x2 - x1 < MIN_BOX_SIDE or y2 - y1 < MIN_BOX_SIDE:
            raise _unprocessable(f"{where}: {_fmt(box)} is {x2 - x1:g}x{y2 - y1:g} pixels; a box needs at least "
                                 f"{MIN_BOX_SIDE:g} pixels on each side")
        out.append(box)
    return out


@router.post("", status_code=status.HTTP_201_CREATED, response_model=ExemplarSetPublic, responses={
    **UPLOAD_ERRORS, 422: invalid("Invalid fields, no file, an unknown bundle, or boxes that are not one valid box "
                                  "inside each file"),
    503: error("The default bundle is unavailable, or the bundle cannot be loaded; with QLOC_INFERENCE=workers, also: "
               "no localize worker answered within QLOC_LOCALIZE_TIMEOUT seconds (with `Retry-After`)")})
def create_exemplar_set(
    response: Response, session: SessionDep, settings: SettingsDep, store: StoreDep, bundles: BundlesDep,
    caller: CallerDep, remote: RemoteDep,
    files: Annotated[list[UploadFile], File(description=(
        "1..64 PNG/JPEG/WebP crops of the object sought; with `boxes`, whole images that show it"))],
    name: Annotated[str | None, Form(max_length=200)] = None,
    bundle: Annotated[str | None, Form(max_length=100, description="Model bundle (default: the server's)")] = None,
    boxes: Annotated[str | None, Form(max_length=65_536, description=BOXES_DESCRIPTION)] = None,
    negative_files: Annotated[list[UploadFile] | None, File(description=NEGATIVES_DESCRIPTION)] = None,
    threshold: Annotated[float, Form(ge=0.0, le=1.0, description=THRESHOLD_DESCRIPTION)] = 0.5,
) -> ExemplarSetPublic:
    """Register exemplar crops: their mean embedding becomes the set's prototype.

    With ``boxes``, the files are whole images and the crops are cut from the boxes; the images are kept with
    their boxes as the set's labeled examples. Everything is checked before anything is written."""
    check_text(name, "name")
    images = read_images(files, settings)
    labels: list[Box | None] = list(parse_boxes(boxes, images)) if boxes else [None] * len(images)
    negative_images = read_images(negative_files, settings, keep_data=False) if negative_files else []
    if negative_images and remote is not None:
        raise _unprocessable("negative_files need the model in the API (QLOC_INFERENCE=local): with "
                             "QLOC_INFERENCE=workers the answers' nearness to them cannot be measured")
    if remote is None:  # QLOC_INFERENCE=local: the bundle is loaded here; workers: the worker checks it
        loaded = get_bundle(bundles, bundle or settings.default_bundle, explicit=bundle is not None)
    # A crop from a box is cut from a decode fine enough for it, one image at a time (app.images).
    crops = [im.image if box is None else im.crop(box, max_side=settings.decode_max_side)
             for im, box in zip(images, labels, strict=True)]
    if remote is None:
        prototype = loaded.localizer.prototype(crops)  # [D]
        made = MadePrototype(loaded.name, loaded.sha256, prototype_to_bytes(prototype), int(prototype.numel()))
        examples = [(im.image, im.box_to_decoded(box)) for im, box in zip(images, labels, strict=True) if box]
        calibrated = calibrate_new_set(loaded, prototype, crops, examples, [im.image for im in negative_images],
                                       threshold=threshold)
    else:
        calibrated = None  # no model here: answers get a confidence once an adaptation job calibrates a checkpoint
        try:
            made = remote.prototype(bundle or settings.default_bundle, crops, explicit=bundle is not None)
        except InferenceRefused as e:
            raise answer_refusal(e) from e
    set_id = uuid.uuid4()
    try:
        blobs = []
        for i, im in enumerate(images):
            key = exemplar_key(set_id, i, im.ext)
            sha = store.put(key, im.data)
            blobs.append(crud.NewBlob(i, im.filename, im.content_type, im.width, im.height, sha, key, labels[i]))
        es = crud.create_exemplar_set(session, set_id=set_id, owner=caller.owner, name=name, bundle=made.bundle,
                                      bundle_sha256=made.bundle_sha256, prototype=made.prototype,
                                      prototype_dim=made.prototype_dim, exemplars=blobs, threshold=threshold,
                                      calibration=calibrated.calibration if calibrated else None,
                                      negatives=calibrated.negatives if calibrated else None,
                                      num_negatives=calibrated.num_negatives if calibrated else 0)
        session.commit()
    except BaseException:
        session.rollback()
        store.delete_tree(exemplar_set_prefix(set_id))
        raise
    response.headers["Location"] = f"/v1/exemplar-sets/{set_id}"
    return to_public(es)


@router.get("", response_model=ExemplarSetsPublic)
def list_exemplar_sets(session: SessionDep, caller: CallerDep, limit: Annotated[int, Query(ge=1, le=200)] = 50,
                       offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0) -> ExemplarSetsPublic:
    sets, count = crud.list_exemplar_sets(session, owner=caller.scope, limit=limit, offset=offset)
    return ExemplarSetsPublic(data=[to_public(s) for s in sets], count=count, limit=limit, offset=offset)


@router.get("/{set_id}", response_model=ExemplarSetPublic, responses=UNKNOWN)
def read_exemplar_set(set_id: uuid.UUID, session: SessionDep, caller: CallerDep) -> ExemplarSetPublic:
    es = crud.get_exemplar_set(session, set_id=set_id, owner=caller.scope)
    if es is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, NOT_FOUND)
    return to_public(es)


@router.delete("/{set_id}", status_code=status.HTTP_204_NO_CONTENT,
               responses={**UNKNOWN, 409: error("The set has queued or running jobs")})
def delete_exemplar_set(set_id: uuid.UUID, session: SessionDep, store: StoreDep, caller: CallerDep) -> Response:
    """Delete the set with its exemplars, jobs and checkpoints (rows, then files)."""
    es = crud.get_exemplar_set(session, set_id=set_id, owner=caller.scope)
    if es is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, NOT_FOUND)
    if crud.has_unfinished_jobs(session, set_id=set_id):
        raise HTTPException(status.HTTP_409_CONFLICT, "the set has queued or running adaptation jobs: cancel them")
    crud.delete_exemplar_set(session, set_id=set_id)
    session.commit()
    store.delete_tree(exemplar_set_prefix(set_id))
    return Response(status_code=status.HTTP_204_NO_CONTENT)


CheckpointQuery = Annotated[str, Query(
    pattern=r"^(active|base|[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12})$",
    description="`active` (default), `base` (the bundle's own policy) or a checkpoint id of this set")]


def resolve_checkpoint(session: Session, es: ExemplarSet, which: str, *, active: Checkpoint | None = None
                       ) -> Checkpoint:
    """The checkpoint ``which`` names in ``es``. ``active``: the set's active checkpoint where the caller read it
    with the set (``crud.get_exemplar_set_and_active``): then ``active`` costs no query."""
    if which == "active" and active is not None and active.id == es.active_checkpoint_id:
        ckpt = active
    elif which == "active" and es.active_checkpoint_id is not None:
        ckpt = session.get(Checkpoint, es.active_checkpoint_id)
    elif which in ("active", "base"):
        ckpt = session.scalars(select(Checkpoint).where(Checkpoint.exemplar_set_id == es.id,
                                                        Checkpoint.kind == "base")).first()
    else:
        ckpt = session.get(Checkpoint, uuid.UUID(which))
    if ckpt is None or ckpt.exemplar_set_id != es.id:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "checkpoint not found in this exemplar set")
    return ckpt


@router.post("/{set_id}/localize", response_model=LocalizeResponse | CocoResults | list[LabelStudioTask],
             response_model_exclude_none=True, responses={
    **UPLOAD_ERRORS, 404: error("Unknown exemplar set, or a checkpoint not in this set"),
    409: error("The set's bundle file was replaced since the set (or the checkpoint) was made: re-create the set; "
               "or, with keep=true, the set's image pool has no room for the images (nothing computed or stored)"),
    422: invalid("Invalid fields, or no file"),
    503: error("The set's bundle or checkpoint cannot be loaded; or the model is busy: more images than "
               "QLOC_INFERENCE_QUEUE_IMAGES would wait for it, answered at once with `Retry-After` (retry then); "
               "with QLOC_INFERENCE=workers, also: no localize worker answered within QLOC_LOCALIZE_TIMEOUT "
               "seconds (with `Retry-After`)")})
def localize(
    set_id: uuid.UUID, request: Request, serving: ServingDep, caller: CallerDep,
    files: Annotated[list[UploadFile], File(description=(
        "Images to search (PNG/JPEG/WebP, any size up to the limits; not animated). Each is seen upright (its EXIF "
        "orientation applied) and decoded downscaled to QLOC_DECODE_MAX_SIDE; `width`, `height` and every box "
        "are in the full upright image's pixels"))],
    checkpoint: CheckpointQuery = "active",
    trajectory: Annotated[bool, Query(description="Also return every box of the agent's episode")] = False,
    samples: Annotated[int | None, Query(ge=0, le=MAX_SAMPLES, description=(
        "Best-of-N search: this many sampled episodes per image besides the greedy one; each image keeps the "
        "episode whose final box is nearest the exemplars (lowest score). Repeatable (seeded); about N+1 "
        "times the agent's work, the backbone still runs once per image. Default: the server's setting "
        "(QLOC_LOCALIZE_SAMPLES, 0 = greedy only)."))] = None,
    nearest: Annotated[bool | None, Query(description=(
        "Answer with the box the episode visited that is nearest the exemplars (lowest score), not with its "
        "last box: the agent may walk past the object, on classes it was not trained on above all. Costs one "
        "head evaluation per step. With samples, over every visited box of every episode. Default: the "
        "server's setting (QLOC_LOCALIZE_NEAREST) if set, else the bundle's own (on for photo bundles)."))] = None,
    keep: Annotated[bool, Query(description=(
        "Also add the posted images to the set's image pool (`/v1/exemplar-sets/{id}/images`), for adaptation "
        "jobs on the pool; their ids come back in `kept`. Opt-in, under the pool's caps: a pool without room for "
        "them answers 409 before anything is computed or stored; only an answered request stores its images."))]
    = False,
    min_confidence: Annotated[float | None, Query(ge=0.0, le=1.0, description=(
        "Raise the set's threshold for this request: an answer whose calibrated `confidence` is below it comes "
        "back with `found=false` (its box is kept; `format=coco` then leaves it out, `format=labelstudio` gives "
        "it an empty result). No effect on a set without calibration (confidence null, found true)."))] = None,
    rerank: Annotated[bool, Query(description=(
        "Answer with the candidate the set's calibration finds most likely right, among the several-instances "
        "candidates (at least 4 per image, as `max_instances`), not the agent's own answer; `score` and "
        "`confidence` are then that box's. With a grayscale bundle's calibration (NCC with the exemplars) and "
        "negative exemplars: the box most like the exemplars and least like the look-alikes (cMNIST 4-vs-9: CorLoc "
        "46.7 -> 78.7, BENCHMARKS.md). No effect on a set without a calibration."))] = False,
    max_instances: Annotated[int, Query(ge=1, le=MAX_INSTANCES, description=(
        "Up to this many objects per image, in `results[i].instances`, best (lowest score) first: the agent's "
        "answer, and episodes started from the best windows of a coarse ranking, none overlapping another by more "
        "than IoU 0.3 (the backbone still runs once per image). 1 (default): the one answer, no `instances`. "
        "`format=coco` / `labelstudio` then export every instance"))] = 1,
    format: Annotated[Literal["json", "coco", "labelstudio"], Query(description=(
        "`json` (default): this response. `coco`: COCO detection results, `{images, categories, annotations}`, "
        "`annotations` ready for pycocotools' `COCO.loadRes` (`bbox` [x, y, w, h], `score` = confidence), "
        "`images` mapping `image_ids` to filenames. `labelstudio`: Label Studio tasks with `predictions` "
        "(`rectanglelabels` in percent of the image). README: Output formats."))] = "json",
    image_ids: Annotated[str | None, Query(max_length=20_000, pattern=r"^\d{1,12}(,\d{1,12})*$", description=(
        "format=coco: the COCO image id of each file, comma-separated, in upload order (default 1..N)"))] = None,
    category_id: Annotated[int, Query(ge=0, le=2**31 - 1, description="format=coco: the category id")] = 1,
    label: Annotated[str | None, Query(max_length=200, description=(
        "format=labelstudio: the rectangle's label (default: the set's name, else `object`); `from_name` / "
        "`to_name` are `label` / `image`, as Label Studio's bounding-box template"))] = None,
) -> Response:
    """Localize the set's object in each image: one box per image, in the pixels of the full image as a viewer
    shows it (EXIF orientation applied), whatever resolution it was analysed at.

    A set is served only by the bundle file that made its prototype: once another file is installed under
    the bundle's name, it answers 409 (re-create the set from its crops) until that file is back."""
    # The session is opened here, on this request's thread, not by ``SessionDep``: a sync generator
    # dependency is entered and left on threads of their own (two thread hops per request, which one
    # client's latency felt). The set and checkpoint are read on every request (no cache): a checkpoint
    # activated by a worker process, or a set deleted by another API process, is seen at once.
    opts = AnswerOptions(min_confidence, rerank, format, image_ids, category_id, label)
    with request.app.state.session_factory() as session:
        done = localize_files(session, set_id, serving.settings, serving.inference, caller, serving.metrics,
                              serving.store, files, RunOptions(checkpoint, trajectory, samples, nearest, keep,
                                                               max_instances), opts,
                              bundles=serving.bundles, local=serving.local, turns=serving.turns)
    return formatted(done, opts)


@dataclass(frozen=True)
class RunOptions:
    """What a localize request runs (its query parameters but the answer's format)."""

    checkpoint: str = "active"
    trajectory: bool = False
    samples: int | None = None
    """``None``: the server's QLOC_LOCALIZE_SAMPLES."""
    nearest: bool | None = None
    keep: bool = False
    max_instances: int = 1


@dataclass
class Localized:
    """A localize request answered: the set and checkpoint that served it, and one result per image."""

    exemplar_set: ExemplarSet
    checkpoint: Checkpoint
    samples: int
    nearest: bool
    results: list[LocalizationResult]
    kept: list[uuid.UUID] | None
    refined: bool = False


def formatted(done: Localized, opts: AnswerOptions) -> Response:
    """A localize answer in the asked format (``json``: ``LocalizeResponse``)."""
    es, ckpt, results = done.exemplar_set, done.checkpoint, done.results
    if opts.format == "coco":
        return JSONResponse(export.coco(results, image_ids=opts.ids(len(results)), category_id=opts.category_id,
                                        category_name=es.name or "object", only_found=opts.min_confidence is not None))
    if opts.format == "labelstudio":
        return JSONResponse(export.labelstudio(results, label=opts.label or es.name or "object", from_name="label",
                                               to_name="image", model_version=str(ckpt.id)))
    body = LocalizeResponse(
        exemplar_set_id=es.id, checkpoint_id=ckpt.id, bundle=es.bundle, samples=done.samples,
        nearest=done.nearest, refined=done.refined, kept=done.kept, results=results)
    # Serialized once, here (what ``response_model_exclude_none`` gives); returned as is, FastAPI would dump,
    # validate and serialize the model again.
    return Response(body.model_dump_json(exclude_none=True), media_type="application/json")


def localize_files(session: Session, set_id: uuid.UUID, settings: Settings, inference: InferenceBackend,  # noqa: PLR0913
                   caller: Caller, metrics: Metrics, store: BlobStore, files: list[UploadFile], run: RunOptions,
                   opts: AnswerOptions, *, bundles: BundleRegistry | None = None, local: bool = True,
                   turns: threading.BoundedSemaphore | None = None) -> Localized:
    """Localize the set's object in uploaded ``files`` (the pipeline of every way in: the localize route, Label
    Studio's /predict): decode, the inference backend, the calibration's verdict, the pool (``keep``).

    ``turns`` (``QLOC_ROUTE_THREADS``) bounds how many threads run its reads and verdicts at once: Python runs
    one thread at a time, and many threads handing its lock to one another cost more CPU than the work. Decoding,
    the model and the pool's writes take no turn (they mostly wait, or release the lock)."""
    checkpoint, trajectory, samples, nearest, keep = run.checkpoint, run.trajectory, run.samples, run.nearest, run.keep
    turn = turns if turns is not None else nullcontext()
    with turn:
        if not session.in_transaction():  # it reads until the commit below (keep=true writes in its own transaction)
            begin_read(session)
        found = crud.get_exemplar_set_and_active(session, set_id=set_id, owner=caller.scope)
        if found is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, NOT_FOUND)
        es, active = found
        ckpt = resolve_checkpoint(session, es, checkpoint, active=active)
        session.commit()  # end the read transaction before the slow part
    if opts.format == "coco" and opts.image_ids is not None and len(opts.ids(0)) != len(files):
        raise _unprocessable(f"image_ids has {len(opts.ids(0))} ids for {len(files)} files: one per file, in "
                             "upload order")
    calibration, calibration_key = ((ckpt.calibration, ("checkpoint", ckpt.id)) if ckpt.calibration is not None
                                    else (es.calibration, ("set", es.id)))
    use_negatives = es.negatives is not None and calibration is not None and local and bundles is not None
    rerank = opts.rerank and calibration is not None  # among several candidates: the instances
    n_samples = settings.localize_samples if samples is None else samples
    images = read_images(files, settings, keep_data=keep)  # decoded downscaled; boxes mapped back below
    if keep:  # a full pool is refused before the work (add_to_pool decides for good after it)
        try:
            pool.check_room(es, images, pool_limits(settings))
        except pool.PoolFull as e:
            raise HTTPException(status.HTTP_409_CONFLICT, str(e)) from e
    metrics.localize_batch.observe(len(images))
    call = LocalizeCall(
        bundle=es.bundle, bundle_sha256=es.bundle_sha256, prototype_dim=es.prototype_dim, prototype=es.prototype,
        checkpoint=None if ckpt.kind == "base" else CheckpointRef(ckpt.id, ckpt.blob or "", ckpt.sha256),
        images=[im.image for im in images], trajectory=trajectory, samples=n_samples, nearest=nearest,
        max_instances=max(run.max_instances, RERANK_CANDIDATES) if rerank else run.max_instances)
    try:
        answer = inference.localize(call)
    except InferenceRefused as e:
        raise HTTPException(e.status_code, e.detail, headers=e.headers) from e
    with turn:
        judged = judge(answer.results, call.images, calibration, threshold=es.threshold,
                       min_confidence=opts.min_confidence, prototype=es.prototype,
                       loaded=set_bundle(bundles, es) if use_negatives and bundles is not None else None,
                       negatives=es.negatives if use_negatives else None, rerank_boxes=rerank,
                       calibration_key=calibration_key)
    for j in judged:  # rerank's candidates, beyond what was asked for (the first K of a larger search are its own)
        if j.instances is not None:
            j.instances = None if run.max_instances == 1 else j.instances[:run.max_instances]
    kept = [r.id for r in add_to_pool(session, store, settings, es, images)] if keep else None
    results = [LocalizationResult(filename=im.filename, width=im.width, height=im.height,
                                  box=list(im.box_to_full(j.box)), score=j.score, confidence=j.confidence,
                                  found=j.found,
                                  trajectory=[list(im.box_to_full(b)) for b in r.trajectory] if trajectory else None,
                                  instances=None if j.instances is None else [
                                      InstanceResult(box=list(im.box_to_full(i.box)), score=i.score,
                                                     confidence=i.confidence, found=i.found) for i in j.instances])
               for im, r, j in zip(images, answer.results, judged, strict=True)]
    return Localized(es, ckpt, n_samples, answer.nearest, results, kept, answer.refined)
