"""Label Studio's ML backend protocol, one backend per exemplar set: ``/v1/labelstudio/{set_id}``.

Label Studio's "ML backend URL" is ``http://HOST:8000/v1/labelstudio/<set_id>``; it calls, under it:

- ``GET /health`` (and ``GET /``): ``{"status": "UP"}`` once the set exists (for this key);
- ``POST /setup`` ``{project, schema, hostname, access_token, extra_params}``: checks the label config and answers
  ``{"model_version": <active checkpoint id>}``; records Label Studio's address and token and the backend's
  ``max_instances`` per set and project in the database (``labelstudio_setups``: every API process answers alike);
- ``POST /predict`` ``{tasks, label_config, project, params}``: fetches each task's image and localizes it with
  the set's active checkpoint, through localize's own pipeline (``localize_files``: the inference backend, then the
  calibration's ``judge``), answering ``{"results": [{"result": [rectanglelabels region, in percent], "score",
  "model_version"}, ...], "model_version"}``, one per task, in order;
- ``POST /webhook`` ``{action, project, ...}``: ``START_TRAINING`` starts an adaptation job (``app.labelstudio``'s
  ``TRAIN_ACTIONS``); other actions are acknowledged and ignored;
- ``GET /versions``: the set's checkpoint ids; ``GET /metrics``: ``{}``.

Auth, with API keys on: the qloc key as ``X-API-Key``, ``Authorization: Bearer``, or HTTP Basic Auth (Label
Studio's ML backend "Basic Auth" setting: any user, the key as password), the only one Label Studio can send to
/setup, /predict and START_TRAINING.
"""

from __future__ import annotations

import io
import json
import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Request, Response, Security, UploadFile, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBasic, HTTPBasicCredentials
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, StrictStr
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.datastructures import Headers

from app import crud, export
from app.config import MAX_INSTANCES, Settings
from app.deps import (
    BundlesDep,
    Caller,
    InferenceDep,
    MetricsDep,
    QueueDep,
    SessionDep,
    SetId,
    SettingsDep,
    StoreDep,
    _api_key_header,
    _bearer,
    get_caller,
)
from app.export import AnswerOptions
from app.images import ImageRejected, sniff_format
from app.inference import BundleRegistry
from app.jobstates import FINISHED_STATES
from app.labelstudio import (
    TRAIN_ACTIONS,
    Access,
    ImageFetcher,
    Refused,
    Target,
    max_instances_of,
    merged,
    parse_label_config,
    project_id,
)
from app.metrics import Metrics
from app.queue import JobQueue
from app.remote import RemoteDep, WorkerInference
from app.routes.adaptations import JobForm, submit_adaptation
from app.routes.errors import JSON_TOO_LARGE, UNAUTHORIZED, UPLOAD_ERRORS, error, invalid, unavailable
from app.routes.exemplar_sets import NOT_FOUND
from app.routes.localize import RunOptions, localize_files, resolve_checkpoint
from app.routes.uploads import check_text
from app.serving import InferenceBackend
from app.storage import BlobStore
from app.tables import AdaptationJob, ExemplarSet

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/labelstudio/{set_id}", tags=["labelstudio"], responses={
    **UNAUTHORIZED, 404: error("Unknown exemplar set")})

FETCH_THREADS = 8
"""Task images fetched at once, per request."""

_basic = HTTPBasic(auto_error=False, description=(
    "Label Studio's ML backend Basic Auth: any user name, one of QLOC_API_KEYS as the password"))


async def labelstudio_caller(
    settings: SettingsDep, api_key: Annotated[str | None, Security(_api_key_header)] = None,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)] = None,
    basic: Annotated[HTTPBasicCredentials | None, Security(_basic)] = None,
) -> Caller:
    """``CallerDep``, and HTTP Basic Auth too: the key is the password (or, without one, the user name)."""
    key = api_key or (bearer.credentials if bearer else None)
    if key is None and basic is not None:
        key = basic.password or basic.username
    return get_caller(settings, key, None)


LabelStudioCallerDep = Annotated[Caller, Security(labelstudio_caller)]


def _storable_project(project: object) -> object:
    """A project id that every database can store: NUL bytes are refused (PostgreSQL's text cannot hold them)."""
    pid = project.get("id") if isinstance(project, dict) else project
    if isinstance(pid, str) and "\x00" in pid:
        raise ValueError("project contains a NUL byte (\\x00); remove it")
    return project


StorableProject = Annotated[StrictStr | StrictInt | None, AfterValidator(_storable_project)]
"""Label Studio's project: its id as text (``"12.1712345678"``) or a number; ``true`` is not one."""


class SetupRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    project: StorableProject = Field(None, description="Label Studio's project id")
    label_config: str | None = Field(None, alias="schema", description=(  # "schema" would shadow BaseModel's
        "The project's labeling config (XML): qloc answers its RectangleLabels tag"))
    hostname: str | None = Field(None, max_length=2048, description=(
        "Label Studio's address: task images given as Label Studio paths are fetched there (unless "
        "QLOC_LABELSTUDIO_URL is set)"))
    access_token: str | None = Field(None, max_length=1024, description=(
        "Label Studio's token for those fetches (unless QLOC_LABELSTUDIO_API_KEY is set)"))


class PredictRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    tasks: list[dict[str, Any]] = Field(description=(
        "The tasks to pre-annotate, as Label Studio sends them (each with `id` and `data`)"))
    label_config: str | None = Field(None, description="The project's labeling config (XML)")
    project: StorableProject = Field(None, description="Label Studio's project id")
    params: dict[str, Any] | None = Field(None, description=(
        "Label Studio's extra parameters (`context`, `login`, ...): not read"))


class WebhookEvent(BaseModel):
    model_config = ConfigDict(extra="allow")

    action: str = Field(description=(
        "The event: `START_TRAINING` starts an adaptation job on the project's images; the others are acknowledged "
        "and ignored"))
    project: Annotated[dict[str, Any] | StrictStr | StrictInt | None, AfterValidator(_storable_project)] = Field(
        None, description="The project, as Label Studio sends it (an object with its `id`, or the id)")


def _refusal(e: Refused) -> HTTPException:
    return HTTPException(e.status, e.detail)


def _get_set(session: Session, set_id: uuid.UUID, caller: Caller) -> ExemplarSet:
    es = crud.get_exemplar_set(session, set_id=set_id, owner=caller.scope)
    if es is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, NOT_FOUND)
    return es


def _access(session: Session, settings: Settings, set_id: uuid.UUID, project: object) -> Access:
    row = crud.labelstudio_setup(session, set_id=set_id, project=project_id(project))
    remembered = Access() if row is None else Access(row.url, row.token, row.max_instances)
    return merged(settings.labelstudio_url, settings.labelstudio_api_key, remembered)


def _target(config: str | None, es: ExemplarSet) -> Target:
    try:
        return parse_label_config(config or "", set_name=es.name)
    except Refused as e:
        raise _refusal(e) from e


def _upload(data: bytes, name: str) -> UploadFile:
    """Fetched bytes as an upload of the localize and adaptation routes (type sniffed from the bytes)."""
    return UploadFile(io.BytesIO(data), size=len(data), filename=name,
                      headers=Headers({"content-type": "application/octet-stream"}))


def _task_id(task: dict[str, Any]) -> int | None:
    tid = task.get("id")
    return tid if isinstance(tid, int) and not isinstance(tid, bool) else None


def _task_label(task: dict[str, Any], k: int) -> str:
    """How messages (and the upload's filename) name a task: its Label Studio id, else its position."""
    tid = task.get("id")
    if isinstance(tid, int) and not isinstance(tid, bool):
        return f"task {tid}"
    if isinstance(tid, str) and tid.strip() and tid.isprintable():
        return f"task {tid.strip()[:40]}"
    return f"task #{k + 1}"


def _fetch_all(fetcher: ImageFetcher, urls: list[tuple[object, str, int | None]]) -> list[bytes]:
    """Every image, fetched FETCH_THREADS at a time; the first refusal (in task order) is raised."""
    if len(urls) == 1:
        return [fetcher.fetch(*urls[0])]
    with ThreadPoolExecutor(max_workers=min(FETCH_THREADS, len(urls))) as ex:
        futures = [ex.submit(fetcher.fetch, url, where, tid) for url, where, tid in urls]
        return [f.result() for f in futures]


@router.get("/health", summary="Label Studio's health check")
@router.get("", include_in_schema=False)
@router.get("/", include_in_schema=False)
def health(set_id: SetId, session: SessionDep, caller: LabelStudioCallerDep) -> dict[str, Any]:
    """``{"status": "UP"}`` when the exemplar set exists for this key (404 otherwise)."""
    es = _get_set(session, set_id, caller)
    return {"status": "UP", "model_class": "qloc", "exemplar_set": str(es.id), "bundle": es.bundle}


@router.post("/setup", responses={**JSON_TOO_LARGE, 422: invalid(
    "Invalid body, or a label config without a usable RectangleLabels tag")})
def setup(set_id: SetId, body: SetupRequest, session: SessionDep, settings: SettingsDep,
          caller: LabelStudioCallerDep) -> dict[str, Any]:
    """Label Studio connects: the config must have a RectangleLabels on an Image with a label for the set;
    answers the model version (the set's active checkpoint id). Label Studio's ``hostname`` and ``access_token``
    are recorded (per set and project, in the database: every API process reads them) to fetch the project's task
    images, and the backend's ``extra_params`` ``{"max_instances": K}`` (1..32; Label Studio's model settings) to
    predict up to K regions per task."""
    return connect(set_id, body, session, caller)


def connect(set_id: uuid.UUID, body: SetupRequest, session: Session, caller: Caller) -> dict[str, Any]:
    """``setup``'s checks and record -> the model version."""
    es = _get_set(session, set_id, caller)
    _target(body.label_config, es)
    ckpt = resolve_checkpoint(session, es, "active")
    try:
        k = max_instances_of((body.model_extra or {}).get("extra_params"), MAX_INSTANCES)
    except Refused as e:
        raise _refusal(e) from e
    check_text(body.hostname, "hostname")
    check_text(body.access_token, "access_token")
    hostname = body.hostname if body.hostname and body.hostname.startswith(("http://", "https://")) else None
    if body.hostname and hostname is None:  # Label Studio's LABEL_STUDIO_HOST without a scheme: not an address
        log.warning("Label Studio /setup for set %s: hostname %r is not an http(s) URL; its task images on Label "
                    "Studio's paths cannot be fetched (set LABEL_STUDIO_HOST with http://, or QLOC_LABELSTUDIO_URL)",
                    set_id, body.hostname[:200])
    crud.put_labelstudio_setup(session, set_id=set_id, project=project_id(body.project),
                               url=hostname and hostname.rstrip("/"), token=body.access_token or None, max_instances=k)
    session.commit()
    return {"model_version": str(ckpt.id)}


@router.post("/predict", responses={
    400: error("A task's image cannot be decoded (truncated, corrupt) or is empty"),
    409: error("The set's bundle file was replaced since the set was made (as localize)"),
    413: error("A task's image is too large, or the body larger than QLOC_MAX_JSON_BYTES (4 MiB)"),
    415: error("A task's image is not a PNG, JPEG or WebP"),
    422: invalid("Invalid body, a label config without a usable RectangleLabels tag, a task without its image, "
               "or an image that cannot be fetched (unreachable, an error answer, a scheme other than http(s), "
               "a Label Studio path with Label Studio's address unknown)"),
    503: unavailable("The model is busy or cannot be loaded (as localize)")})
def predict(set_id: SetId, body: PredictRequest, request: Request, session: SessionDep, settings: SettingsDep,
            inference: InferenceDep, caller: LabelStudioCallerDep, metrics: MetricsDep, store: StoreDep,
            bundles: BundlesDep, remote: RemoteDep) -> dict[str, Any]:
    """Pre-annotate Label Studio tasks: one ``rectanglelabels`` region per task (an empty ``result`` when the
    answer is not ``found``), in percent of the image, with the set's active checkpoint id as ``model_version``.

    Images are fetched (http(s), a Label Studio path with its token, a cloud storage URI through Label Studio, or
    a ``data:`` URI; QLOC_MAX_FILE_BYTES and QLOC_LABELSTUDIO_FETCH_TIMEOUT each) and localized
    QLOC_MAX_FILES_PER_REQUEST at a time."""
    return pre_annotate(set_id, body, session, settings, inference, caller, metrics, store, bundles,
                        local=remote is None, turns=request.app.state.route_turns)


def pre_annotate(set_id: uuid.UUID, body: PredictRequest, session: Session, settings: Settings,  # noqa: PLR0913
                 inference: InferenceBackend, caller: Caller, metrics: Metrics, store: BlobStore,
                 bundles: BundleRegistry, *, local: bool, turns: threading.BoundedSemaphore | None
                 ) -> dict[str, Any]:
    """``predict``'s answer: each task's image fetched, localized through ``localize_files`` a chunk at a time."""
    es = _get_set(session, set_id, caller)
    target = _target(body.label_config, es)
    access = _access(session, settings, set_id, body.project)
    session.commit()  # end the read transaction: fetching can be slow
    urls: list[tuple[object, str, int | None]] = []
    for k, task in enumerate(body.tasks):
        where = _task_label(task, k)
        data = task.get("data")
        if not isinstance(data, dict) or target.image_key not in data:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, (
                f"{where} has no data.{target.image_key} (the image of <Image value=\"${target.image_key}\"> in the "
                "label config)"))
        urls.append((data[target.image_key], where, _task_id(task)))
    results: list[dict[str, Any]] = []
    model_version = None
    chunk = settings.max_files_per_request
    with ImageFetcher(access, max_bytes=settings.max_file_bytes, timeout=settings.labelstudio_fetch_timeout,
                      hosts=settings.labelstudio_fetch_hosts) as fetcher:
        for start in range(0, len(urls), chunk):
            part = urls[start:start + chunk]
            try:
                blobs = _fetch_all(fetcher, part)
            except Refused as e:
                raise _refusal(e) from e
            uploads = [_upload(b, where) for b, (_, where, _) in zip(blobs, part, strict=True)]
            done = localize_files(session, set_id, settings, inference, caller, metrics, store, uploads,
                                  RunOptions(max_instances=access.max_instances), AnswerOptions(), bundles=bundles,
                                  local=local, turns=turns)
            model_version = str(done.checkpoint.id)
            tasks = export.labelstudio(done.results, label=target.label, from_name=target.from_name,
                                       to_name=target.to_name, model_version=model_version)
            results.extend(t["predictions"][0] for t in tasks)
    if model_version is None:  # no task: the version Label Studio would get from /setup
        model_version = str(resolve_checkpoint(session, _get_set(session, set_id, caller), "active").id)
    return {"results": results, "model_version": model_version}


def _unfinished_job(session: Session, set_id: uuid.UUID) -> AdaptationJob | None:
    stmt = (select(AdaptationJob).where(AdaptationJob.exemplar_set_id == set_id,
                                        AdaptationJob.status.not_in(FINISHED_STATES))
            .order_by(AdaptationJob.created_at.desc()).limit(1))
    return session.scalars(stmt).first()


def _project_images(fetcher: ImageFetcher, project: dict[str, Any], es: ExemplarSet, limit: int
                    ) -> tuple[list[UploadFile], list[str]]:
    """Up to ``limit`` images of the Label Studio project's tasks (its first ones), listed through Label Studio's
    API -> the uploads, and why others (or all) could not be read. Never raises for one bad image."""
    problems: list[str] = []
    pid = project_id(project)
    if not pid.isdigit():
        return [], ["the event names no Label Studio project"]
    if not fetcher.access.url:
        return [], ["Label Studio's address is unknown (no /setup of this project gave it; set QLOC_LABELSTUDIO_URL)"]
    try:
        key = parse_label_config(project.get("label_config") or "", set_name=es.name).image_key
    except Refused as e:
        return [], [e.detail]
    listing = f"/api/tasks/?project={pid}&page_size={limit}&page=1"
    try:
        payload = json.loads(fetcher.fetch(listing, f"the task list of Label Studio project {pid}"))
    except Refused as e:
        return [], [e.detail]
    except ValueError:
        return [], [f"the task list of Label Studio project {pid} is not JSON"]
    tasks = payload.get("tasks", []) if isinstance(payload, dict) else payload
    uploads: list[UploadFile] = []
    for k, task in enumerate(tasks[:limit] if isinstance(tasks, list) else []):
        where = _task_label(task, k) if isinstance(task, dict) else f"task #{k + 1}"
        data = task.get("data") if isinstance(task, dict) else None
        if not isinstance(data, dict) or key not in data:
            problems.append(f"{where} has no data.{key}")
            continue
        try:
            blob = fetcher.fetch(data[key], where, _task_id(task))
            sniff_format(blob, where)  # not PNG/JPEG/WebP: skipped here rather than refusing the whole job
        except Refused as e:
            problems.append(e.detail)
            continue
        except ImageRejected as e:
            problems.append(e.detail)
            continue
        uploads.append(_upload(blob, where))
    return uploads, problems


@router.post("/webhook", responses={
    201: {"description": "START_TRAINING: an adaptation job was started (`job` is its id, `/v1/adaptations/{job}`)"},
    **UPLOAD_ERRORS,
    409: error("The set's bundle file was replaced since the set was made"),
    422: invalid("Invalid body, or no image to adapt on: the project's images could not be read and the set's "
                 "pool is empty"),
    503: unavailable("The job queue is unreachable")})
def webhook(set_id: SetId, event: WebhookEvent, response: Response, session: SessionDep,
            settings: SettingsDep, store: StoreDep, queue: QueueDep, bundles: BundlesDep,
            caller: LabelStudioCallerDep, remote: RemoteDep) -> dict[str, Any]:
    """``START_TRAINING`` (Label Studio's "Start Training", and every N annotations when "Start model training
    on annotation submission" is on) starts an adaptation job of the set on the images of the project's tasks
    (its first QLOC_MAX_FILES_PER_REQUEST, fetched from Label Studio), plus the set's image pool if it has any; on
    the pool alone when the project's images cannot be read. While a job of the set is queued or running, that
    job is answered instead (200). Other actions are acknowledged (200, ``"ignored"``)."""
    return start_training(set_id, event, response, session, settings, store, queue, bundles, caller, remote)


def start_training(set_id: uuid.UUID, event: WebhookEvent, response: Response, session: Session,  # noqa: PLR0913
                   settings: Settings, store: BlobStore, queue: JobQueue, bundles: BundleRegistry, caller: Caller,
                   remote: WorkerInference | None) -> dict[str, Any]:
    """``webhook``'s answer: a job of the set started on the project's images (and its pool), the unfinished one
    answered, or the event ignored."""
    es = _get_set(session, set_id, caller)
    if event.action not in TRAIN_ACTIONS:
        return {"status": "ignored", "action": event.action}
    running = _unfinished_job(session, set_id)
    if running is not None:
        return {"status": "already " + running.status, "job": str(running.id), "job_status": running.status}
    project = event.project if isinstance(event.project, dict) else {"id": event.project}
    uploads: list[UploadFile] = []
    problems: list[str] = []
    with ImageFetcher(_access(session, settings, set_id, project), max_bytes=settings.max_file_bytes,
                      timeout=settings.labelstudio_fetch_timeout, hosts=settings.labelstudio_fetch_hosts) as fetcher:
        uploads, problems = _project_images(fetcher, project, es, settings.max_files_per_request)
    if problems:
        log.warning("Label Studio webhook for set %s: %d project image(s) not read: %s", set_id, len(problems),
                    "; ".join(problems[:5]))
    if not uploads and es.num_pool_images == 0:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, (
            "no image to adapt on: the project's images could not be read (" + "; ".join(problems[:3]) +
            ") and the set's image pool is empty"))
    source = "pool" if not uploads else ("both" if es.num_pool_images else "files")
    session.commit()  # end the read transaction: submit_adaptation reads the set again
    job = submit_adaptation(set_id, JobForm(uploads, source, None, None, None, "auto", None), Response(), session,
                            settings, store, queue, bundles, caller, remote)
    response.status_code = status.HTTP_201_CREATED
    response.headers["Location"] = f"/v1/adaptations/{job.id}"
    return {"status": "started", "job": str(job.id), "job_status": job.status, "source": source,
            "num_images": job.params.num_images, "skipped": problems[:20]}


@router.get("/versions")
def versions(set_id: SetId, session: SessionDep, caller: LabelStudioCallerDep) -> dict[str, Any]:
    """The set's checkpoint ids, oldest first (Label Studio's model version list)."""
    _get_set(session, set_id, caller)
    ckpts, _ = crud.list_checkpoints(session, set_id=set_id, limit=200, offset=0)
    return {"versions": [str(c.id) for c in ckpts]}


@router.get("/metrics", include_in_schema=False)
def metrics(set_id: SetId, session: SessionDep, caller: LabelStudioCallerDep) -> dict[str, Any]:
    _get_set(session, set_id, caller)
    return {}
