"""Localization on workers (``QLOC_INFERENCE=workers``), end to end on Redis.

A real Celery worker process consumes the localize queue (thread pool, as the README starts it); the API
runs in this process (``TestClient``) and loads no bundle. Everything it answers is compared with the API
in local mode on the same database, blobs and bundle files: the same boxes and scores (float tolerance),
the same prototypes, the same refusals (a replaced bundle: 409, an unknown checkpoint: 404). Without a
worker, a call is answered 503 with ``Retry-After`` after ``QLOC_LOCALIZE_TIMEOUT``.

The localize task's batching and the image wire format are checked in-process below.
"""

from __future__ import annotations

import io
import json
import threading
import time
import uuid
from dataclasses import replace

import numpy as np
import pytest
import torch
from celery.exceptions import TimeoutError as CeleryTimeout
from fastapi.testclient import TestClient
from PIL import Image
from pydantic import ValidationError
from service_fixtures import (
    LIVE_WORKER,
    REDIS_URL,
    SWAPPED,
    VENV_BIN,
    Stack,
    files,
    install_bundle,
    jpeg_bytes,
    make_test_settings,
    png_bytes,
    swapped_settings,
)
from sqlalchemy import select, update

from app.config import Settings
from app.db import make_engine, make_sessionmaker
from app.inference import BundleRegistry
from app.main import create_app
from app.remote import WorkersGone, decode_answer, decode_image, encode_call, encode_image
from app.serving import LocalInference, LocalizeCall
from app.storage import BlobStore
from app.tables import ExemplarSet
from models.calibration import Calibration
from models.core.platt import PlattFit
from models.inference import pil_to_tensor
from worker import localize as on_worker
from worker.context import WorkerContext
from worker.jobs import run_adaptation_job

TOL = 1e-4


def workers_settings(base: Settings, prefix: str, **overrides) -> Settings:
    """``base`` (database, blobs, bundles) in workers mode on the test Redis, queues of its own."""
    values = dict(database_url=base.database_url, broker_url=REDIS_URL, result_backend=REDIS_URL,
                  broker_transport_options={"global_keyprefix": prefix}, queue=f"qloc-test-{uuid.uuid4().hex[:8]}",
                  localize_queue=f"qloc-test-localize-{uuid.uuid4().hex[:8]}", inference="workers",
                  default_bundle=base.default_bundle, localize_timeout=90,
                  **{k: getattr(base, k) for k in LIVE_WORKER})
    values.update(overrides)
    return make_test_settings(base.storage_dir.parent, base.bundle_dir, **values)


def start_localize_worker(st: Stack, hostname: str | None = None, queue: str | None = None,
                          log: str = "localize-worker.log") -> None:
    st.workers.append(st._spawn(  # noqa: SLF001 -- the fixture's own spawner, with the README's localize command
        [str(VENV_BIN / "celery"), "-A", "worker.celery_app", "worker",
         "-Q", queue or st.settings.localize_queue, "--pool", "threads", "--concurrency", "4", "--loglevel=INFO",
         f"--hostname={hostname or f'qloc-localize-{uuid.uuid4().hex[:6]}@%h'}", "--without-mingle",
         "--without-gossip"], log))


@pytest.fixture
def base(tmp_path, versions):
    """Local-mode settings: SQLite, blobs and a bundle directory of their own (``SWAPPED`` v1 installed). Jobs that
    run, not scored, with ``LIVE_WORKER``'s lease: the localize worker process beside them runs a reaper on the same
    database, and with a 2 s lease it once requeued a job this test ran in-process whose beat was late (CI: the job
    "lost")."""
    return swapped_settings(tmp_path, versions, **LIVE_WORKER)


@pytest.fixture
def stack(base, redis_prefix, tmp_path):
    """A localize worker process on Redis for ``base``'s files and database (the API is in-process)."""
    st = Stack(workers_settings(base, redis_prefix), tmp_path)
    start_localize_worker(st)
    try:
        yield st
    finally:
        st.stop()


def prototypes(database_url: str) -> dict[str, np.ndarray]:
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as s:
            return {str(es.id): np.frombuffer(es.prototype, "<f4") for es in s.scalars(select(ExemplarSet))}
    finally:
        engine.dispose()


def palette_png(seed: int) -> bytes:
    img = Image.open(io.BytesIO(png_bytes(70, 50, "RGB", seed=seed))).convert("P")
    img.info["transparency"] = 0
    buf = io.BytesIO()
    img.save(buf, "PNG", transparency=0)
    return buf.getvalue()


def uploads():
    return files(png_bytes(84, 84, seed=31), png_bytes(120, 90, "RGB", seed=32), jpeg_bytes(60, 40, seed=33),
                 palette_png(34), png_bytes(84, 84, "LA", seed=35))


RATIO = Calibration(PlattFit(["log_score"], [0.0], [1.0], [0.0], 0.0),
                    PlattFit(["log_score", "log_ratio"], [0.0, 0.0], [1.0, 1.0], [0.0, -1.0], 0.0)).to_dict()
"""A known calibration: the score's fit says 0.5 whatever the box; the negatives' fit d_n / (d_p + d_n)."""


def negatives_and_calibrations(database_url: str, *set_ids: str) -> list[tuple[np.ndarray, dict]]:
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as s:
            return [(np.frombuffer(es.negatives, "<f4"), es.calibration)
                    for es in (s.get_one(ExemplarSet, uuid.UUID(i)) for i in set_ids)]
    finally:
        engine.dispose()


def set_calibration(database_url: str, set_ids: list[str], calibration: dict) -> None:
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as s:
            s.execute(update(ExemplarSet).where(ExemplarSet.id.in_([uuid.UUID(i) for i in set_ids]))
                      .values(calibration=calibration))
            s.commit()
    finally:
        engine.dispose()


def calibrations(database_url: str, *set_ids: str) -> list[dict]:
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as s:
            return [s.get_one(ExemplarSet, uuid.UUID(i)).calibration for i in set_ids]
    finally:
        engine.dispose()


def same_answers(a: dict, b: dict) -> None:
    assert a["checkpoint_id"] == b["checkpoint_id"] and a["nearest"] == b["nearest"] and a["samples"] == b["samples"]
    assert a["refined"] == b["refined"]
    assert len(a["results"]) == len(b["results"])
    for ra, rb in zip(a["results"], b["results"], strict=True):
        assert (ra["width"], ra["height"], ra["filename"]) == (rb["width"], rb["height"], rb["filename"])
        assert np.allclose(ra["box"], rb["box"], atol=TOL), (ra, rb)
        assert abs(ra["score"] - rb["score"]) < TOL, (ra, rb)
        assert (ra["confidence"] is None) == (rb["confidence"] is None) and ra["found"] == rb["found"], (ra, rb)
        assert ra["confidence"] is None or abs(ra["confidence"] - rb["confidence"]) < TOL, (ra, rb)
        assert ra.get("reranked") == rb.get("reranked"), (ra, rb)
        assert (ra.get("trajectory") is None) == (rb.get("trajectory") is None)
        if ra.get("trajectory") is not None:
            assert np.allclose(ra["trajectory"], rb["trajectory"], atol=TOL)
        assert (ra.get("instances") is None) == (rb.get("instances") is None)
        if ra.get("instances") is not None:
            assert len(ra["instances"]) == len(rb["instances"])
            for ia, ib in zip(ra["instances"], rb["instances"], strict=True):
                assert np.allclose(ia["box"], ib["box"], atol=TOL) and abs(ia["score"] - ib["score"]) < TOL
                assert ia["found"] == ib["found"]
                assert ia.get("confidence") is None or abs(ia["confidence"] - ib["confidence"]) < TOL, (ia, ib)


@pytest.mark.slow
def test_workers_mode_answers_as_local_mode_and_the_api_loads_no_bundle(stack, base, versions):
    workers = stack.settings
    remote_app, local_app = create_app(workers), create_app(base)
    try:
        with TestClient(remote_app) as w, TestClient(local_app) as loc:
            worker_seen(w, stack)  # as a deployment's readiness gate: the worker started with the API
            # a set made on the worker: the same prototype and bundle file as one made in the API
            crops = files(png_bytes(28, 28, seed=1), png_bytes(32, 30, "RGB", seed=2))
            r = w.post("/v1/exemplar-sets", files=crops, data={"name": "remote"})
            assert r.status_code == 201, (r.text, stack.logs())
            es = r.json()
            r = loc.post("/v1/exemplar-sets", files=crops, data={"name": "local"})
            assert r.status_code == 201, r.text
            es_local = r.json()
            assert es["bundle"] == es_local["bundle"] == SWAPPED
            protos = prototypes(base.database_url)
            assert protos[es["id"]].shape == (protos[es_local["id"]].size,)
            assert np.allclose(protos[es["id"]], protos[es_local["id"]], atol=1e-5)
            # and its calibration, fitted on the worker as the API fits it in local mode
            assert es["calibrated"] and es_local["calibrated"] and es["kind"] == es_local["kind"]
            remote_cal, local_cal = calibrations(base.database_url, es["id"], es_local["id"])
            assert remote_cal["version"] == local_cal["version"] and set(remote_cal) == set(local_cal)
            assert remote_cal["templates"] == local_cal["templates"]  # the crops' NCC templates: the same pixels
            assert remote_app.state.remote is not None and local_app.state.remote is None

            url = f"/v1/exemplar-sets/{es['id']}/localize"
            for params in ({"trajectory": "true"}, {"samples": "3"}, {"nearest": "true", "samples": "2"},
                           {"checkpoint": "base", "nearest": "false"}, {"max_instances": "4"}):
                a, b = w.post(url, files=uploads(), params=params), loc.post(url, files=uploads(), params=params)
                assert a.status_code == b.status_code == 200, (params, a.text, b.text, stack.logs())
                same_answers(a.json(), b.json())

            # several requests at once: the worker batches them; each gets its own images' answers
            single = [loc.post(url, files=files(png_bytes(84, 84, seed=50 + i))).json() for i in range(6)]
            answers: list = [None] * 6
            barrier = threading.Barrier(6)

            def one(i: int) -> None:
                barrier.wait()
                answers[i] = TestClient(remote_app).post(url, files=files(png_bytes(84, 84, seed=50 + i)))

            threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            for got, want in zip(answers, single, strict=True):
                assert got is not None and got.status_code == 200, (got and got.text, stack.logs())
                same_answers(got.json(), want)

            # negative exemplars: embedded on the worker; a set whose confidence is their fit (one crop: no NCC fit)
            # has its answers' boxes embedded there too, as local mode embeds them in the API
            with_negatives = (files(png_bytes(28, 28, seed=9))
                              + files(png_bytes(28, 28, seed=5), png_bytes(30, 20, seed=4), field="negative_files"))
            made = [c.post("/v1/exemplar-sets", files=with_negatives).json() for c in (w, loc)]
            assert made[0]["num_negatives"] == made[1]["num_negatives"] == 2, made
            rows = negatives_and_calibrations(base.database_url, made[0]["id"], made[1]["id"])
            assert np.allclose(rows[0][0], rows[1][0], atol=1e-5) and rows[0][0].size == 2 * protos[es["id"]].size
            assert rows[0][1]["negatives"] is not None and rows[0][1].keys() == rows[1][1].keys()
            set_calibration(base.database_url, [m["id"] for m in made], RATIO)  # the negatives' fit, known
            for params in ({}, {"rerank": "true"}, {"max_instances": "4"}):
                a, b = (c.post(f"/v1/exemplar-sets/{m['id']}/localize", files=uploads(), params=params)
                        for c, m in zip((w, loc), made, strict=True))
                assert a.status_code == b.status_code == 200, (params, a.text, b.text, stack.logs())
                same_answers(a.json() | {"checkpoint_id": None}, b.json() | {"checkpoint_id": None})
                assert all(abs(r["confidence"] - 0.5) > 1e-4 for r in a.json()["results"])  # not the score's 0.5

            # an adapted checkpoint (a job run here): read from the shared blobs by the worker
            job = w.post(f"/v1/exemplar-sets/{es['id']}/adaptations", data={"iterations": "2", "activate": "true"},
                         files=files(*[png_bytes(84, 84, seed=60 + i) for i in range(2)]))
            assert job.status_code == 202, job.text
            ctx = WorkerContext.create(base)
            try:
                assert run_adaptation_job(ctx, uuid.UUID(job.json()["id"]), worker="test") == "succeeded"
            finally:
                ctx.engine.dispose()
            a, b = w.post(url, files=uploads()), loc.post(url, files=uploads())
            assert a.status_code == b.status_code == 200, (a.text, b.text)
            assert a.json()["checkpoint_id"] == w.get(f"/v1/exemplar-sets/{es['id']}").json()["active_checkpoint_id"]
            same_answers(a.json(), b.json())

            # an unknown checkpoint: 404 in both modes
            other = str(uuid.uuid4())
            a, b = (c.post(url, files=uploads(), params={"checkpoint": other}) for c in (w, loc))
            assert a.status_code == b.status_code == 404 and a.json() == b.json()

            # the set's bundle file replaced: the same 409 in both modes, for localize and for a new job
            install_bundle(base.bundle_dir, versions["v2"][0], SWAPPED)
            a, b = w.post(url, files=uploads()), loc.post(url, files=uploads())
            assert a.status_code == b.status_code == 409, (a.text, b.text)
            assert a.json() == b.json() and "was replaced" in a.json()["detail"]
            jobs = [c.post(f"/v1/exemplar-sets/{es['id']}/adaptations", data={"iterations": "2"},
                           files=files(png_bytes(84, 84, seed=70))) for c in (w, loc)]
            assert jobs[0].status_code == jobs[1].status_code == 409 and jobs[0].json() == jobs[1].json()
            # a new set takes the new file; the old file back, the old set localizes again
            r = w.post("/v1/exemplar-sets", files=crops)
            assert r.status_code == 201 and prototypes(base.database_url)[r.json()["id"]].size
            install_bundle(base.bundle_dir, versions["v1"][0], SWAPPED)
            assert w.post(url, files=uploads()).status_code == 200

            # an unknown bundle named by the client: 422 in both modes
            a, b = (c.post("/v1/exemplar-sets", files=crops, data={"bundle": "nope"}) for c in (w, loc))
            assert a.status_code == b.status_code == 422 and a.json() == b.json()

            ready = w.get("/readyz").json()
            assert ready["checks"].get("result_backend") == "ok" and "bundle" not in ready["checks"], ready
            assert ready["checks"]["localize_workers"] == "ok", ready
        log = (stack.log_dir / "localize-worker.log").read_text()  # the worker process did the work
        assert all(f"Task {t}[" in log for t in ("qloc.prototype", "qloc.localize", "qloc.check_bundle",
                                                   "qloc.negatives_confidence")), log
        # everything above ran without the workers-mode API loading a bundle
        assert not remote_app.state.bundles.is_loaded(SWAPPED)
        assert local_app.state.bundles.is_loaded(SWAPPED)
    finally:
        remote_app.state.engine.dispose()
        local_app.state.engine.dispose()


def test_no_localize_worker_answers_503_with_retry_after(base, redis_prefix):
    w_settings = workers_settings(base, redis_prefix, localize_timeout=1.5, set_timeout=1.5, localize_worker_check_s=0)
    remote_app, local_app = create_app(w_settings), create_app(base)
    try:
        with TestClient(remote_app) as w, TestClient(local_app) as loc:
            t0 = time.monotonic()
            r = w.post("/v1/exemplar-sets", files=files(png_bytes(28, 28, seed=1)))
            assert r.status_code == 503 and r.headers["retry-after"].isdigit(), r.text
            assert "no localize worker answered within 1.5 s (QLOC_SET_TIMEOUT)" in r.json()["detail"]
            assert w_settings.localize_queue in r.json()["detail"]
            set_id = loc.post("/v1/exemplar-sets", files=files(png_bytes(28, 28, seed=1))).json()["id"]
            r = w.post(f"/v1/exemplar-sets/{set_id}/localize", files=files(png_bytes(84, 84)))
            assert r.status_code == 503 and r.headers["retry-after"].isdigit(), r.text
            assert "qloc_localize_batch_size_count 0.0" in w.get("/metrics").text  # refused: not a batch
            r = w.post(f"/v1/exemplar-sets/{set_id}/adaptations", files=files(png_bytes(84, 84)))
            assert r.status_code == 503 and r.headers["retry-after"].isdigit(), r.text
            assert time.monotonic() - t0 < 20  # three calls of 1.5 s, never a hang
            assert w.get("/v1/exemplar-sets").json()["count"] == 1  # the refused creation stored nothing
    finally:
        remote_app.state.engine.dispose()
        local_app.state.engine.dispose()


def worker_seen(client: TestClient, st: Stack) -> None:
    """Until /readyz says a worker consumes the localize queue."""
    wait_for(lambda: client.get("/readyz").json()["checks"].get("localize_workers") == "ok", 120,
             f"/readyz sees the localize worker ({st.logs()})")


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.2)


@pytest.mark.slow
def test_with_no_worker_on_the_localize_queue_calls_are_refused_at_once_and_readyz_says_so(base, redis_prefix,
                                                                                            tmp_path):
    """The API checks by broadcast that some worker consumes the localize queue: with none seen twice, a call
    waiting is given up and a new one refused at once (not after the 60 s timeout), and /readyz is 503 naming the
    queue; a worker that starts is seen within seconds, and calls are answered again."""
    settings = workers_settings(base, redis_prefix, localize_timeout=60, set_timeout=60, localize_worker_check_s=1)
    app = create_app(settings)
    st = Stack(settings, tmp_path)
    try:
        with TestClient(app) as w:
            r = w.get("/readyz")  # starting, no worker seen yet: not ready (a load balancer sends nothing yet)
            assert r.status_code == 503 and "no worker seen on queue" in r.json()["checks"]["localize_workers"], r.text
            t0 = time.monotonic()  # sent before the watch has seen anything: it waits, until the watch sees no one
            r = w.post("/v1/exemplar-sets", files=files(png_bytes(28, 28, seed=1)))
            assert r.status_code == 503 and "no worker consumes queue" in r.json()["detail"], r.text
            assert time.monotonic() - t0 < 15

            def unready():
                r = w.get("/readyz")
                return r if r.status_code == 503 else None

            r = wait_for(unready, 15, "/readyz sees no localize worker")
            entry = r.json()["checks"]["localize_workers"]
            assert entry.startswith("error: no worker consumes queue") and settings.localize_queue in entry, r.json()
            assert r.json()["checks"]["result_backend"] == "ok" and r.json()["checks"]["broker"] == "ok"
            t0 = time.monotonic()
            r = w.post("/v1/exemplar-sets", files=files(png_bytes(28, 28, seed=1)))
            assert r.status_code == 503 and r.headers["retry-after"].isdigit(), r.text
            assert settings.localize_queue in r.json()["detail"] and "start a localize worker" in r.json()["detail"]
            assert time.monotonic() - t0 < 5  # refused at once: the timeout is 60 s
            assert w.get("/v1/exemplar-sets").json()["count"] == 0

            same = f"same-{uuid.uuid4().hex[:6]}@%h"  # a job worker of the same name beside it (README's defaults
            start_localize_worker(st, same)  # give every worker of a host the name celery@host): still seen, every
            start_localize_worker(st, same, queue=settings.queue, log="job-worker.log")  # time
            worker_seen(w, st)
            wait_for(lambda: "ready" in (tmp_path / "job-worker.log").read_text(), 60, "the job worker started")
            remote = app.state.remote
            seen = []
            for _ in range(6):
                remote.consumers.check()
                seen.append(remote.consumers.workers)
            assert seen == [1] * 6, seen  # inspect() would have kept one reply of the two under that name
            assert w.get("/readyz").status_code == 200
            r = w.post("/v1/exemplar-sets", files=files(png_bytes(28, 28, seed=1)))
            assert r.status_code == 201, (r.text, st.logs())
            r = w.post(f"/v1/exemplar-sets/{r.json()['id']}/localize", files=files(png_bytes(84, 84)))
            assert r.status_code == 200, r.text
    finally:
        st.stop()
        app.state.engine.dispose()


class _Waiting:
    """A call's result as ``WorkerInference._wait`` reads it: never ready, in ``state`` (started by ``worker``)."""

    def __init__(self, state: str, worker: str | None = None):
        self.state = state
        self.info = {"pid": 1, "hostname": worker} if worker else None

    def get(self, timeout: float, propagate: bool):
        time.sleep(timeout)
        raise CeleryTimeout


def test_a_call_no_worker_has_started_is_given_up_and_a_started_one_is_waited_for(tmp_path, bundle_dir):
    """With no worker seen, a call still in the queue (PENDING) is given up at the next look; one a worker started
    (a worker stopping gracefully finishes it) is waited for until its timeout."""
    settings = make_test_settings(tmp_path, bundle_dir, inference="workers", result_backend="cache+memory://",
                                  localize_worker_check_s=0)
    remote = create_app(settings).state.remote
    remote.consumers.misses, remote.consumers.checked_at = 2, time.monotonic()  # no worker, twice
    t0 = time.monotonic()
    with pytest.raises(WorkersGone, match="no worker consumes queue"):
        remote._wait(_Waiting("PENDING"), 30)  # noqa: SLF001
    assert time.monotonic() - t0 < 3
    t0 = time.monotonic()
    with pytest.raises(CeleryTimeout):
        remote._wait(_Waiting("STARTED"), 2.5)  # noqa: SLF001
    assert time.monotonic() - t0 >= 2.4


def test_a_call_whose_worker_is_gone_is_given_up_and_one_whose_worker_answers_is_waited_for(tmp_path, bundle_dir):
    """A started call names its worker: when that worker was not among the queue's consumers at the last two checks
    (killed; another one still consumes), the call is given up at the next look; with its worker still seen, or
    seen at one of the last two checks only, it is waited for."""
    settings = make_test_settings(tmp_path, bundle_dir, inference="workers", result_backend="cache+memory://",
                                  localize_worker_check_s=0)
    remote = create_app(settings).state.remote
    watch = remote.consumers
    watch.recent.extend([frozenset({"localize@a"}), frozenset({"localize@a"})])
    watch.checked_at, watch.workers = time.monotonic(), 1
    t0 = time.monotonic()
    with pytest.raises(WorkersGone, match="'localize@b' that was running this call is gone"):
        remote._wait(_Waiting("STARTED", "localize@b"), 30)  # noqa: SLF001
    assert time.monotonic() - t0 < 3
    for recent, worker in (([{"localize@a"}, {"localize@a"}], "localize@a"),
                           ([{"localize@b"}, {"localize@a"}], "localize@b"), ([{"localize@a"}], "localize@b")):
        watch.recent.clear()
        watch.recent.extend(frozenset(names) for names in recent)
        watch.checked_at = time.monotonic()
        t0 = time.monotonic()
        with pytest.raises(CeleryTimeout):
            remote._wait(_Waiting("STARTED", worker), 2.5)  # noqa: SLF001
        assert time.monotonic() - t0 >= 2.4, (recent, worker)
    watch.checked_at = time.monotonic() - 60  # the watch stopped: its names tell nothing
    watch.recent.extend([frozenset({"localize@a"}), frozenset({"localize@a"})])
    assert watch.gone("localize@b") is None
    watch.recent.clear()
    assert not watch.went_missing()  # one check: nothing to compare
    watch.recent.extend([frozenset({"localize@a", "localize@b"}), frozenset({"localize@a"})])
    assert watch.went_missing()  # b missing at the last check: the next one comes within ABSENT_EVERY_S
    watch.recent.append(frozenset({"localize@a", "localize@b"}))
    assert not watch.went_missing()  # one more worker is no absence


@pytest.mark.slow
def test_a_call_started_by_a_worker_killed_mid_call_is_given_up_within_seconds(base, redis_prefix, tmp_path):
    """A localize worker killed with -9 while it runs a call (its state STARTED, naming it, in the real result
    backend) while another worker still consumes the queue: the call is given up once the watch has missed the dead
    worker twice (the second check within a second of the first: not a whole interval of 5 s later), not after its
    timeout; the API goes on answering through the other worker."""
    settings = workers_settings(base, redis_prefix, localize_timeout=60, set_timeout=60, localize_worker_check_s=5)
    app = create_app(settings)
    st = Stack(settings, tmp_path)
    doomed = f"doomed-{uuid.uuid4().hex[:6]}@qloc-test"
    try:
        with TestClient(app) as w:
            start_localize_worker(st, doomed)
            start_localize_worker(st, log="other-worker.log")
            remote = app.state.remote
            wait_for(lambda: remote.consumers.workers == 2, 120, f"both localize workers seen ({st.logs()})")
            call = remote.celery.AsyncResult(str(uuid.uuid4()))
            remote.celery.backend.store_result(call.id, {"pid": st.workers[0].pid, "hostname": doomed}, "STARTED")
            outcome: list[BaseException | float] = []

            def wait() -> None:
                t0 = time.monotonic()
                try:
                    remote._wait(call, 60)  # noqa: SLF001
                except BaseException as e:  # noqa: BLE001 -- checked below
                    outcome.extend([e, time.monotonic() - t0])

            waiter = threading.Thread(target=wait)
            waiter.start()
            time.sleep(4)
            assert not outcome, outcome  # its worker is alive: waited for
            t_kill = time.monotonic()
            st.kill(st.workers[0])
            waiter.join(30)
            assert outcome and isinstance(outcome[0], WorkersGone), (outcome, st.logs())
            assert doomed in str(outcome[0])
            assert time.monotonic() - t_kill < 5 + 7, outcome  # the next check, then one a second later
            r = w.post("/v1/exemplar-sets", files=files(png_bytes(28, 28, seed=1)))
            assert r.status_code == 201, (r.text, st.logs())
            assert w.get("/readyz").json()["checks"]["localize_workers"] == "ok"
    finally:
        st.stop()
        app.state.engine.dispose()


def test_a_dead_result_backend_is_refused_at_once_and_named(tmp_path, bundle_dir, redis_prefix):
    """Sending a call first waits on the result backend's connection retries (~20 s); with it down at the last
    check, calls are refused at once, saying it is the result backend (not the queue)."""
    settings = make_test_settings(tmp_path, bundle_dir, inference="workers", broker_url=REDIS_URL,
                                  broker_transport_options={"global_keyprefix": redis_prefix},
                                  result_backend="redis://127.0.0.1:1/0", localize_worker_check_s=0)
    app = create_app(settings)
    try:
        with TestClient(app) as w:
            app.state.remote.consumers.check()
            assert app.state.remote.consumers.backend_error is not None
            t0 = time.monotonic()
            r = w.post("/v1/exemplar-sets", files=files(png_bytes(28, 28, seed=1)))
            assert r.status_code == 503 and "result backend (QLOC_RESULT_BACKEND) is unreachable" in r.json()[
                "detail"], r.text
            assert time.monotonic() - t0 < 5
            assert w.get("/readyz").json()["checks"]["result_backend"].startswith("error")
    finally:
        app.state.engine.dispose()


def test_the_localize_watch_tells_nothing_where_the_broker_cannot_broadcast(tmp_path, bundle_dir):
    """The embedded default's SQLAlchemy transport has no fanout: the watch never takes that for an absence."""
    settings = make_test_settings(tmp_path, bundle_dir, inference="workers", result_backend="cache+memory://")
    remote = create_app(settings).state.remote
    remote.consumers.check()
    remote.consumers.check()
    assert remote.consumers.absent() is None and remote.consumers.workers is None
    assert remote.consumers.readiness().startswith("unknown: the broker") and "cannot broadcast" in \
        remote.consumers.readiness()


def test_a_broker_that_broadcasts_but_cannot_be_asked_is_not_ready(tmp_path, bundle_dir):
    """Redis down (or coming back): the broadcast fails, no worker is known to take calls, so ``/readyz``'s entry is
    an error (a load balancer sent calls here while it read ``unknown``); once asked again, as before."""
    settings = make_test_settings(tmp_path, bundle_dir, inference="workers", broker_url="redis://127.0.0.1:1/0",
                                  result_backend="cache+memory://", localize_worker_check_s=0)
    watch = create_app(settings).state.remote.consumers
    watch.check()
    assert watch.ask_error is not None and watch.readiness().startswith("error: cannot ask the workers")
    watch.ask_error = None  # a broadcast that went through since
    assert watch.readiness().startswith("unknown:")


def test_workers_mode_refuses_to_start_without_a_result_backend(tmp_path, bundle_dir):
    with pytest.raises(ValidationError, match="QLOC_INFERENCE=workers needs QLOC_RESULT_BACKEND"):
        make_test_settings(tmp_path, bundle_dir, inference="workers")
    with pytest.raises(ValidationError, match="QLOC_LOCALIZE_QUEUE must differ from QLOC_QUEUE"):
        make_test_settings(tmp_path, bundle_dir, localize_queue="qloc")
    assert make_test_settings(tmp_path, bundle_dir).inference == "local"  # the embedded default


# --- in-process: the batcher of the localize worker, and images on the wire


def _call(proto: bytes, dim: int, images, **kw) -> LocalizeCall:
    return LocalizeCall(bundle="test-digits", bundle_sha256=None, prototype_dim=dim, prototype=proto,
                        checkpoint=None, images=images, **kw)


def test_the_localize_task_batches_concurrent_calls_with_the_same_answers(bundle_dir, tmp_path, monkeypatch):
    """``qloc.localize`` as the worker runs it (wire format in and out), called from threads at once (as the
    thread pool does): the greedy calls run as one forward pass, each sampled call alone, a refused call
    refused alone; every answer is the call's own, as if run by itself in the API."""
    settings = make_test_settings(tmp_path, bundle_dir, batch_window_ms=1000)
    ctx = WorkerContext.create(settings)
    monkeypatch.setattr(on_worker, "_backends", {})  # this process's backend, new: its counts are this test's
    local = LocalInference(BundleRegistry(bundle_dir, "cpu"), BlobStore(tmp_path))
    loaded = ctx.bundles.get("test-digits")
    protos = [loaded.localizer.prototype([Image.open(io.BytesIO(png_bytes(28, 28, seed=s)))]) for s in (1, 2)]
    raws, dim = [p.numpy().astype("<f4").tobytes() for p in protos], int(protos[0].numel())
    # decoded in full, as the API hands them over (a lazily decoded PIL image is not safe to share by threads)
    images = [[Image.open(io.BytesIO(png_bytes(84 + 6 * i, 84, seed=i))).convert("L")] for i in range(4)]
    calls = [_call(raws[i % 2], dim, ims, trajectory=i % 2 == 0) for i, ims in enumerate(images)]
    calls.append(_call(raws[0], dim, images[0], samples=3))  # runs alone: its random stream spans its images
    calls.append(_call(raws[1], dim, images[1] + images[2], samples=3))
    calls.append(replace(calls[0], bundle_sha256="0" * 64))  # another bundle file made this "set"
    got: list = [None] * len(calls)
    # each call on the wire before the threads start: from the barrier to its submit a thread only decodes it (on a
    # loaded 2-core machine, encoding it there too once took a greedy call past the 1 s window: 4 batches)
    wire = [json.loads(json.dumps(encode_call(call))) for call in calls]
    barrier = threading.Barrier(len(calls))

    def run(i: int) -> None:
        barrier.wait()
        got[i] = on_worker.localize(ctx, wire[i])

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stats = on_worker.inference(ctx).batcher.stats
        assert (stats.items, stats.batches) == (6, 3), stats  # 4 greedy calls at once; 2 alone; 1 refused first
    finally:
        for backend in on_worker._backends.values():
            backend.close()
        ctx.engine.dispose()
    for call, answer in zip(calls[:-1], got, strict=False):
        answer, want = decode_answer(answer), local.localize(call)
        assert answer.nearest == want.nearest and len(answer.results) == len(want.results)
        for a, b in zip(answer.results, want.results, strict=True):
            assert np.allclose(a.box, b.box, atol=TOL) and abs(a.score - b.score) < TOL
            assert (a.trajectory is None) == (not call.trajectory)
            if call.trajectory:
                assert np.allclose(a.trajectory, b.trajectory, atol=TOL)
    assert got[-1]["refused"]["status"] == 409 and "was replaced" in got[-1]["refused"]["detail"], got[-1]


@pytest.mark.parametrize("mode", ["1", "L", "LA", "RGB", "RGBA", "P", "P-transparent", "L-transparent",
                                  "I;16", "CMYK"])
def test_images_cross_the_wire_as_the_model_sees_them(mode):
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (23, 37, 3), dtype=np.uint8))
    if mode == "P-transparent":
        img = rgb.convert("P")
        img.info["transparency"] = 3
    elif mode == "L-transparent":
        img = rgb.convert("L")
        img.info["transparency"] = 100
    elif mode == "I;16":
        img = Image.fromarray(rng.integers(0, 65536, (23, 37), dtype=np.uint16))
    else:
        img = rgb.convert(mode)
    back = decode_image(json.loads(json.dumps(encode_image(img))))
    assert back.size == img.size
    for channels in (1, 3):
        for fill in ((0.0,), (0.5, 0.2, 0.9)):
            assert torch.equal(pil_to_tensor(back, channels, fill), pil_to_tensor(img, channels, fill)), mode


def test_the_worker_logs_a_tasks_success_without_its_return_value(caplog):
    """A localize answer or a new set's prototype is data, not a log line: the success line names the task, its id
    and run time only."""
    import logging

    import celery.app.trace as trace

    import worker.celery_app  # noqa: F401 -- sets the line's format

    with caplog.at_level(logging.INFO, logger="celery.app.trace"):
        trace.info(trace.LOG_SUCCESS, {"id": "1", "name": "qloc.prototype", "return_value": "{'prototype': 'AAAA'}",
                                       "runtime": 0.5, "args": "()", "kwargs": "{}"})
    assert "Task qloc.prototype[1] succeeded in 0.5s" in caplog.text and "AAAA" not in caplog.text
