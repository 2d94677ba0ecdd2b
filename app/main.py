"""The FastAPI application factory: ``uvicorn --factory app.main:create_app`` (settings from the environment)."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.datastructures import UploadFile as StarletteUploadFile
from starlette.exceptions import HTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import forms, warmup, web
from app.config import Settings, get_settings, usable_cores
from app.db import make_engine, make_sessionmaker
from app.inference import BundleRegistry
from app.metrics import Metrics, RequestMetricsMiddleware
from app.queue import JobQueue
from app.remote import WorkerInference
from app.routes import adaptations, bundles, checkpoints, exemplar_sets, health, labelstudio, localize, pool
from app.routes.strict import UNKNOWN_PARAMETER, known_parameters
from app.serving import BatchedInference
from app.storage import BlobStore
from models.allocator import tune_malloc

log = logging.getLogger(__name__)


class BodyTooLarge(HTTPException):
    def __init__(self, detail: str):
        super().__init__(413, detail)


class BodyLimitMiddleware:
    """Refuses a request body over its limit with a JSON 413, like every other error.

    A multipart body (files) may take ``max_body_size`` bytes; any other body (JSON, an urlencoded form) only
    ``max_other_size``: such a body is parsed whole in memory, and nothing qloc takes that way needs more.
    A declared ``Content-Length`` over the limit is answered before the body is read; a body that grows
    past it raises ``BodyTooLarge`` from ``receive``, which the route's exception handling answers.
    (FastAPI's own ``max_body_size`` answers the first case in plain text, outside the OpenAPI spec.)
    """

    def __init__(self, app: ASGIApp, max_body_size: int, max_other_size: int | None = None):
        self.app = app
        other = max_body_size if max_other_size is None else min(max_other_size, max_body_size)
        self.multipart = (max_body_size, f"request body larger than {max_body_size} bytes")
        self.other = (other, f"a body that is not multipart/form-data (JSON, say) larger than {other} bytes (the "
                             "server's QLOC_MAX_JSON_BYTES)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        multipart = headers.get("content-type", "").lower().startswith("multipart/form-data")
        limit, detail = self.multipart if multipart else self.other
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await JSONResponse({"detail": detail}, 413)(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(detail)
            return message

        await self.app(scope, limited_receive, send)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:  # load the default bundle now, not on the first request; /readyz reports a failure
            if settings.inference == "local":  # workers mode: the API loads no bundle (app/remote.py)
                app.state.bundles.get(settings.default_bundle)
        except Exception as e:
            log.warning("default bundle %r not loaded: %s", settings.default_bundle, e)
        if app.state.remote is not None:  # workers mode: is the localize queue consumed (app/remote.py)
            app.state.remote.consumers.start()
        yield
        if app.state.remote is not None:
            app.state.remote.consumers.stop()
        close = getattr(app.state.inference, "close", None)
        if close is not None:  # the local engine thread: answers what waits, then stops
            close()
        app.state.engine.dispose()

    app = FastAPI(
        title="qloc", version="1.0.0", lifespan=lifespan, docs_url=None, redoc_url=None,  # app.web serves them
        redirect_slashes=False,  # a trailing slash is a 404 saying so (an empty 307 printed nothing with curl -F)
        description="Query object localization: register exemplar crops, localize the object in images, "
                    "adapt the localization policy to your images without labels.")
    app.state.settings = settings
    if settings.tune_malloc:
        tune_malloc()
    app.state.engine = make_engine(settings.database_url)
    app.state.session_factory = make_sessionmaker(app.state.engine)
    app.state.store = BlobStore(settings.storage_dir)
    app.state.metrics = Metrics(app.state.session_factory)
    # workers mode: this registry loads no model (the workers' do), so QLOC_DEVICE=cuda needs no GPU here
    app.state.bundles = BundleRegistry(settings.bundle_dir,
                                       settings.device if settings.inference == "local" else "cpu",
                                       fast_episode=settings.compile_episode)
    # each loaded bundle's one-image episode compiled in the background (app/warmup.py); the workers' own, there
    app.state.warmup = (warmup.install(app.state.bundles, settings, observe=app.state.metrics.episode_compiled)
                        if settings.inference == "local" else None)
    app.state.queue = JobQueue(settings)
    app.state.route_turns = threading.BoundedSemaphore(settings.route_threads)
    if settings.inference == "local":  # the model's threads; the rest of the cores serve HTTP
        # scripts/run exports the processes it starts (QLOC_API_WORKERS); uvicorn started otherwise: as told
        torch.set_num_threads(settings.inference_threads or max(1, usable_cores() // (2 * (settings.api_workers or 1))))
    app.state.inference = BatchedInference(
        app.state.bundles, app.state.store, default_nearest=settings.localize_nearest,
        window_s=settings.batch_window_ms / 1000, max_batch_images=settings.batch_max_images,
        max_queue_images=settings.inference_queue_images, observe=app.state.metrics.engine_batch_began,
        gather_s=settings.batch_gather_ms / 1000)
    app.state.remote = None  # QLOC_INFERENCE=workers: the model runs on the localize queue's workers
    if settings.inference == "workers":
        app.state.inference = app.state.remote = WorkerInference(settings, app.state.queue.celery)
    app.add_middleware(BodyLimitMiddleware, max_body_size=settings.max_request_bytes,
                       max_other_size=settings.max_json_bytes)
    app.add_middleware(RequestMetricsMiddleware, get_metrics=lambda: app.state.metrics)  # outermost: sees 413s
    for module in (exemplar_sets, localize, pool, adaptations, checkpoints, bundles):  # the v1 API: strict
        app.include_router(module.router, dependencies=[Depends(known_parameters)], responses=UNKNOWN_PARAMETER)
    for module in (health, labelstudio):  # probes, and Label Studio's protocol: what they do not take is ignored
        app.include_router(module.router)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    web.install(app)  # the page at / and the API docs, offline
    forms.install()  # a text field that is not valid UTF-8 is a 422, not read as Latin-1
    return app


INPUT_SHOWN = 200
"""Characters of an invalid value a 422 shows back (a 60,000-character header is not echoed whole)."""


def _shown(value: object) -> object:
    if isinstance(value, str | bytes) and len(value) > INPUT_SHOWN:
        return f"{value[:INPUT_SHOWN]!s}... ({len(value)} {'characters' if isinstance(value, str) else 'bytes'})"
    if isinstance(value, StarletteUploadFile):  # not its internals
        return f"a file ({value.filename or 'no filename'}, {value.size} bytes)"
    return value


def _error(e: dict) -> dict:
    if "input" not in e:
        return e
    out = {**e, "input": _shown(e["input"])}
    if isinstance(e["input"], StarletteUploadFile) and e.get("loc", ("",))[0] == "body":  # -F boxes=@boxes.json
        field = e["loc"][1]  # the form field (a list field's loc goes on with the index)
        out["msg"] = (f"{field} is a text field, not a file: send its value (curl -F '{field}=<file' sends a file's "
                      f"text as the value; -F '{field}=@file' sends the file)")
    if "Expected UploadFile" in str(e.get("msg", "")) and len(e.get("loc", ())) >= 2:  # -F files=text
        field = e["loc"][1]
        out["msg"] = (f"{field} takes files, not text: attach one (curl -F '{field}=@image.png'); a part sent "
                      "without a filename (or with an empty one) is read as text: give each file a filename")
        if isinstance(e["input"], str):  # perhaps a whole image read as text: not echoed back
            out["input"] = f"text of {len(e['input'])} characters (not shown)"
    return out


async def validation_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422 for invalid parameters (``detail``: a list of ``{type, loc, msg, input, ...}``), with long
    invalid values cut to their first ``INPUT_SHOWN`` characters, and a file sent for a text field said so."""
    errors = [_error(e) for e in exc.errors()]  # type: ignore[attr-defined]
    return JSONResponse(status_code=422, content={"detail": _encodable(jsonable_encoder(errors))})


HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def _path_methods(request: Request, path: str) -> set[str]:
    """Every method some route of the app takes on ``path`` (asked of each route as the router asks it)."""
    scopes = [{**request.scope, "path": path, "method": m} for m in HTTP_METHODS]
    return {scope["method"] for scope in scopes
            if any(route.matches(scope)[0] == Match.FULL for route in request.app.router.routes)}


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals, with a detail that says what to fix: a 405 names (and its ``Allow`` lists) every
    method the path takes, not only the first route's; a 404 for a path with a trailing slash names the path
    without it. Every other ``HTTPException`` as FastAPI answers it."""
    assert isinstance(exc, HTTPException)
    path = request.url.path
    if exc.status_code == 405:
        allowed = sorted(_path_methods(request, path))
        return JSONResponse({"detail": f"{request.method} is not allowed on {path}: it takes {', '.join(allowed)}"},
                            status_code=405, headers={"Allow": ", ".join(allowed)})
    if exc.status_code == 404 and exc.detail == "Not Found" and len(path) > 1 and path.endswith("/"):
        bare = path.rstrip("/")
        if _path_methods(request, bare):
            return JSONResponse({"detail": f"no such path: {path}; without the trailing slash, {bare}"},
                                status_code=404)
    return await http_exception_handler(request, exc)


def _encodable(value: object) -> object:
    """``value`` (JSON-ready) with what JSON in UTF-8 cannot hold as text: NaN and infinities, lone surrogates
    (a JSON body's ``{"threshold": NaN}`` or ``"\\ud800"``, which Python's parser takes, is echoed in its 422)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_encodable(k): _encodable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_encodable(v) for v in value]
    return value

