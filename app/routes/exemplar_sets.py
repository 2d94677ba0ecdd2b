"""Exemplar sets: register crops (-> prototype), list, read, delete (localizing with one: ``app.routes.localize``)."""

from __future__ import annotations

import json
import logging
import math
import uuid
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, File, Form, HTTPException, Response, UploadFile, status
from sqlalchemy.orm import Session

from app import crud
from app.bundle_choice import bundle_of_new_set
from app.calibration import NewSetCalibration, calibrate_new_set
from app.config import Settings
from app.deps import BundlesDep, Caller, CallerDep, Limit, Offset, SessionDep, SetId, SettingsDep, StoreDep
from app.images import DecodedImage
from app.inference import (
    BundleMismatch,
    BundleRegistry,
    LoadedBundle,
    UnknownBundle,
    bundle_for_set,
    prototype_to_bytes,
)
from app.remote import MadePrototype, RemoteDep, WorkerInference, answer_refusal
from app.routes.errors import JSON_TOO_LARGE, UNAUTHORIZED, UPLOAD_ERRORS, error, invalid, unavailable
from app.routes.uploads import check_text, read_images
from app.schemas import (
    ExemplarSetChange,
    ExemplarSetPublic,
    ExemplarSetsPublic,
)
from app.serving import InferenceRefused
from app.storage import BlobStore, exemplar_key, exemplar_set_prefix
from app.tables import ExemplarSet

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
    "Example: `[[10, 20, 60, 90]]`. Absent: the files are crops (an empty value is refused: leave the field out).")
NEGATIVES_DESCRIPTION = (
    "Optional: crops of look-alikes the answers should avoid (PNG/JPEG/WebP, checked as `files`). Their embeddings "
    "are kept with the set (`num_negatives`), not the files. They enter the calibration "
    "(pasted into its backgrounds as wrong answers) and, through it, every answer's `confidence`: a box nearer a "
    "look-alike than the exemplars gets a lower one; `rerank=true` on localize also picks the visited box the "
    "calibration likes best. The agent's policy itself is not trained on them.")
BUNDLE_DESCRIPTION = (
    "Model bundle (`GET /v1/bundles`). Default: the server's (`default`), or for exemplar crops that look like photos "
    "(in continuous tones, in color or gray, at any size; or in color and 100 pixels or more) its photo default "
    "(`default_photo`) when installed: the set's `bundle` says which it got.")
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


def unprocessable(detail: str) -> HTTPException:
    """A 422 naming what to fix."""
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
        raise unprocessable(f"boxes is not JSON ({e}); it must be {BOXES_FORMAT}") from e
    if not isinstance(value, list):
        raise unprocessable(f"boxes must be {BOXES_FORMAT}; got a JSON {type(value).__name__}")
    if value and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        flat = "[" + ", ".join(json.dumps(v) for v in value[:8]) + ("" if len(value) <= 8 else ", ...") + "]"
        raise unprocessable(f"boxes is a list of numbers, {flat}: it must be {BOXES_FORMAT}, a list of boxes even "
                            f"for one file (for one file: [{flat}])")
    if len(value) != len(images):
        n, m = len(value), len(images)
        raise unprocessable(f"boxes has {n} box{'' if n == 1 else 'es'} for {m} file{'' if m == 1 else 's'}: "
                             "it must have one box per file, in upload order")
    out: list[Box] = []
    for i, (item, im) in enumerate(zip(value, images, strict=True)):
        where = (f"boxes[{i}], for file {i + 1} of {len(images)} ({im.filename or 'upload'!r}, "
                 f"{im.width}x{im.height} pixels)")
        numbers = [_number(v) for v in item] if isinstance(item, list) else []
        if len(numbers) != 4 or any(v is None for v in numbers):
            shown = json.dumps(item)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise unprocessable(f"{where}: must be [x1, y1, x2, y2], 4 finite numbers; got {shown}")
        box: Box = (numbers[0], numbers[1], numbers[2], numbers[3])  # type: ignore[assignment]
        x1, y1, x2, y2 = box
        if not (x1 < x2 and y1 < y2):
            raise unprocessable(f"{where}: {_fmt(box)} is not a box: x1 < x2 and y1 < y2 are needed")
        if x1 < 0 or y1 < 0 or x2 > im.width or y2 > im.height:
            raise unprocessable(f"{where}: {_fmt(box)} is not inside the image: 0 <= x1 < x2 <= {im.width} and "
                                 f"0 <= y1 < y2 <= {im.height} are needed")
        if x2 - x1 < MIN_BOX_SIDE or y2 - y1 < MIN_BOX_SIDE:
            raise unprocessable(f"{where}: {_fmt(box)} is {x2 - x1:g}x{y2 - y1:g} pixels; a box needs at least "
                                 f"{MIN_BOX_SIDE:g} pixels on each side")
        out.append(box)
    return out


def check_crops(images: list[DecodedImage], field: str) -> list[Box | None]:
    """Crops (files without ``boxes``, ``negative_files``) must be as large as a box: at least ``MIN_BOX_SIDE``
    pixels on each side, else 422 naming the file. -> one ``None`` (no box) per crop."""
    for i, im in enumerate(images):
        if im.width < MIN_BOX_SIDE or im.height < MIN_BOX_SIDE:
            raise unprocessable(f"{field}: file {i + 1} of {len(images)} ({im.filename or 'upload'!r}) is "
                                 f"{im.width}x{im.height} pixels; a crop needs at least {MIN_BOX_SIDE:g} pixels on "
                                 "each side (or send the whole image with its box in `boxes`)")
    return [None] * len(images)


@router.post("", status_code=status.HTTP_201_CREATED, response_model=ExemplarSetPublic, responses={
    **UPLOAD_ERRORS, 422: invalid("Invalid fields, no file, an unknown bundle, or boxes that are not one valid box "
                                  "inside each file, or a field the route does not take"),
    503: unavailable("The default bundle is unavailable, or the bundle cannot be loaded; with "
                     "QLOC_INFERENCE=workers, also: no localize worker answered within QLOC_LOCALIZE_TIMEOUT "
                     "seconds (with `Retry-After`)")})
def create_exemplar_set(
    response: Response, session: SessionDep, settings: SettingsDep, store: StoreDep, bundles: BundlesDep,
    caller: CallerDep, remote: RemoteDep,
    files: Annotated[list[UploadFile], File(min_length=1, description=(
        "1..64 PNG/JPEG/WebP crops of the object sought (at least 2 pixels on each side); with `boxes`, whole images "
        "that show it"))],
    name: Annotated[str | None, Form(max_length=200, description=(
        "A name for the set (trimmed; COCO's category and Label Studio's label default to it)"))] = None,
    bundle: Annotated[str | None, Form(max_length=100, description=BUNDLE_DESCRIPTION)] = None,
    boxes: Annotated[str | None, Form(max_length=65_536, description=BOXES_DESCRIPTION)] = None,
    negative_files: Annotated[list[UploadFile] | None, File(min_length=1, description=NEGATIVES_DESCRIPTION)] = None,
    threshold: Annotated[float, Form(ge=0.0, le=1.0, allow_inf_nan=False, description=THRESHOLD_DESCRIPTION)] = 0.5,
) -> ExemplarSetPublic:
    """Register exemplar crops: their mean embedding becomes the set's prototype.

    With ``boxes``, the files are whole images and the crops are cut from the boxes; the images are kept with
    their boxes as the set's labeled examples. Everything is checked before anything is written."""
    return add_exemplar_set(SetForm(files, name, bundle, boxes, negative_files or [], threshold), response,
                            session, settings, store, bundles, caller, remote)


@dataclass(frozen=True)
class SetForm:
    """A new set's files and fields, as the route took them (``None``: not given)."""

    files: list[UploadFile]
    name: str | None
    bundle: str | None
    boxes: str | None
    negative_files: list[UploadFile]
    threshold: float


def add_exemplar_set(form: SetForm, response: Response, session: Session, settings: Settings, store: BlobStore,
                     bundles: BundleRegistry, caller: Caller, remote: WorkerInference | None) -> ExemplarSetPublic:
    """The set of ``create_exemplar_set``: every file and field checked, the prototype (and calibration) made, then
    its files and rows written, all or none."""
    name, bundle, boxes, negative_files = form.name, form.bundle, form.boxes, form.negative_files
    check_text(name, "name")
    threshold = form.threshold + 0.0  # -0 is stored and shown as 0
    images = read_images(form.files, settings)
    labels: list[Box | None] = list(parse_boxes(boxes, images)) if boxes else check_crops(images, "files")
    negative_images = read_images(negative_files, settings, keep_data=False) if negative_files else []
    check_crops(negative_images, "negative_files")
    # A crop from a box is cut from a decode fine enough for it, one image at a time (app.images).
    crops = [im.image if box is None else im.crop(box, max_side=settings.decode_max_side)
             for im, box in zip(images, labels, strict=True)]
    name_of_bundle = bundle_of_new_set(bundle, crops, default=settings.default_bundle,
                                       photo_default=settings.default_photo_bundle, installed=bundles.names())
    if remote is None:  # QLOC_INFERENCE=local: the bundle is loaded here; workers: the worker checks it
        loaded = get_bundle(bundles, name_of_bundle, explicit=bundle is not None)
    examples = [(im.image, im.box_to_decoded(box)) for im, box in zip(images, labels, strict=True) if box]
    if remote is None:
        prototype = loaded.localizer.prototype(crops)  # [D]
        made = MadePrototype(loaded.name, loaded.sha256, prototype_to_bytes(prototype), int(prototype.numel()))
        calibrated = calibrate_new_set(loaded, prototype, crops, examples, [im.image for im in negative_images],
                                       threshold=threshold, verifier=bundles.verifier(loaded.name),
                                       samples=settings.calibration_samples)
    else:  # no model here: the worker makes the prototype and fits the calibration, as above
        try:
            made = remote.prototype(name_of_bundle, crops, explicit=bundle is not None,
                                    examples=examples, threshold=threshold,
                                    negatives=[im.image for im in negative_images])
        except InferenceRefused as e:
            raise answer_refusal(e) from e
        calibrated = None if made.calibration is None else NewSetCalibration(made.calibration, made.negatives,
                                                                             made.num_negatives)
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
def list_exemplar_sets(session: SessionDep, caller: CallerDep, limit: Limit = 50,
                       offset: Offset = 0) -> ExemplarSetsPublic:
    sets, count = crud.list_exemplar_sets(session, owner=caller.scope, limit=limit, offset=offset)
    return ExemplarSetsPublic(data=[to_public(s) for s in sets], count=count, limit=limit, offset=offset)


@router.get("/{set_id}", response_model=ExemplarSetPublic, responses=UNKNOWN)
def read_exemplar_set(set_id: SetId, session: SessionDep, caller: CallerDep) -> ExemplarSetPublic:
    es = crud.get_exemplar_set(session, set_id=set_id, owner=caller.scope)
    if es is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, NOT_FOUND)
    return to_public(es)


@router.patch("/{set_id}", response_model=ExemplarSetPublic,
              responses={**UNKNOWN, **JSON_TOO_LARGE,
                         415: error("The body is not JSON (Content-Type: application/json)"),
                         422: invalid("Unknown field, a value out of range, or nothing to change")})
def update_exemplar_set(set_id: SetId, change: ExemplarSetChange, session: SessionDep,
                        caller: CallerDep) -> ExemplarSetPublic:
    """Rename the set, or change the confidence from which its answers are `found` (JSON body, e.g.
    `{"threshold": 0.3}`): no new set, no new calibration; its checkpoints, jobs and pool stay."""
    return change_set(set_id, change, session, caller)


def change_set(set_id: uuid.UUID, change: ExemplarSetChange, session: Session, caller: Caller) -> ExemplarSetPublic:
    """The change of ``update_exemplar_set``: 422 for an empty one or a name PostgreSQL refuses, 404 for another
    key's or no set; only the fields given change."""
    given = change.model_fields_set
    if not given:
        raise unprocessable("nothing to change: send a JSON object with `name` and/or `threshold`")
    check_text(change.name, "name")
    es = crud.get_exemplar_set(session, set_id=set_id, owner=caller.scope)
    if es is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, NOT_FOUND)
    if "name" in given:
        es.name = change.name
    if change.threshold is not None:
        es.threshold = change.threshold
    session.commit()
    return to_public(es)


@router.delete("/{set_id}", status_code=status.HTTP_204_NO_CONTENT,
               responses={**UNKNOWN, 409: error("The set has queued or running jobs")})
def delete_exemplar_set(set_id: SetId, session: SessionDep, store: StoreDep, caller: CallerDep) -> Response:
    """Delete the set with its exemplars, jobs and checkpoints (rows, then files)."""
    delete_set(set_id, session, store, caller)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


def delete_set(set_id: uuid.UUID, session: Session, store: BlobStore, caller: Caller) -> None:
    """The deletion of ``delete_exemplar_set``: 404 for another key's or no set, 409 while a job of it is queued or
    running (naming them, and what to do), else its rows, then its files."""
    es = crud.get_exemplar_set(session, set_id=set_id, owner=caller.scope)
    if es is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, NOT_FOUND)
    jobs = crud.unfinished_jobs(session, set_id=set_id)
    if jobs:
        shown = ", ".join(f"{j}{' (cancel requested: ending)' if asked else ''}" for j, asked in jobs[:5])
        more = f", and {len(jobs) - 5} more" if len(jobs) > 5 else ""
        waiting = all(asked for _, asked in jobs)
        they, them = ("it", "it") if len(jobs) == 1 else ("they", "them")
        raise HTTPException(status.HTTP_409_CONFLICT, (
            f"the set has {len(jobs)} queued or running adaptation job{'s' if len(jobs) > 1 else ''} ({shown}{more}): "
            + (f"wait until {they} {'has' if len(jobs) == 1 else 'have'} ended (GET /v1/adaptations/{{job_id}}), then "
               "delete again" if waiting else
               f"cancel {them} (POST /v1/adaptations/{{job_id}}/cancel) and wait until {they} "
               f"{'has' if len(jobs) == 1 else 'have'} ended, then delete again")))
    crud.delete_exemplar_set(session, set_id=set_id)
    session.commit()
    store.delete_tree(exemplar_set_prefix(set_id))
