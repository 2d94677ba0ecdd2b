"""The FastAPI application factory: ``uvicorn --factory app.main:create_app`` (settings from the environment)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from app.config import Settings, get_settings
from app.db import make_engine, make_sessionmaker
from app.inference import BundleRegistry
from app.metrics import Metrics, RequestMetricsMiddleware
from app.queue import JobQueue
from app.routes import adaptations, checkpoints, exemplar_sets, health
from app.storage import BlobStore

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:  # load the default bundle now, not on the first request; /readyz reports a failure
            app.state.bundles.get(settings.default_bundle)
        except Exception as e:
            log.warning("default bundle %r not loaded: %s", settings.default_bundle, e)
        yield
        app.state.engine.dispose()

    app = FastAPI(
        title="qloc", version="1.0.0", lifespan=lifespan, max_body_size=settings.max_request_bytes,
        description="Query object localization: register exemplar crops, localize the object in images, "
                    "adapt the localization policy to your images without labels.")
    app.state.settings = settings
    app.state.engine = make_engine(settings.database_url)
    app.state.session_factory = make_sessionmaker(app.state.engine)
    app.state.store = BlobStore(settings.storage_dir)
    app.state.bundles = BundleRegistry(settings.bundle_dir, settings.device)
    app.state.queue = JobQueue(settings)
    app.state.metrics = Metrics(app.state.session_factory)
    app.add_middleware(RequestMetricsMiddleware, get_metrics=lambda: app.state.metrics)
    for module in (exemplar_sets, adaptations, checkpoints, health):
        app.include_router(module.router)
    return app

