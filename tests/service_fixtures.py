"""Fixtures and helpers shared by the service's tests (``tests/app``, ``tests/worker``).

Tests run against real SQL, a real broker and real files: SQLite + Celery's SQLAlchemy transport
in a temporary directory (the embedded default), and PostgreSQL + Redis on this machine (a fresh
database and a unique Redis key prefix per run, removed afterwards). PostgreSQL and Redis being
down is a failure, never a skip: CI starts them.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from alembic import command
from alembic.config import Config
from PIL import Image
from sqlalchemy import func, select, update
from starlette.datastructures import Headers, UploadFile

from app import crud
from app.config import Settings
from app.db import make_engine, make_sessionmaker
from app.queue import declare_queues
from app.tables import AdaptationJob, Checkpoint, Exemplar, ExemplarSet, JobImage, PoolImage

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
PG_ADMIN_URL = os.environ.get("QLOC_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("QLOC_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
TEST_BUNDLES = ("test-digits", "test-other")


# --- images


def upload_file(data: bytes, filename: str | None = "a.png", ctype: str = "image/png") -> UploadFile:
    """Bytes as a route receives an uploaded file (Starlette's ``UploadFile``), for calling route bodies directly."""
    return UploadFile(io.BytesIO(data), filename=filename, headers=Headers({"content-type": ctype}))


def png_bytes(width: int = 84, height: int = 84, mode: str = "L", seed: int = 0, square: bool = True) -> bytes:
    """A dark image with a bright square (a stand-in for a digit), PNG-encoded."""
    rng = np.random.default_rng(seed)
    arr = (rng.random((height, width)) * 40).astype(np.uint8)
    if square:
        s = max(2, min(width, height) // 3)
        y, x = rng.integers(0, height - s + 1), rng.integers(0, width - s + 1)
        arr[y:y + s, x:x + s] = 230
    buf = io.BytesIO()
    Image.fromarray(arr).convert(mode).save(buf, "PNG")
    return buf.getvalue()


def jpeg_bytes(width: int = 60, height: int = 40, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.open(io.BytesIO(png_bytes(width, height, "RGB", seed))).save(buf, "JPEG")
    return buf.getvalue()


def square_verifier(monkeypatch: pytest.MonkeyPatch, seeds: tuple[int, ...] = (9, 10)) -> Any:
    """A known-kinds verifier (kinds "square" and "background", sha256 "test verifier") to which the crops
    ``png_bytes(28, 28, seed=k)`` of ``seeds`` are "square", served as every bundle's -> the verifier."""
    import torch

    from app.inference import BundleRegistry
    from models.inference import pil_to_tensor
    from models.verifier import KindVerifier

    crops = [pil_to_tensor(Image.open(io.BytesIO(png_bytes(28, 28, seed=k))), 1, (0.0,)) for k in seeds]
    torch.manual_seed(0)
    v = KindVerifier(1, ["square", "background"])
    proto, _, _ = v.nearest_kind(crops)
    v.kinds.copy_(torch.stack([proto, -proto]))
    v.sha256 = "test verifier"
    monkeypatch.setattr(BundleRegistry, "verifier", lambda self, name: v)
    return v


def files(*blobs: bytes, content_type: str = "image/png", field: str = "files") -> list[tuple[str, Any]]:
    return [(field, (f"img{i}.png", b, content_type)) for i, b in enumerate(blobs)]


# --- settings, database, bundles


@pytest.fixture(scope="session")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random-weight bundles in the real format, so tests do not depend on the trained one."""
    from models.bundle import new_bundle, save_bundle
    from models.presets import mnist_config

    d = tmp_path_factory.mktemp("bundles")
    for seed, name in enumerate(TEST_BUNDLES):
        save_bundle(d / f"{name}.pt", new_bundle(name, mnist_config(), seed=seed))
    return d


class RecordingQueue:
    """The job queue (``app.queue.JobQueue``) as the routes use it: records each send; ``error`` makes every send
    fail."""

    def __init__(self, error: Exception | None = None):
        self.sent: list[uuid.UUID] = []
        self.error = error

    def enqueue_adaptation(self, job_id: uuid.UUID) -> None:
        if self.error is not None:
            raise self.error
        self.sent.append(job_id)


class BundleCheck:
    """Workers mode's bundle check (``WorkerInference.check_bundle``): records each; ``refused`` (an
    ``InferenceRefused``) answers it."""

    def __init__(self, refused: Exception | None = None):
        self.checked: list[tuple] = []
        self.refused = refused

    def check_bundle(self, name: str, *, sha256: str, prototype_dim: int) -> None:
        self.checked.append((name, sha256, prototype_dim))
        if self.refused is not None:
            raise self.refused


def make_test_settings(root: Path, bundle_dir: Path, **overrides: Any) -> Settings:
    """Embedded-default settings under ``root``, with short job timings."""
    values: dict[str, Any] = dict(
        database_url=f"sqlite:///{root}/qloc.db", broker_url=f"sqla+sqlite:///{root}/celery-broker.db",
        storage_dir=root / "blobs", bundle_dir=bundle_dir, default_bundle=TEST_BUNDLES[0], device="cpu",
        checkpoint_every=2, default_iterations=4, max_iterations=50, adapt_batch_size=4, repair_epochs=3,
        early_stop_patience=0, compile_episode=False,
        heartbeat_interval=0.3, heartbeat_timeout=2.0, reaper_interval=0.5, job_soft_time_limit=120,
        job_time_limit=150, max_files_per_request=8, max_file_bytes=200_000, max_image_pixels=1_000_000)
    values.update(overrides)
    return Settings(**values)


SMALL_CALIBRATIONS: dict[str, Any] = {"calibration_samples": 16}
"""For tests about what is served, not about calibration (``test_app_calibration.py``, ``test_worker_calibration.py``
are): a set's and a job's "not found" calibration fit on 16 pasted crops and synthesized backgrounds, not 128 (at 128
the refresh of a job's checkpoints is about half to three quarters of a small job's time on a CPU)."""

FAST_JOB: dict[str, Any] = {"synthetic_probes": 16, **SMALL_CALIBRATIONS}
"""Overrides for tests that need jobs to run (leases, recovery, delivery, checkpoints), not to score them on many
probes: 16 synthetic probes, the fewest with which the reward repair still runs (``models.repair.MIN_TRAIN_PROBES``),
instead of 256, and ``SMALL_CALIBRATIONS``. A job's setup (repair, probes, guard) and end (its calibration refresh)
then take a small part of the time."""

LIVE_WORKER: dict[str, Any] = {**FAST_JOB, "heartbeat_timeout": 6.0}
"""``FAST_JOB`` for a job run by a Celery worker in a subprocess, with a lease that outlives several late beats
(``heartbeat_interval`` 0.3 s): on a loaded 2-core machine the 2 s of ``make_test_settings`` let the worker's own
reaper requeue a live job whose pool process beat late, until the job failed on its attempts. A dead worker's job
is still taken over within 6 s of its last beat, sooner than its replacement worker is ready."""


def live_worker_settings(root: Path, bundle_dir: Path, **overrides: Any) -> Settings:
    """``make_test_settings`` with ``LIVE_WORKER`` (for ``running_stack``'s ``make``)."""
    return make_test_settings(root, bundle_dir, **{**LIVE_WORKER, **overrides})


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that makes a subprocess read ``settings``."""
    import json

    env = {}
    for name, value in settings.model_dump().items():
        if value is None:  # unset: the subprocess keeps the field's default
            continue
        if name == "api_keys":
            value = ",".join(value)
        elif isinstance(value, dict):
            value = json.dumps(value)
        env[f"QLOC_{name.upper()}"] = str(value)
    return env


def migrate(database_url: str) -> None:
    cfg = Config(str(REPO / "alembic.ini"))
    cfg.attributes["database_url"] = database_url
    cfg.attributes["configure_logger"] = False
    command.upgrade(cfg, "head")


@pytest.fixture(scope="session")
def postgres_admin_url() -> str:
    import psycopg

    url = PG_ADMIN_URL.replace("postgresql+psycopg://", "postgresql://")
    try:
        psycopg.connect(url, connect_timeout=5).close()
    except psycopg.OperationalError as e:  # CI must start PostgreSQL: fail, never skip
        pytest.fail(f"PostgreSQL is not reachable at {url}: {e}")
    return url


@pytest.fixture
def postgres_url(postgres_admin_url: str) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for one test; dropped afterwards."""
    import psycopg

    name = f"qloc_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_URL.rsplit("/", 1)[0]
    url = f"{base}/{name}"
    migrate(url)
    yield url
    with psycopg.connect(postgres_admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    """A unique key prefix on the test Redis for one test; its keys are deleted afterwards."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        client.ping()
    except redis.RedisError as e:  # CI must start Redis: fail, never skip
        pytest.fail(f"Redis is not reachable at {REDIS_URL}: {e}")
    prefix = f"qloc-test-{uuid.uuid4().hex[:12]}:"
    yield prefix
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def settings(tmp_path: Path, bundle_dir: Path) -> Settings:
    """Embedded-default settings in a fresh directory, database migrated."""
    s = make_test_settings(tmp_path, bundle_dir)
    migrate(s.database_url)
    return s


@pytest.fixture(params=["sqlite", "postgresql"])
def db_settings(request: pytest.FixtureRequest, tmp_path: Path, bundle_dir: Path) -> Settings:
    """``settings`` on SQLite, then on a fresh PostgreSQL database: a test of SQL behaviour runs on both."""
    if request.param == "sqlite":
        return request.getfixturevalue("settings")
    return make_test_settings(tmp_path, bundle_dir, database_url=request.getfixturevalue("postgres_url"))


@pytest.fixture
def api(db_settings: Settings):  # type: ignore[no-untyped-def]
    """The API on ``db_settings`` (SQLite, then PostgreSQL), without lifespan: a request that dies takes only
    its own event loop down."""
    from fastapi.testclient import TestClient

    from app.main import create_app

    app = create_app(db_settings)
    yield TestClient(app)
    app.state.engine.dispose()


@pytest.fixture
def ctx(db_settings: Settings):  # type: ignore[no-untyped-def]
    """A worker context on ``db_settings``."""
    from worker.context import WorkerContext

    c = WorkerContext.create(db_settings)
    yield c
    c.engine.dispose()


def register_set(client) -> str:  # type: ignore[no-untyped-def]
    """Create an exemplar set from one crop -> its id."""
    r = client.post("/v1/exemplar-sets", files=files(png_bytes(28, 28, seed=9)))
    assert r.status_code == 201, r.text
    return r.json()["id"]


@pytest.fixture
def client(settings: Settings):  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    from app.main import create_app

    with TestClient(create_app(settings)) as c:
        yield c


def blob(position: int, box: tuple[float, float, float, float] | None = None, name: str | None = "f.png"
         ) -> crud.NewBlob:
    """An exemplar row's blob for ``new_set`` (no file behind it)."""
    return crud.NewBlob(position=position, filename=name, content_type="image/png", width=40 + position,
                        height=30 + position, sha256=f"{position:064d}", blob=f"b/{uuid.uuid4().hex}", box=box)


def new_set(db, owner: str = "k", exemplars: list[crud.NewBlob] | None = None, **values: Any) -> uuid.UUID:  # type: ignore[no-untyped-def]
    """A set's rows made through ``app.crud`` in the sessions ``db`` makes (the ``db`` fixture), owned by ``owner``."""
    set_id = uuid.uuid4()
    with db.begin() as s:
        crud.create_exemplar_set(s, set_id=set_id, owner=owner, name="s", bundle="b", bundle_sha256="a" * 64,
                                 prototype=b"\1" * 8, prototype_dim=2, exemplars=exemplars or [blob(0)], **values)
    return set_id


def new_job(db, set_id: uuid.UUID, **values: Any) -> uuid.UUID:  # type: ignore[no-untyped-def]
    """A job of the set made through ``app.crud`` (queued, unsent, no image) in the sessions ``db`` makes, then given
    ``values`` (``status=...``, ``cancel_requested=...``) -> its id."""
    job_id = uuid.uuid4()
    with db.begin() as s:
        crud.create_job(s, job_id=job_id, exemplar_set=s.get_one(ExemplarSet, set_id), owner="k",
                        idempotency_key=None, request_sha256="r" * 64, iterations=5, learning_rate=0.1, seed=0,
                        activate="false", images=[])
        if values:
            s.execute(update(AdaptationJob).where(AdaptationJob.id == job_id).values(**values))
    return job_id


def refusal(call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[int, Any]:
    """The ``HTTPException`` that ``call(*args, **kwargs)`` raises -> (status, detail); fails if it raises none."""
    from fastapi import HTTPException

    with pytest.raises(HTTPException) as e:
        call(*args, **kwargs)
    return e.value.status_code, e.value.detail


def row_counts(database_url: str) -> dict[str, int]:
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as s:
            return {t.__tablename__: s.scalar(select(func.count()).select_from(t)) or 0
                    for t in (ExemplarSet, Exemplar, AdaptationJob, JobImage, Checkpoint, PoolImage)}
    finally:
        engine.dispose()


def stored_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def snapshot(settings: Settings) -> tuple[dict[str, int], list[str]]:
    """What a refused request must leave as it was: the rows of every table and the stored files."""
    return row_counts(settings.database_url), stored_files(settings.storage_dir)


# --- live processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """The API (uvicorn) and Celery worker processes of one test, configured by ``settings``."""

    def __init__(self, settings: Settings, log_dir: Path):
        self.settings = settings
        self.log_dir = log_dir
        # What ``scripts/run migrate`` does before the API and the worker start (they would race to create them)
        declare_queues(settings)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **settings_env(settings), "PYTHONUNBUFFERED": "1"}
        self.api: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen:
        log = open(self.log_dir / log_name, "ab")  # noqa: SIM115 -- closed with the process
        # Own session: the whole process group (Celery's pool included) can be killed at once.
        return subprocess.Popen(args, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def start_api(self) -> None:
        self.api = self._spawn([str(VENV_BIN / "uvicorn"), "--factory", "app.main:create_app", "--host", "127.0.0.1",
                                "--port", str(self.port), "--log-level", "warning"], "api.log")

    def start_worker(self) -> subprocess.Popen:
        n = len(self.workers)
        proc = self._spawn([str(VENV_BIN / "celery"), "-A", "worker.celery_app", "worker", "--loglevel=INFO",
                            "--concurrency=1", "--pool=prefork", f"--hostname=qloc-test-{n}-{uuid.uuid4().hex[:6]}@%h",
                            "--without-mingle", "--without-gossip"], f"worker-{n}.log")
        self.workers.append(proc)
        return proc

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if self.api is not None and self.api.poll() is not None:
                raise AssertionError(f"API exited with {self.api.returncode}:\n{self.logs()}")
            try:
                r = httpx.get(f"{self.base_url}/readyz", timeout=5)
                if r.status_code == 200:
                    return
                last = r.text
            except httpx.HTTPError as e:
                last = e
            time.sleep(0.3)
        raise AssertionError(f"API not ready after {timeout}s: {last}\n{self.logs()}")

    def kill(self, proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def stop(self) -> None:
        # The tests are over: no need for the workers' warm shutdown (the run command's test covers it).
        for proc in self.workers:
            self.kill(proc, signal.SIGKILL)
        if self.api is not None:
            self.kill(self.api, signal.SIGTERM)

    def logs(self) -> str:
        out = []
        for p in sorted(self.log_dir.glob("*.log")):
            out.append(f"----- {p.name}\n{p.read_text(errors='replace')[-6000:]}")
        return "\n".join(out)


def wait_for_job_row(database_url: str, job_id: uuid.UUID,
                     states: tuple[str, ...] = ("succeeded", "failed", "canceled"), timeout: float = 120,
                     stack: Stack | None = None) -> AdaptationJob:
    """Poll the job's row (no API needed) until it is in one of ``states`` -> the row."""
    engine = make_engine(database_url)
    try:
        deadline = time.monotonic() + timeout
        while True:
            with make_sessionmaker(engine)() as s:
                job = s.get_one(AdaptationJob, job_id)
            if job.status in states:
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not in {states} after {timeout}s: {job.status}, "
                                     f"attempts {job.attempts}\n{stack.logs() if stack else ''}")
            time.sleep(0.2)
    finally:
        engine.dispose()


def wait_for_job(client: httpx.Client, job_id: str, states: tuple[str, ...] = ("succeeded", "failed", "canceled"),
                 timeout: float = 120, stack: Stack | None = None) -> dict:
    deadline = time.monotonic() + timeout
    job: dict = {}
    while time.monotonic() < deadline:
        job = client.get(f"/v1/adaptations/{job_id}").json()
        if job["status"] in states:
            return job
        time.sleep(0.25)
    raise AssertionError(f"job {job_id} not in {states} after {timeout}s: {job}\n{stack.logs() if stack else ''}")


def at_once(settings: Settings, n: int, fn: Callable[[Any, int], Any]) -> list[Any]:
    """``fn(ctx, i)`` for ``n`` worker contexts (one engine each: ``n`` workers), started together behind a
    barrier in ``n`` threads -> their results, in order of ``i``. The engines are disposed after."""
    from worker.context import WorkerContext

    ctxs = [WorkerContext.create(settings) for _ in range(n)]
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        results[i] = fn(ctxs[i], i)

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
    finally:
        for c in ctxs:
            c.engine.dispose()
    return results


# --- one bundle name, several files (bundles known by content)

def install_bundle(bundle_dir: Path, source: Path, name: str) -> None:
    """Put ``source`` in place as bundle ``name``: a copy, then a rename over the installed file (atomic)."""
    import shutil

    bundle_dir.mkdir(parents=True, exist_ok=True)
    tmp = bundle_dir / f".{name}.pt.tmp"
    shutil.copyfile(source, tmp)
    os.replace(tmp, bundle_dir / f"{name}.pt")


def bundle_versions(root: Path, name: str) -> dict[str, tuple[Path, str]]:
    """Three files of bundle ``name``: ``v1``, ``v2`` (other weights) and ``narrow`` (prototypes of
    dimension 256) -> ``{version: (path, sha256)}``."""
    from models.bundle import new_bundle, save_bundle
    from models.presets import mnist_config

    narrow = mnist_config()
    narrow.head.out_features = narrow.agent.embed_dim = 256
    out = {}
    for version, seed, cfg in (("v1", 0, mnist_config()), ("v2", 1, mnist_config()), ("narrow", 2, narrow)):
        path = root / f"{version}.pt"
        out[version] = (path, save_bundle(path, new_bundle(name, cfg, seed=seed)))
    return out


SWAPPED = "swapped"
"""The bundle name the bundle-identity tests install several files under."""


@pytest.fixture
def versions(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """``bundle_versions`` of ``SWAPPED``."""
    return bundle_versions(tmp_path / "versions", SWAPPED)


def swapped_settings(tmp_path: Path, versions: dict[str, tuple[Path, str]], **overrides: Any) -> Settings:
    """The service's settings (and ``overrides``) with a bundle directory of its own (the tests replace its files),
    holding ``versions["v1"]`` as ``SWAPPED``, the default bundle; database migrated."""
    installed = tmp_path / "installed"
    install_bundle(installed, versions["v1"][0], SWAPPED)
    s = make_test_settings(tmp_path, installed, default_bundle=SWAPPED, **overrides)
    migrate(s.database_url)
    return s


@contextlib.contextmanager
def running_stack(kind: str, request: pytest.FixtureRequest, tmp_path: Path, bundle_dir: Path, *,
                  make: Callable[..., Settings] = make_test_settings) -> Iterator[Stack]:
    """An API and a worker in subprocesses, ready, on the embedded default (``kind`` ``embedded``) or on
    PostgreSQL + Redis (``postgres_redis``: a fresh database and Redis key prefix, its own queue), with the
    settings ``make`` gives (``make_test_settings`` or a variant); stopped on exit."""
    if kind == "embedded":
        settings = make(tmp_path, bundle_dir)
    else:
        prefix = request.getfixturevalue("redis_prefix")
        settings = make(tmp_path, bundle_dir, database_url=request.getfixturevalue("postgres_url"),
                        broker_url=REDIS_URL, broker_transport_options={"global_keyprefix": prefix},
                        queue=f"qloc-test-{uuid.uuid4().hex[:8]}")
    migrate(settings.database_url)
    with started(settings, tmp_path) as st:
        yield st


@contextlib.contextmanager
def started(settings: Settings, root: Path) -> Iterator[Stack]:
    """An API and a worker in subprocesses with ``settings`` (the database already migrated), ready; stopped on
    exit, also when starting fails half-way."""
    st = Stack(settings, root)
    try:
        st.start_api()
        st.start_worker()
        st.wait_ready()
        yield st
    finally:
        st.stop()
