"""Localize with an exemplar set: ``POST /v1/exemplar-sets/{id}/localize``, and the pipeline every way in shares
(``localize_files``: this route, Label Studio's /predict): decode, the inference backend, the calibration's
verdict, the pool, the answer's format."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial
from typing import Annotated, Literal, ParamSpec, TypeVar

import torch
from fastapi import APIRouter, File, HTTPException, Query, Request, Response, UploadFile, status
from fastapi.responses import JSONResponse
from pydantic import BeforeValidator
from sqlalchemy import select
from sqlalchemy.orm import Session

from app import crud, export, pool
from app.calibration import (
    RERANK_CANDIDATES,
    TEMPLATE_BAR,
    Judged,
    decoded,
    doubtful,
    doubtful_by_pixels,
    judge,
    matched_windows,
    second_look,
)
from app.config import MAX_INSTANCES, MAX_SAMPLES, Settings
from app.db import begin_read
from app.deps import Caller, CallerDep, ServingDep, SetId
from app.export import AnswerOptions
from app.inference import BundleRegistry
from app.metrics import Metrics
from app.remote import WorkerInference
from app.routes.errors import UNAUTHORIZED, UPLOAD_ERRORS, error, invalid, unavailable
from app.routes.exemplar_sets import NOT_FOUND, set_bundle, unprocessable
from app.routes.pool import add_to_pool
from app.routes.pool import limits as pool_limits
from app.routes.uploads import check_text, read_images
from app.schemas import CocoResults, InstanceResult, LabelStudioTask, LocalizationResult, LocalizeResponse, Rerank
from app.serving import CheckpointRef, InferenceBackend, InferenceRefused, LocalizeAnswer, LocalizeCall, on_its_way
from app.storage import BlobStore
from app.tables import Checkpoint, ExemplarSet
from models.instances import kept_apart
from models.verifier import KindVerifier

P = ParamSpec("P")
T = TypeVar("T")

router = APIRouter(prefix="/v1/exemplar-sets", tags=["exemplar-sets"], responses=UNAUTHORIZED)

def _checkpoint_name(v: object) -> object:
    """``active``, ``base`` (any case) or a checkpoint id in any spelling the path's ids take -> ``active``,
    ``base`` or the id's canonical form; anything else a ValueError in plain words (not the pattern)."""
    if not isinstance(v, str):
        return v
    if v.lower() in ("active", "base"):
        return v.lower()
    try:
        return str(uuid.UUID(v))
    except ValueError:
        raise ValueError("checkpoint is `active`, `base` or a checkpoint id of this set (a UUID, as "
                         "GET /v1/exemplar-sets/{id}/checkpoints lists them)") from None


CheckpointQuery = Annotated[str, BeforeValidator(_checkpoint_name), Query(
    max_length=100, description="`active` (default), `base` (the bundle's own policy) or a checkpoint id of this set")]


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
    200: {"headers": {"X-Qloc-Kept": {"description": "With keep=true and format=coco or labelstudio (whose body has "
                                                     "no `kept`): the pool ids of the kept images, comma-separated, "
                                                     "in upload order", "schema": {"type": "string"}}}},
    **UPLOAD_ERRORS, 404: error("Unknown exemplar set, or a checkpoint not in this set"),
    409: error("The set's bundle file was replaced since the set (or the checkpoint) was made: re-create the set; "
               "or, with keep=true, the set's image pool has no room for the images (nothing computed or stored)"),
    422: invalid("Invalid fields, no file, or a parameter or field the route does not take"),
    503: unavailable("The set's bundle or checkpoint cannot be loaded; or the model is busy: more images than "
               "QLOC_INFERENCE_QUEUE_IMAGES would wait for it, answered at once with `Retry-After` (retry then); "
               "with QLOC_INFERENCE=workers, also: no localize worker answered within QLOC_LOCALIZE_TIMEOUT "
               "seconds (with `Retry-After`)")})
def localize(
    set_id: SetId, request: Request, serving: ServingDep, caller: CallerDep,
    files: Annotated[list[UploadFile], File(min_length=1, description=(
        "Images to search (PNG/JPEG/WebP, any size up to the limits; not animated), at most "
        "QLOC_MAX_FILES_PER_REQUEST (64 by default) per request. Each is seen upright (its EXIF "
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
        "jobs on the pool; their ids come back in `kept` (with `format=coco` / `labelstudio`, in the `X-Qloc-Kept` "
        "header, comma-separated, in upload order). Opt-in, under the pool's caps: a pool without room for them "
        "answers 409 before anything is computed or stored; only an answered request stores its images."))]
    = False,
    min_confidence: Annotated[float | None, Query(ge=0.0, le=1.0, allow_inf_nan=False, description=(
        "This request's bar in place of the set's threshold (higher or lower): an answer whose calibrated "
        "`confidence` is below it comes back with `found=false` (its box is kept; `format=coco` then leaves it "
        "out, `format=labelstudio` gives it an empty result), and instances below it are left out. No effect on a "
        "set without calibration (confidence null, found true)."))] = None,
    rerank: Annotated[Rerank, Query(description=(
        "Which box answers, on a set with a calibration. `false`: the agent's own answer. `true`: the candidate "
        "the calibration finds most likely right among the several-instances candidates (at least 4 per image, as "
        "`max_instances`; about 7x the work); with a grayscale bundle's calibration (NCC with the exemplars) and "
        "negative exemplars, the box most like the exemplars and least like the look-alikes (cMNIST 4-vs-9: "
        "CorLoc 46.7 -> 78.7, BENCHMARKS.md). `templates` (default): a second look only where it is needed, on "
        "grayscale bundles' sets: an answer whose confidence is below 0.25 is replaced by the likeliest of its "
        "candidates that reaches 0.5 (`reranked: true` on that result; these bars do not follow the set's "
        "threshold, which decides `found` only); the candidates "
        "are the several-instances search's 4 and template matching's best window (your crops at their uploaded "
        "size, 5 scales), the window only if its confidence reaches 0.8. New kinds of objects before any "
        "adaptation job: CorLoc 71.6 -> 87.5 on validation glyphs (after a job 98.9 -> 99.1), a few more false "
        "`found` where the object is absent (BENCHMARKS.md). The other answers, and every answer of a photo "
        "bundle's set, are the agent's. `auto`: the same second look without the window (the default before; sets "
        "made before crops were kept answer so). The window is never listed among `instances`. `score` and "
        "`confidence` are always the returned box's. No effect on a set without a calibration."))] = "templates",
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
    label: Annotated[str | None, Query(min_length=1, max_length=200, description=(
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
    if label is not None and not label.strip():
        raise unprocessable("label is empty: give the rectangle's label, or leave label out for the set's name")
    check_text(label, "label")
    opts = AnswerOptions(min_confidence, rerank, format, image_ids, category_id, label)
    check_format_options(opts, set(request.query_params), trajectory=trajectory)
    with request.app.state.session_factory() as session:
        done = localize_files(session, set_id, serving.settings, serving.inference, caller, serving.metrics,
                              serving.store, files, RunOptions(checkpoint, trajectory, samples, nearest, keep,
                                                               max_instances), opts,
                              bundles=serving.bundles, local=serving.local, turns=serving.turns)
    return formatted(done, opts)


def apart(judged: list[Judged]) -> None:
    """Each result's instances without those mostly inside or around a better one (``models.instances.kept_apart``:
    a part of the same object found again), every image's at once."""
    rows = [j for j in judged if j.instances]
    if not rows:
        return
    width = max(len(j.instances or ()) for j in rows)
    boxes = torch.zeros(len(rows), width, 4)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, j in enumerate(rows):  # the verdicts' lists -> one padded tensor
        n = len(j.instances or ())
        boxes[r, :n] = torch.tensor([i.box for i in j.instances or ()], dtype=torch.float32)
        valid[r, :n] = True
    keep = kept_apart(boxes, valid).tolist()
    for j, row in zip(rows, keep, strict=True):
        j.instances = [i for i, k in zip(j.instances or (), row, strict=False) if k]


KEPT_HEADER = "X-Qloc-Kept"
"""``keep=true`` with ``format=coco`` / ``labelstudio``: the kept images' pool ids, comma-separated, in upload order."""


def check_format_options(opts: AnswerOptions, given: set[str], *, trajectory: bool) -> None:
    """422 for what the asked ``format`` would drop: another format's parameters (``image_ids`` and ``category_id``
    are COCO's, ``label`` Label Studio's), a trajectory (JSON only), repeated COCO image ids."""
    others = {"coco": {"label"}, "labelstudio": {"image_ids", "category_id"},
              "json": {"image_ids", "category_id", "label"}}[opts.format]
    wrong = sorted(others & given)
    if wrong:
        owner = {"image_ids": "coco", "category_id": "coco", "label": "labelstudio"}
        raise unprocessable(", ".join(f"{n} is for format={owner[n]}" for n in wrong)
                            + f": not used with format={opts.format} (drop it, or ask for that format)")
    if trajectory and opts.format != "json":
        raise unprocessable(f"trajectory=true is answered only with format=json: format={opts.format} has no "
                            "place for it")
    if opts.format == "coco" and opts.image_ids:
        ids = opts.ids(0)
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise unprocessable(f"image_ids repeats {', '.join(map(str, twice))}: COCO image ids must be unique, "
                                "one per file")


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
    # keep=true: the pool ids of the kept images, which only the JSON body has room for, in a header of the others
    kept = None if done.kept is None else {KEPT_HEADER: ",".join(str(k) for k in done.kept)}
    if opts.format == "coco":
        return JSONResponse(export.coco(results, image_ids=opts.ids(len(results)), category_id=opts.category_id,
                                        category_name=es.name or "object", only_found=opts.min_confidence is not None),
                            headers=kept)
    if opts.format == "labelstudio":
        return JSONResponse(export.labelstudio(results, label=opts.label or es.name or "object", from_name="label",
                                               to_name="image", model_version=str(ckpt.id)), headers=kept)
    body = LocalizeResponse(
        exemplar_set_id=es.id, checkpoint_id=ckpt.id, bundle=es.bundle, samples=done.samples,
        nearest=done.nearest, refined=done.refined, kept=done.kept, results=results)
    # Serialized once, here (what ``response_model_exclude_none`` gives); returned as is, FastAPI would dump,
    # validate and serialize the model again.
    return Response(body.model_dump_json(exclude_none=True), media_type="application/json")


def without_turn(turns: threading.BoundedSemaphore | None, wait: Callable[P, T]) -> Callable[P, T]:
    """``wait`` (a call that waits for a worker) run with the caller's turn handed back meanwhile."""
    if turns is None:
        return wait

    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        turns.release()
        try:
            return wait(*args, **kwargs)
        finally:
            turns.acquire()
    return call


def localize_files(session: Session, set_id: uuid.UUID, settings: Settings, inference: InferenceBackend,  # noqa: PLR0913
                   caller: Caller, metrics: Metrics, store: BlobStore, files: list[UploadFile], run: RunOptions,
                   opts: AnswerOptions, *, bundles: BundleRegistry | None = None, local: bool = True,
                   turns: threading.BoundedSemaphore | None = None) -> Localized:
    """Localize the set's object in uploaded ``files`` (the pipeline of every way in: the localize route, Label
    Studio's /predict): decode, the inference backend, the calibration's verdict, the pool (``keep``).

    ``turns`` (``QLOC_ROUTE_THREADS``) bounds how many threads run its reads and verdicts at once: Python runs
    one thread at a time, and many threads handing its lock to one another cost more CPU than the work. Decoding,
    the model and the pool's writes take no turn (they mostly wait, or release the lock)."""
    with on_its_way(inference):  # a batching engine holds an idle batch back for this request until it submits
        return _localize_files(session, set_id, settings, inference, caller, metrics, store, files, run, opts,
                               bundles=bundles, local=local, turns=turns)


def _localize_files(session: Session, set_id: uuid.UUID, settings: Settings, inference: InferenceBackend,  # noqa: PLR0913
                    caller: Caller, metrics: Metrics, store: BlobStore, files: list[UploadFile], run: RunOptions,
                    opts: AnswerOptions, *, bundles: BundleRegistry | None = None, local: bool = True,
                    turns: threading.BoundedSemaphore | None = None) -> Localized:
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
        raise unprocessable(f"image_ids has {len(opts.ids(0))} ids for {len(files)} files: one per file, in "
                             "upload order")
    calibration, calibration_key = ((ckpt.calibration, ("checkpoint", ckpt.id)) if ckpt.calibration is not None
                                    else (es.calibration, ("set", es.id)))
    use_negatives = es.negatives is not None and calibration is not None and (not local or bundles is not None)
    n_samples = settings.localize_samples if samples is None else samples
    images = read_images(files, settings, keep_data=keep)  # decoded downscaled; boxes mapped back below
    if keep:  # a full pool is refused before the work (add_to_pool decides for good after it)
        try:
            pool.check_room(es, images, pool_limits(settings))
        except pool.PoolFull as e:
            raise HTTPException(status.HTTP_409_CONFLICT, str(e)) from e
    fit = None if calibration is None else decoded(calibration, calibration_key)
    ncc = fit is not None and fit.ncc is not None
    # rerank=templates / auto: a second look only where the confidence is the NCC fit's (grayscale bundles' sets)
    rerank: Rerank = "false" if fit is None or (opts.rerank in ("auto", "templates") and not ncc) else opts.rerank
    look = rerank in ("auto", "templates") and run.max_instances < RERANK_CANDIDATES
    rule: Rerank = "auto" if rerank == "templates" else rerank  # templates: auto's rule, one more candidate
    windows = rerank == "templates" and fit is not None and fit.templates is not None and bool(fit.templates.crops)
    decoded_scales = [im.scale for im in images]
    call = LocalizeCall(
        bundle=es.bundle, bundle_sha256=es.bundle_sha256, prototype_dim=es.prototype_dim, prototype=es.prototype,
        checkpoint=None if ckpt.kind == "base" else CheckpointRef(ckpt.id, ckpt.blob or "", ckpt.sha256),
        images=[im.image for im in images], decoded_scales=decoded_scales, trajectory=trajectory,
        samples=n_samples, nearest=nearest,
        max_instances=max(run.max_instances, RERANK_CANDIDATES) if rerank == "true" else run.max_instances,
        templates=fit.templates if fit is not None and ncc else None,
        kind=fit.kind if fit is not None and ncc else None,
        second_look=second_look(fit, RERANK_CANDIDATES, templates=rerank == "templates")
        if fit is not None and look else None,
        # every image's candidates asked for at once: template matching's window among them (the route matches)
        extra_boxes=matched_windows(fit.templates, [im.image for im in images], decoded_scales)  # type: ignore[union-attr]
        if windows and run.max_instances >= RERANK_CANDIDATES else None)

    def verifier() -> KindVerifier | None:  # the set's bundle's known-kinds verifier, where its calibration has a check
        return bundles.verifier(es.bundle) if bundles is not None and fit is not None and fit.kind is not None else None

    def by_kind(answer: LocalizeAnswer) -> bool:
        """Whether the verdict's confidences are the set's known-kinds check's (``app.calibration.judge``)."""
        return fit is not None and fit.kind is not None and (answer.kind is not None or fit.kind_applies(verifier()))

    def answered(call: LocalizeCall) -> tuple[LocalizeAnswer, list[Judged]]:
        try:
            answer = inference.localize(call)
        except InferenceRefused as e:
            raise HTTPException(e.status_code, e.detail, headers=e.headers) from e
        # candidates: asked for (rerank=true, or auto's second call), or the engine's second look
        rerank_now = rule if call.max_instances >= RERANK_CANDIDATES or answer.looked else "false"
        with turn:
            judged = judge(answer.results, call.images, calibration, threshold=es.threshold,
                           min_confidence=opts.min_confidence, prototype=es.prototype,
                           loaded=set_bundle(bundles, es) if use_negatives and local and bundles is not None
                           else None,
                           by_negatives=without_turn(turns, partial(inference.negatives_confidence, call,
                                                                     es.negatives, calibration))
                           if use_negatives and isinstance(inference, WorkerInference) else None,
                           negatives=es.negatives if use_negatives else None, rerank=rerank_now,
                           calibration_key=calibration_key, ncc=answer.ncc,
                           template_bar=TEMPLATE_BAR if rerank == "templates" else None,
                           kind=answer.kind,  # read by the engine with its batch; else read here
                           verifier=verifier() if answer.kind is None else None)
        return answer, judged

    answer, judged = answered(call)
    metrics.localize_batch.observe(len(images))  # answered: a request refused (503, 409) was no batch
    located = list(answer.results)
    if look:
        # The second look: the candidates of the images whose answer is doubtful, searched for them alone (the rest
        # pay nothing for it); an answer no candidate beats stays the first one. The local engine takes it in the
        # same forward pass (``LocalizeAnswer.looked``: the doubtful images' results carry candidates); elsewhere
        # (workers, a GPU, max_instances 2-3) a second call on the doubtful images, with rerank=templates' windows
        # matched here (``LocalizeCall.extra_boxes``: every backend scores them).
        if answer.looked:
            doubt = [i for i, r in enumerate(answer.results) if r.instances is not None]
            verdicts = [judged[i] for i in doubt]
        else:
            doubt = [i for i, j in enumerate(judged) if doubtful(j.confidence)]
            if doubt and by_kind(answer):  # the check doubts; the NCC fit must doubt the box too (as the engine)
                pixels = doubtful_by_pixels(fit, [call.images[i] for i in doubt],  # type: ignore[arg-type]
                                            [answer.results[i] for i in doubt])
                doubt = [i for i, d in zip(doubt, pixels, strict=True) if d]
            verdicts = []
            if doubt:
                again_images, again_scales = [call.images[i] for i in doubt], [decoded_scales[i] for i in doubt]
                again, verdicts = answered(replace(
                    call, images=again_images, decoded_scales=again_scales, max_instances=RERANK_CANDIDATES,
                    extra_boxes=matched_windows(fit.templates, again_images, again_scales)  # type: ignore[union-attr]
                    if windows else None))
                for i, r, j in zip(doubt, again.results, verdicts, strict=True):
                    if j.reranked:
                        located[i], judged[i] = r, j
        if doubt:
            reranked = sum(j.reranked for j in verdicts)
            metrics.second_looks.labels("reranked").inc(reranked)
            metrics.second_looks.labels("kept").inc(len(doubt) - reranked)
    for j in judged:  # rerank's candidates, beyond what was asked for (the first K of a larger search are its own)
        if j.instances is not None:
            j.instances = None if run.max_instances == 1 else j.instances[:run.max_instances]
    apart(judged)
    kept = [r.id for r in add_to_pool(session, store, settings, es, images)] if keep else None
    results = [LocalizationResult(filename=im.filename, width=im.width, height=im.height,
                                  box=list(im.box_to_full(j.box)), score=j.score, confidence=j.confidence,
                                  found=j.found, reranked=j.reranked or None,
                                  trajectory=[list(im.box_to_full(b)) for b in r.trajectory] if trajectory else None,
                                  instances=None if j.instances is None else [
                                      InstanceResult(box=list(im.box_to_full(i.box)), score=i.score,
                                                     confidence=i.confidence, found=i.found) for i in j.instances])
               for im, r, j in zip(images, located, judged, strict=True)]
    return Localized(es, ckpt, n_samples, answer.nearest, results, kept, answer.refined)
