"""Adaptation jobs: create (202, idempotent by ``Idempotency-Key``), poll, list, cancel."""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Header, HTTPException, Query, Response, UploadFile, status
from sqlalchemy.exc import IntegrityError

from app import crud, jobstates
from app.deps import BundlesDep, CallerDep, QueueDep, SessionDep, SettingsDep, StoreDep
from app.routes.errors import UNAUTHORIZED, UPLOAD_ERRORS, error, invalid
from app.routes.exemplar_sets import set_bundle
from app.routes.uploads import check_file_count, decode_all, read_raw
from app.schemas import AdaptationJobPublic, AdaptationJobsPublic, JobParams, Progress
from app.storage import job_image_key, job_prefix
from app.tables import AdaptationJob

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["adaptations"], responses=UNAUTHORIZED)

JOB_NOT_FOUND = "adaptation job not found"


def to_public(job: AdaptationJob) -> AdaptationJobPublic:
    return AdaptationJobPublic(
        id=job.id, exemplar_set_id=job.exemplar_set_id, status=job.status,  # type: ignore[arg-type]
        progress=Progress(iteration=job.progress_iteration, total=job.iterations, mean_reward=job.mean_reward),
        checkpoint_id=job.checkpoint_id, error=job.error,
        params=JobParams(iterations=job.iterations, learning_rate=job.learning_rate, seed=job.seed,
                         activate=job.activate, num_images=job.num_images,  # type: ignore[arg-type]
                         base_checkpoint_id=job.base_checkpoint_id),
        verdict=job.verdict, validation=job.validation,  # type: ignore[arg-type]
        attempts=job.attempts, cancel_requested=job.cancel_requested, created_at=job.created_at,
        started_at=job.started_at, finished_at=job.finished_at)


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
                        422: invalid("Invalid fields, no file, or more iterations than the server allows"),
                        503: error("The job queue is unreachable, or the set's bundle cannot be loaded")})
def create_adaptation(
    set_id: uuid.UUID, response: Response, session: SessionDep, settings: SettingsDep, store: StoreDep,
    queue: QueueDep, bundles: BundlesDep, caller: CallerDep,
    files: Annotated[list[UploadFile], File(description="Unlabeled images to adapt the set's policy on")],
    iterations: Annotated[int | None, Form(ge=1, le=2**31 - 1)] = None,
    learning_rate: Annotated[float | None, Form(gt=0, le=1)] = None,
    seed: Annotated[int | None, Form(ge=0, le=2**31 - 1)] = None,
    activate: Annotated[Literal["auto", "true", "false"], Form(description=(
        "auto (default): make the best checkpoint the set's active policy only if it beats the starting policy "
        "on the job's probes (labeled checks built from the set's exemplars and the uploaded images); true: the "
        "final checkpoint, whatever the probes say; false: none"))] = "auto",
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", min_length=1, max_length=255)] = None,
) -> AdaptationJobPublic:
    """Queue a test-time adaptation of the set's active policy on unlabeled images."""
    es = crud.get_exemplar_set(session, set_id=set_id, owner=caller.scope)
    if es is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "exemplar set not found")
    iterations = settings.default_iterations if iterations is None else iterations
    if iterations > settings.max_iterations:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            f"iterations must be at most {settings.max_iterations}")
    params = {"iterations": iterations, "seed": 0 if seed is None else seed, "activate": activate,
              "learning_rate": settings.default_learning_rate if learning_rate is None else learning_rate}
    check_file_count(files, settings)
    raw = read_raw(files, settings)
    digest = request_digest(set_id, params, files, raw)
    if idempotency_key is not None:
        existing = crud.get_job_by_idempotency_key(session, owner=caller.owner, key=idempotency_key)
        if existing is not None:
            return replay(existing, digest, response)
    set_bundle(bundles, es)  # 409 before anything is stored when the set's bundle was replaced
    images = decode_all(files, raw, settings)
    session.commit()  # end the read transaction while blobs are written

    job_id = uuid.uuid4()
    try:
        blobs = []
        for i, im in enumerate(images):
            key = job_image_key(set_id, job_id, i, im.ext)
            blobs.append(crud.NewBlob(i, im.filename, im.content_type, im.width, im.height, store.put(key, im.data),
                                      key))
        es = crud.get_exemplar_set(session, set_id=set_id, owner=caller.scope)
        if es is None:  # deleted meanwhile
            raise HTTPException(status.HTTP_404_NOT_FOUND, "exemplar set not found")
        job = crud.create_job(session, job_id=job_id, exemplar_set=es, owner=caller.owner,
                              idempotency_key=idempotency_key, request_sha256=digest, images=blobs, **params)
        session.commit()
    except IntegrityError:
        # The same Idempotency-Key won a race with this request: answer with its job.
        session.rollback()
        store.delete_tree(job_prefix(set_id, job_id))
        existing = crud.get_job_by_idempotency_key(session, owner=caller.owner, key=idempotency_key or "")
        if existing is None:
            raise
        return replay(existing, digest, response)
    except BaseException:
        session.rollback()
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
def list_adaptations(set_id: uuid.UUID, session: SessionDep, caller: CallerDep,
                     limit: Annotated[int, Query(ge=1, le=200)] = 50,
                     offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0) -> AdaptationJobsPublic:
    if crud.get_exemplar_set(session, set_id=set_id, owner=caller.scope) is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "exemplar set not found")
    jobs, count = crud.list_jobs(session, set_id=set_id, limit=limit, offset=offset)
    return AdaptationJobsPublic(data=[to_public(j) for j in jobs], count=count, limit=limit, offset=offset)


@router.get("/adaptations/{job_id}", response_model=AdaptationJobPublic, responses={404: error("Unknown job")})
def read_adaptation(job_id: uuid.UUID, session: SessionDep, caller: CallerDep) -> AdaptationJobPublic:
    job = crud.get_job(session, job_id=job_id, owner=caller.scope)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, JOB_NOT_FOUND)
    return to_public(job)


@router.post("/adaptations/{job_id}/cancel", status_code=status.HTTP_202_ACCEPTED, response_model=AdaptationJobPublic,
             responses={404: error("Unknown job"), 409: error("The job has already finished")})
def cancel_adaptation(job_id: uuid.UUID, session: SessionDep, caller: CallerDep) -> AdaptationJobPublic:
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
