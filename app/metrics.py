"""Prometheus metrics: request latency, localize batch sizes, and job counts / durations read from SQL.

Jobs run in worker processes, so their counts and durations are collected from the job table at
scrape time (SQL is the source of truth); the API's own histograms live in its process. With several API
processes (``QLOC_API_WORKERS``; ``scripts/run`` then sets ``PROMETHEUS_MULTIPROC_DIR``), each writes its
histograms to files there and a scrape, whichever process answers it, adds up every process's files
(prometheus_client's multiprocess mode).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, multiprocess
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import crud
from app.jobstates import JOB_STATES

log = logging.getLogger(__name__)


class JobCollector:
    def __init__(self, session_factory: sessionmaker[Session]):
        self.session_factory = session_factory

    def collect(self):  # type: ignore[no-untyped-def]
        try:
            with self.session_factory() as session:
                counts = crud.job_counts(session)
                durations = crud.job_duration_stats(session)
        except Exception:  # the scrape must not fail because the database is down
            log.exception("could not read job metrics")
            return
        jobs = GaugeMetricFamily("qloc_jobs", "Adaptation jobs by status", labels=["status"])
        for status in JOB_STATES:
            jobs.add_metric([status], counts.get(status, 0))
        yield jobs
        # Gauges, not a summary: read from the job rows on record, they go down when a set (and its jobs) is
        # deleted, which Prometheus would take for a counter reset (rate() and increase() inventing jobs).
        mean = GaugeMetricFamily("qloc_job_duration_seconds_mean", "Mean run time of the finished adaptation jobs "
                                 "on record (their number: qloc_jobs)", labels=["status"])
        recorded = GaugeMetricFamily("qloc_job_duration_seconds_recorded_sum", "Total run time of the finished "
                                    "adaptation jobs on record (goes down when a set's jobs are deleted)",
                                    labels=["status"])
        for status, (n, total) in sorted(durations.items()):
            if n:
                mean.add_metric([status], total / n)
                recorded.add_metric([status], total)
        yield mean
        yield recorded


class Metrics:
    def __init__(self, session_factory: sessionmaker[Session]):
        self.registry = CollectorRegistry()  # what /metrics exposes
        shared = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if shared:  # several API processes: the histograms go to files, a scrape reads every process's
            multiprocess.MultiProcessCollector(self.registry, path=shared)
        own = None if shared else self.registry  # registered in both would count this process twice
        self.request_latency = Histogram(
            "qloc_http_request_duration_seconds", "HTTP request latency", ["method", "route", "status"],
            registry=own, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.localize_batch = Histogram(
            "qloc_localize_batch_size", "Images per answered localize request", registry=own,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        self.engine_batch = Histogram(
            "qloc_engine_batch_images", "Images per forward pass of the API's localize engine (requests batched "
            "together)", registry=own, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.engine_wait = Histogram(
            "qloc_engine_wait_seconds", "How long each localize call waited for the engine before its batch began",
            registry=own, buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        self.episode_compiles = Counter(
            "qloc_episode_compiles_total", "Bundles whose greedy episode this process compiled (QLOC_COMPILE_EPISODE; "
            "one image, then batches of 2-15), by outcome of the one-image compile: compiled, or failed (served "
            "eager)", ["outcome"], registry=own)
        self.second_looks = Counter(
            "qloc_localize_second_looks_total", "Localize answers looked at again by rerank=templates (the default) "
            "or auto (their confidence below half the set's threshold: the several-instances search, and with "
            "templates template matching, run on the image), by outcome: reranked (a candidate reaching the "
            "threshold answered instead) or kept", ["outcome"], registry=own)
        self.registry.register(JobCollector(session_factory))

    def episode_compiled(self, outcome: str) -> None:
        """``app.warmup.EpisodeWarmup``'s ``observe``: one bundle's episode ``"compiled"`` or ``"failed"``."""
        self.episode_compiles.labels(outcome).inc()

    def engine_batch_began(self, images: int, waits: list[float]) -> None:
        """``app.batching.Batcher``'s ``observe``: one batch of ``images``, each call's wait for it."""
        self.engine_batch.observe(images)
        for w in waits:
            self.engine_wait.observe(w)


class RequestMetricsMiddleware:
    """Observes each HTTP request's latency under its route template (not the raw path: bounded labels)."""

    def __init__(self, app: ASGIApp, get_metrics: Callable[[], Metrics]):
        self.app = app
        self.get_metrics = get_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.get_metrics().request_latency.labels(scope["method"], template, str(status)).observe(
                time.perf_counter() - start)
