"""Typed dependencies of the routes: settings, database session, blob store, bundles, queue, caller; and the path
and paging parameters they share, described once for the OpenAPI schema."""

from __future__ import annotations

import hashlib
import hmac
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Query, Request, Security, status
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from app.config import Settings
from app.inference import BundleRegistry
from app.metrics import Metrics
from app.queue import JobQueue
from app.serving import InferenceBackend
from app.storage import BlobStore


# The plain getters are async: FastAPI runs each sync dependency on a thread of its pool (a hop per request).
async def get_settings_dep(request: Request) -> Settings:
    return request.app.state.settings


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.session_factory() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


async def get_store(request: Request) -> BlobStore:
    return request.app.state.store


StoreDep = Annotated[BlobStore, Depends(get_store)]


async def get_bundles(request: Request) -> BundleRegistry:
    return request.app.state.bundles


BundlesDep = Annotated[BundleRegistry, Depends(get_bundles)]


async def get_queue(request: Request) -> JobQueue:
    return request.app.state.queue


QueueDep = Annotated[JobQueue, Depends(get_queue)]


async def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


MetricsDep = Annotated[Metrics, Depends(get_metrics)]


async def get_inference(request: Request) -> InferenceBackend:
    return request.app.state.inference


InferenceDep = Annotated[InferenceBackend, Depends(get_inference)]


@dataclass(frozen=True)
class Serving:
    """What the localize path reads from the app, as one dependency: FastAPI resolves each dependency on every
    request, and one client's 1-image latency felt six of them (BENCHMARKS.md, concurrent clients)."""

    settings: Settings
    store: BlobStore
    bundles: BundleRegistry
    metrics: Metrics
    inference: InferenceBackend
    local: bool
    """Whether this process runs the model (not ``QLOC_INFERENCE=workers``)."""
    turns: threading.BoundedSemaphore
    """The localize path's turns (``QLOC_ROUTE_THREADS``; ``app.routes.localize.localize_files``)."""


async def get_serving(request: Request) -> Serving:
    st = request.app.state
    return Serving(st.settings, st.store, st.bundles, st.metrics, st.inference,
                   getattr(st, "remote", None) is None, st.route_turns)


ServingDep = Annotated[Serving, Depends(get_serving)]

_api_key_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="One of QLOC_API_KEYS")
_bearer = HTTPBearer(auto_error=False, description="Authorization: Bearer <one of QLOC_API_KEYS>")


def owner_of(api_key: str) -> str:
    """What rows record as their owner: a digest of the key, never the key itself."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Caller:
    scope: str | None
    """Owner to filter by; None when auth is off (everything is visible)."""

    @property
    def owner(self) -> str:
        """Owner to record on new rows."""
        return self.scope or ""


def get_caller(settings: SettingsDep, api_key: Annotated[str | None, Security(_api_key_header)] = None,
               bearer: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)] = None) -> Caller:
    if not settings.auth_enabled:
        return Caller(None)
    if api_key and bearer and not hmac.compare_digest(api_key.encode(), bearer.credentials.encode()):
        # two keys would be two tenants: which one was meant cannot be told (the X-API-Key won, silently)
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "two different API keys given (X-API-Key and Bearer): "
                            "send one", headers={"WWW-Authenticate": "Bearer"})
    key = api_key or (bearer.credentials if bearer else None)
    # Compare against every key, in constant time per key.
    if not key or not any([hmac.compare_digest(key.encode(), k.encode()) for k in settings.api_keys]):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing or invalid API key (X-API-Key or Bearer)",
                            headers={"WWW-Authenticate": "Bearer"})
    return Caller(owner_of(key))


async def caller_dep(settings: SettingsDep, api_key: Annotated[str | None, Security(_api_key_header)] = None,
                     bearer: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)] = None) -> Caller:
    """``get_caller`` as a dependency, run on the event loop (no thread hop: it only compares keys)."""
    return get_caller(settings, api_key, bearer)


CallerDep = Annotated[Caller, Depends(caller_dep)]


SetId = Annotated[uuid.UUID, Path(description="The exemplar set's id (its `id`)")]
JobId = Annotated[uuid.UUID, Path(description="The adaptation job's id (its `id`)")]
CheckpointId = Annotated[uuid.UUID, Path(description="The checkpoint's id (its `id`)")]
PoolImageId = Annotated[uuid.UUID, Path(description="The pool image's id (its `id`)")]
Limit = Annotated[int, Query(ge=1, le=200, description="Items per page (1 to 200)")]
Offset = Annotated[int, Query(ge=0, le=2**31 - 1, description="Items skipped before the page: a page's `offset` "
                                                                "plus its `limit` gives the next one")]
