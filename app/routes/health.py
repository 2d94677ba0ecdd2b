"""Liveness, readiness (database, broker, bundle) and Prometheus metrics.

``/healthz`` and ``/readyz`` are always open (probes carry no key). ``/metrics`` tells how many jobs ran and
how the API is used, so with API keys set it needs one too (any of them), unless ``metrics_auth`` is off.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response, Security, status
from fastapi.security import HTTPAuthorizationCredentials
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from sqlalchemy.orm import Session

from app.config import Settings
from app.deps import BundlesDep, MetricsDep, QueueDep, SessionDep, SettingsDep, _api_key_header, _bearer, get_caller
from app.inference import BundleRegistry
from app.queue import JobQueue
from app.remote import WorkerInference, get_remote
from app.routes.errors import UNAUTHORIZED
from app.schemas import HealthStatus, ReadyStatus

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"])


@router.head("/healthz", response_model=HealthStatus, operation_id="healthz_head")
@router.get("/healthz", response_model=HealthStatus, operation_id="healthz")
def healthz() -> HealthStatus:
    """The process is up (``HEAD`` too: probes that send it)."""
    return HealthStatus(status="ok")


@router.head("/readyz", response_model=ReadyStatus, responses={503: {"model": ReadyStatus}}, operation_id="readyz_head")
@router.get("/readyz", response_model=ReadyStatus, responses={503: {"model": ReadyStatus}}, operation_id="readyz")
def readyz(request: Request, response: Response, session: SessionDep, settings: SettingsDep, queue: QueueDep,
           bundles: BundlesDep) -> ReadyStatus:
    """Ready to serve: the database and the broker answer, the default bundle is loaded (with
    QLOC_INFERENCE=workers, instead: the result backend answers and a worker consumes the localize queue, as
    last checked: ``unknown: ...`` where it cannot be told; the API loads no bundle)."""
    ready = readiness(session, settings, queue, bundles, get_remote(request))
    if ready.status != "ok":
        response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    return ready


def readiness(session: Session, settings: Settings, queue: JobQueue, bundles: BundleRegistry,
              remote: WorkerInference | None) -> ReadyStatus:
    """``/readyz``'s checks, each part's ``ok`` or what failed -> ``ok`` only if every check is (or cannot be told)."""
    checks: dict[str, str] = {}
    try:
        session.execute(text("SELECT 1"))
        session.rollback()
        checks["database"] = "ok"
    except Exception as e:
        log.warning("readiness: database: %s", e)
        checks["database"] = f"error: {type(e).__name__}"
    try:
        queue.ping()
        checks["broker"] = "ok"
    except Exception as e:
        log.warning("readiness: broker: %s", e)
        checks["broker"] = f"error: {type(e).__name__}"
    try:
        if remote is not None:
            remote.ping()
            checks["result_backend"] = "ok"
            checks["localize_workers"] = remote.consumers.readiness()
        else:
            bundles.get(settings.default_bundle)
            checks["bundle"] = "ok"
    except Exception as e:
        log.warning("readiness: %s: %s", "result backend" if remote is not None else "bundle", e)
        checks["result_backend" if remote is not None else "bundle"] = f"error: {e}"
    ok = all(v == "ok" or v.startswith("unknown:") for v in checks.values())  # unknown: cannot tell, not a failure
    return ReadyStatus(status="ok" if ok else "unavailable", checks=checks)


def metrics_access(settings: SettingsDep, api_key: Annotated[str | None, Security(_api_key_header)] = None,
                   bearer: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)] = None) -> None:
    """401 unless the caller may scrape: API keys off, ``metrics_auth`` off, or a valid key (as ``/v1``)."""
    if settings.metrics_auth:
        get_caller(settings, api_key, bearer)


@router.get("/metrics", response_class=Response, dependencies=[Depends(metrics_access)],
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"},
                       **UNAUTHORIZED})
def metrics(m: MetricsDep) -> Response:
    """Prometheus metrics. With API keys set, one is needed (X-API-Key or Bearer) unless ``QLOC_METRICS_AUTH=false``."""
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
