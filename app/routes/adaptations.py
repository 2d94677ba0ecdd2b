"""Adaptation jobs: create (202, idempotent by ``Idempotency-Key``), poll, list, cancel."""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Header, HTTPException, Response, UploadFile, status
from pydantic import BeforeValidator
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app import crud, jobstates, pool
from app.config import Settings
from app.deps import (
    BundlesDep,
    Caller,
    CallerDep,
    JobId,
    Limit,
    Offset,
    QueueDep,
    SessionDep,
    SetId,
    SettingsDep,
    StoreDep,
)
from app.inference import BundleRegistry
from app.queue import JobQueue
from app.remote import RemoteDep, WorkerInference, answer_refusal
from app.routes.errors import UNAUTHORIZED, UPLOAD_ERRORS, error, invalid, unavailable
from app.routes.exemplar_sets import set_bundle
from app.routes.uploads import check_file_count, decode_all, read_raw
from app.schemas import AdaptationJobPublic, AdaptationJobsPublic, JobParams, Progress
from app.serving import InferenceRefused
from app.storage import BlobStore, job_image_key, job_prefix
from app.tables import AdaptationJob, JobState

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["adaptations"], responses=UNAUTHORIZED)

JOB_NOT_FOUND = "adaptation job not found"
EMPTY_POOL = ("no image to adapt on: no file was posted and the set's image pool is empty; add images with "
              "POST /v1/exemplar-sets/{set_id}/images (or localize with keep=true), or post files")


def to_public(job: AdaptationJob) -> AdaptationJobPublic:
    return AdaptationJobPublic(
        id=job.id, exemplar_set_id=job.exemplar_set_id, status=job.status,  # type: ignore[arg-type]
        progress=Progress(iteration=job.progress_iteration, total=job.iterations, mean_reward=job.mean_reward,
                          phase=job.phase if job.status == JobState.RUNNING else None),  # type: ignore[arg-type]
        checkpoint_id=job.checkpoint_id, error=job.error,
        params=JobParams(iterations=job.iterations, learning_rate=job.learning_rate, seed=job.seed,
                         activate=job.activate, num_images=job.num_images,  # type: ignore[arg-type]
                         num_pool_images=job.num_pool_images,
                         base_checkpoint_id=job.base_checkpoint_id),
        verdict=job.verdict, validation=job.validation,  # type: ignore[arg-type]
        attempts=job.attempts, cancel_requested=job.cancel_requested, created_at=job.created_at,
        started_at=job.started_at, finished_at=job.finished_at)


def _lowered(v: object) -> object:
    return v.lower() if isinstance(v, str) else v


def request_digest(set_id: uuid.UUID, params: dict, files: list[UploadFile], raw: list[bytes]) -> str:
    body = {"exemplar_set_id": str(set_id), **params,
            "files": [[f.filename, hashlib.sha256(d).hexdigest()] for f, d in zip(files, raw, strict=True)]}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def replay(job: AdaptationJob, digest: str, response: Response) -> AdaptationJobPublic:
    if job.request_sha256 != digest:
        raise HTTPException(status.HTTP_409_CONFLICT, "Idempotency-Key already used for a different request")
    response.headers["Location"] = f"/v1/adaptations/{job.id}"
    response.headers["Idempotent-Replayed"] = "true"
    return to_public(job)


@router.post("/exemplar-sets/{set_id}/adaptations", status_code=status.HTTP_202_ACCEPTED,
             response_model=AdaptationJobPublic,
             responses={**UPLOAD_ERRORS, 404: error("Unknown exemplar set"),
                        409: error("Idempotency-Key reused with another request, or the set's bundle file was "
                                   "replaced since the set was made"),
                        422: invalid("Invalid fields, no image to adapt on (no file, and an empty pool), files "
                                     "with source=pool, more iterations than the server allows, or a field the "
                                     "route does not take"),
                        503: unavailable("The job queue is unreachable, or the set's bundle cannot be loaded (with "
                                   "QLOC_INFERENCE=workers: or no localize worker answered the bundle check in "
                                   "time)")})
def create_adaptation(
    set_id: SetId, response: Response, session: SessionDep, settings: SettingsDep, store: StoreDep,
    queue: QueueDep, bundles: BundlesDep, caller: CallerDep, remote: RemoteDep,
    files: Annotated[list[UploadFile] | None, File(min_length=1, description=(
        "Unlabeled images to adapt the set's policy on (with source=files or both), at most "
        "QLOC_MAX_FILES_PER_REQUEST (64 by default); more through the set's pool"))] = None,
    source: Annotated[Literal["files", "pool", "both"] | None, Form(description=(
        "Which images the job adapts on: `files` (the ones posted), `pool` (every image of the set's pool, "
        "`/v1/exemplar-sets/{id}/images`, as it is when the job is created: images added later are not the job's), "
        "or `both`. Default: `files` when files are posted, else `pool`. A job needs at least one image."))] = None,
    iterations: Annotated[int | None, Form(ge=1, le=2**31 - 1, description=(
        "Policy-gradient iterations. Default: the server's QLOC_DEFAULT_ITERATIONS (200); at most its "
        "QLOC_MAX_ITERATIONS (5000 unless the server says otherwise: more is a 422 naming the limit)"))] = None,
    learning_rate: Annotated[float | None, Form(gt=0, le=1, allow_inf_nan=False, description=(
        "Adam's learning rate for the policy. Default: the server's QLOC_DEFAULT_LEARNING_RATE (0.001)"))] = None,
    seed: Annotated[int | None, Form(ge=0, le=2**31 - 1, description=(
        "Seed of the job's random draws: the episodes it samples and the probes it makes (default 0)"))] = None,
    activate: Annotated[Literal["auto", "true", "false"], BeforeValidator(_lowered), Form(description=(
        "auto|true|false, in any case (`True`, as Python prints it, is true). auto (default): make the best "
        "checkpoint the set's active policy only if it beats the starting policy "
        "on the job's probes (labeled checks built from the set's exemplars and the uploaded images; on a photo "
        "bundle the set's labeled examples must confirm the gain too, beyond their own noise, as pasted crops do not "
        "predict real photos: with 5 of them, 3 more right and none lost); true: the final checkpoint, whatever "
        "the probes say; false: none"))] = "auto",
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", min_length=1, max_length=255, description=(
        "Makes a retried creation safe: the same key with the same request answers 202 with the job it made "
        "(whatever its state now); with a different request, 409. Keys are per API key. A request refused (4xx, "
        "or the 503 of an unreachable job queue) does not use its key up: retry with the same one."))] = None,
) -> AdaptationJobPublic:
    """Queue a test-time adaptation of the set's active policy on unlabeled images: the posted files, the set's
    image pool, or both (`source`).

    A job on the pool takes the pool's images as they are when it is created (`params.num_pool_images`); while
    it is queued or running, those images cannot be deleted from the pool (409)."""
    return submit_adaptation(set_id, JobForm(files or [], source, iterations, learning_rate, seed, activate,
                                             idempotency_key), response, session, settings, store, queue, bundles,
                             caller, remote)


@dataclass(frozen=True)
class JobForm:
    """A job request's files and fields, as the route took them (``None``: not given)."""

    files: list[UploadFile]
    source: Literal["files", "pool", "both"] | None
    iterations: int | None
    learning_rate: float | None
    seed: int | None
    activate: str
    idempotency_key: str | None


def submit_adaptation(set_id: uuid.UUID, form: JobForm, response: Response, session: Session,  # noqa: PLR0913
                      settings: Settings, store: BlobStore, queue: JobQueue, bundles: BundleRegistry, caller: Caller,
                      remote: WorkerInference | None) -> AdaptationJobPublic:
    """The job of ``create_adaptation``: checked, its images stored, committed, sent (the row is its outbox)."""
    files, idempotency_key = form.files, form.idempotency_key
    es = crud.get_exemplar_set(session, set_id=set_id, owner=caller.scope)
    if es is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "exemplar set not found")
    iterations = settings.default_iterations if form.iterations is None else form.iterations
    params = {"iterations": iterations, "seed": 0 if form.seed is None else form.seed, "activate": form.activate,
              "learning_rate": settings.default_learning_rate if form.learning_rate is None else form.learning_rate}
    source = form.source or ("files" if files else "pool")
    if source == "pool" and files:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            "source=pool adapts on the set's pool alone: post no files, or use source=both")
    if source == "files" and not files:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            "at least one file is required with source=files (source=pool adapts on the set's pool)")
    if source == "both" and not files:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            "source=both adapts on posted files and the set's pool: no file was posted (attach them "
                            "as 'files'), or use source=pool for the pool alone")
    if files:
        check_file_count(files, settings)
    raw = read_raw(files, settings)
    digest = request_digest(set_id, params if source == "files" else {**params, "source": source}, files, raw)
    if idempotency_key is not None:  # a retry gets the job it made, whatever changed since (the pool, a limit)
        existing = crud.get_job_by_idempotency_key(session, owner=caller.owner, key=idempotency_key)
        if existing is not None:
            return replay(existing, digest, response)
    if iterations > settings.max_iterations:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            f"iterations must be at most {settings.max_iterations}")
    if source != "files" and not files and es.num_pool_images == 0:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, EMPTY_POOL.format(set_id=set_id))
    # 409 before anything is stored when the set's bundle was replaced (QLOC_INFERENCE=workers: a worker checks)
    if remote is None:
        set_bundle(bundles, es)
    else:
        try:
            remote.check_bundle(es.bundle, sha256=es.bundle_sha256, prototype_dim=es.prototype_dim)
        except InferenceRefused as e:
            raise answer_refusal(e) from e
    images = decode_all(files, raw, settings)
    session.commit()  # end the read transaction while blobs are written

    job_id = uuid.uuid4()
    try:
        blobs = []
        for i, im in enumerate(images):
            key = job_image_key(set_id, job_id, i, im.ext)
            blobs.append(crud.NewBlob(i, im.filename, im.content_type, im.width, im.height, store.put(key, im.data),
                                      key))
        pool.lock(session, set_id)  # the set's lock first, as every writer of the pool, an activation and a
        # checkpoint's deletion take it (SetGone: deleted meanwhile, below)
        session.expire_all()  # the set as it is now, under the lock: its active checkpoint (the job's start) may
        es = crud.get_exemplar_set(session, set_id=set_id, owner=caller.scope)  # have changed, and the old one gone
        if es is None:  # deleted meanwhile
            raise pool.SetGone(str(set_id))
        job = crud.create_job(session, job_id=job_id, exemplar_set=es, owner=caller.owner,
                              idempotency_key=idempotency_key, request_sha256=digest, images=blobs, **params)
        if source != "files":  # the pool as it is now, under the set's lock (pool.snapshot_into_job)
            pool.snapshot_into_job(session, job=job, set_id=set_id)
            if job.num_images == 0:  # emptied meanwhile
                raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, EMPTY_POOL.format(set_id=set_id))
        session.commit()
    except IntegrityError:
        # The same Idempotency-Key won a race with this request: answer with its job.
        session.rollback()
        store.delete_tree(job_prefix(set_id, job_id))
        existing = crud.get_job_by_idempotency_key(session, owner=caller.owner, key=idempotency_key or "")
        if existing is None:
            raise
        return replay(existing, digest, response)
    except BaseException as e:
        session.rollback()
        if pool.deleted_meanwhile(session, store, set_id, e):  # the set's folder went with it
            raise HTTPException(status.HTTP_404_NOT_FOUND, "exemplar set not found (deleted during this request)") \
                from e
        store.delete_tree(job_prefix(set_id, job_id))
        raise

    # The job row is its own outbox: committed with enqueued_at NULL, sent, then stamped. Should this
    # process die before the stamp, a worker's reaper sends the job after ``enqueue_grace``.
    try:
        queue.enqueue_adaptation(job_id)
    except Exception as e:
        log.exception("could not enqueue job %s", job_id)
        failed = jobstates.fail_unsent(session, job_id=job_id, error=f"could not enqueue the job: {type(e).__name__}")
        session.commit()
        if failed:  # the client learns now, rather than the job waiting for the broker to come back
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE,
                                "the job queue is unreachable; retry later") from e
        session.refresh(job)  # a reaper sent it meanwhile: it is enqueued after all
    else:
        try:
            crud.mark_enqueued(session, job_id=job_id)
            session.commit()
        except Exception:  # sent but not stamped: the reaper sends it again, a harmless duplicate
            session.rollback()
            log.exception("job %s: sent, but its enqueued_at was not recorded", job_id)
    response.headers["Location"] = f"/v1/adaptations/{job_id}"
    return to_public(job)


@router.get("/exemplar-sets/{set_id}/adaptations", response_model=AdaptationJobsPublic,
            responses={404: error("Unknown exemplar set")})
def list_adaptations(set_id: SetId, session: SessionDep, caller: CallerDep,
                     limit: Limit = 50, offset: Offset = 0) -> AdaptationJobsPublic:
    """The set's adaptation jobs, oldest first (finished ones too), `limit` at a time from `offset`; `count`: all of
    them."""
    if crud.get_exemplar_set(session, set_id=set_id, owner=caller.scope) is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "exemplar set not found")
    jobs, count = crud.list_jobs(session, set_id=set_id, limit=limit, offset=offset)
    return AdaptationJobsPublic(data=[to_public(j) for j in jobs], count=count, limit=limit, offset=offset)


@router.get("/adaptations/{job_id}", response_model=AdaptationJobPublic, responses={404: error("Unknown job")})
def read_adaptation(job_id: JobId, session: SessionDep, caller: CallerDep) -> AdaptationJobPublic:
    job = crud.get_job(session, job_id=job_id, owner=caller.scope)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, JOB_NOT_FOUND)
    return to_public(job)


@router.post("/adaptations/{job_id}/cancel", status_code=status.HTTP_202_ACCEPTED, response_model=AdaptationJobPublic,
             responses={404: error("Unknown job"), 409: error("The job has already finished")})
def cancel_adaptation(job_id: JobId, session: SessionDep, caller: CallerDep) -> AdaptationJobPublic:
    """Cancel a job: a queued one at once, a running one between two iterations."""
    job = crud.get_job(session, job_id=job_id, owner=caller.scope)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, JOB_NOT_FOUND)
    if not jobstates.request_cancel(session, job_id=job_id):
        session.rollback()
        raise HTTPException(status.HTTP_409_CONFLICT, f"the job has already finished ({job.status})")
    session.commit()
    session.refresh(job)
    return to_public(job)
