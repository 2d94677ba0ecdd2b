"""Liveness, readiness (database, broker, bundle) and Prometheus metrics."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Response, status
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from app.deps import BundlesDep, MetricsDep, QueueDep, SessionDep, SettingsDep
from app.schemas import HealthStatus, ReadyStatus

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthStatus)
def healthz() -> HealthStatus:
    """The process is up."""
    return HealthStatus(status="ok")


@router.get("/readyz", response_model=ReadyStatus, responses={503: {"model": ReadyStatus}})
def readyz(response: Response, session: SessionDep, settings: SettingsDep, queue: QueueDep,
           bundles: BundlesDep) -> ReadyStatus:
    """Ready to serve: the database and the broker answer, the default bundle is loaded."""
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
        bundles.get(settings.default_bundle)
        checks["bundle"] = "ok"
    except Exception as e:
        log.warning("readiness: bundle: %s", e)
        checks["bundle"] = f"error: {e}"
    ok = all(v == "ok" for v in checks.values())
    if not ok:
        response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    return ReadyStatus(status="ok" if ok else "unavailable", checks=checks)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
def metrics(m: MetricsDep) -> Response:
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
