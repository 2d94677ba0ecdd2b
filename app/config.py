"""The one settings object of the service and its worker (env prefix ``QLOC_``).

The defaults are the embedded setup: SQLite, Celery over its SQLAlchemy transport on a second SQLite
file, blobs under ``var/``, bundles from ``bundles/``. Point ``QLOC_DATABASE_URL`` and
``QLOC_BROKER_URL`` at PostgreSQL and Redis for the distributed one; the code path is the same.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

MiB = 1024 * 1024
MAX_SAMPLES = 63
"""Most extra sampled episodes per image a localize request may ask for (64 episodes in all)."""
MAX_INSTANCES = 32
"""Localize's ``max_instances`` may ask for up to this many objects per image."""


class Settings(BaseSettings):
    # hide_input_in_errors: a refused setting is named with its rule, never echoed (a cross-field check's input is
    # every setting read: API keys, the Label Studio token, a database URL's password would reach the logs).
    model_config = SettingsConfigDict(env_prefix="QLOC_", extra="ignore", hide_input_in_errors=True,
                                      use_attribute_docstrings=True,  # each field's docstring: SETTINGS.md
                                      validate_by_name=True)  # Settings(labelstudio_url=...) beside its aliases

    # --- where things live
    database_url: str = "sqlite:///var/qloc.db"
    """SQLAlchemy URL of the tables (sets, checkpoints, jobs, pool images), e.g.
    ``postgresql+psycopg://user@host/qloc``; SQLite by default. ``scripts/run migrate`` upgrades them (Alembic)."""
    broker_url: str = "sqla+sqlite:///var/celery-broker.db"
    """Celery broker the adaptation (and, with ``inference=workers``, localize) tasks go through, e.g.
    ``redis://redis:6379/0``; by default kombu's SQLAlchemy transport on a second SQLite file (no server)."""
    broker_transport_options: dict[str, Any] = Field(default_factory=dict)
    """Extra kombu transport options (JSON), e.g. ``{"global_keyprefix": "qloc:"}`` for Redis."""
    queue: str = Field("qloc", pattern=r"^[A-Za-z0-9_.:-]{1,100}$")
    """Name of the Celery queue the adaptation tasks go to."""
    storage_dir: Path = Path("var")
    """Root of the blob store (uploaded images, checkpoints)."""
    bundle_dir: Path = Path("bundles")
    """Every ``<name>.pt`` here can be served as bundle ``<name>``."""
    default_bundle: str = "mnist-general"
    """The bundle of a set created without ``bundle``: the cMNIST bundle trained on all ten digits, chosen over the
    one-digit ``mnist-digit4`` on kinds of objects neither saw (BENCHMARKS.md, "A general cMNIST bundle"). Exemplars
    that look like photos get ``default_photo_bundle`` instead."""
    default_photo_bundle: str = Field("photo-general", pattern=r"^([A-Za-z0-9][A-Za-z0-9_.-]{0,99})?$")
    """The bundle of a set created without ``bundle`` whose exemplar crops look like photos (``app.bundle_choice``:
    the median of their mid-tone shares at least 0.2, in color or gray and at any size; or the medians of their
    colorfulness at least 3 and of their longer sides at least 100 pixels), when it is installed; otherwise
    ``default_bundle``. On photos the gray cMNIST default answers nothing right (CorLoc 0 on the real photographs in
    color, in gray and as thumbnails, 48-58 with ``photo-general``); on cMNIST-style images, also in color, it stays
    the better one. Empty: every set that names no bundle gets ``default_bundle``."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs, in the API (``inference=local``) and on the workers: ``auto``, a CUDA GPU when torch
    finds one, else the CPU."""
    localize_samples: int = Field(0, ge=0, le=MAX_SAMPLES)
    """Default of localize's ``samples``: extra sampled episodes per image for the best-of-N search
    (0 = the greedy episode alone; 15 is the benchmarks' best of 16)."""
    localize_nearest: bool | None = None
    """Default of localize's ``nearest``: answer with the visited box nearest the exemplars instead of the
    episode's last box. Unset: each bundle's own default (``env.answer``: on for photo bundles)."""

    # --- where the model runs for requests (localize, exemplar-set prototypes, bundle checks)
    inference: Literal["local", "workers"] = "local"
    """``local``: in the API process (the API loads the bundles). ``workers``: on Celery workers consuming
    ``localize_queue``, answered through ``result_backend``; the API then loads no bundle (no GPU, no model).
    A localize worker batches concurrent calls as the API does in local mode, by its own ``batch_window_ms``,
    ``batch_max_images`` and ``inference_queue_images``."""
    localize_queue: str = Field("qloc-localize", pattern=r"^[A-Za-z0-9_.:-]{1,100}$")
    """Celery queue of the localize / prototype / bundle-check tasks (``inference=workers``)."""
    result_backend: str | None = None
    """Celery result backend the API reads the workers' answers from, e.g. ``redis://redis:6379/1``;
    required with ``inference=workers``."""
    localize_timeout: float = Field(30.0, gt=0, le=3600)
    """Seconds the API waits for a worker's answer (``inference=workers``); then 503 + ``Retry-After``."""
    set_timeout: float = Field(120.0, gt=0, le=3600)
    """Seconds a new exemplar set waits for a worker's prototype and calibration (``inference=workers``): a photo
    set's calibration takes 15-16 s on a 2-core CPU, so ``localize_timeout`` is no bound for it; then 503."""
    localize_worker_check_s: float = Field(10.0, ge=0, le=3600)
    """Seconds between the API's checks that some worker consumes ``localize_queue`` (``inference=workers``):
    a broadcast of Celery's ``active_queues``, each worker answering within a second. Seen by none twice in a
    row, model calls are refused at once (503 + ``Retry-After`` naming the queue) instead of each waiting
    ``localize_timeout``, and ``/readyz`` says so; while none is seen, it checks every second. Each check also reads
    the result backend: down, calls are refused at once saying so. Brokers that cannot broadcast (the SQLAlchemy
    transport) are not checked. 0: never checked."""

    # --- localize in the API process (inference=local): one engine thread, calls batched across requests
    batch_window_ms: float = Field(0.0, ge=0, le=1000)
    """Milliseconds an idle engine holds a localize call back so that others run with it as one batch. 0:
    it starts at once (a lone client waits for nothing); calls that arrive while a batch runs are gathered
    into the next one anyway (continuous batching)."""
    batch_gather_ms: float = Field(20.0, ge=0, le=1000)
    """Milliseconds at most an idle engine holds a localize call back while other localize requests of this
    process are on their way to it (their sets being read, their images decoded), so that they run as one batch.
    A lone client has nothing else on its way and waits for nothing. 0: never held back for them."""
    batch_max_images: int = Field(64, ge=1, le=4096)
    """Most images the engine runs in one forward pass (a single larger call still runs whole)."""
    inference_queue_images: int = Field(256, ge=1)
    """Images that may wait for the engine (not counting the batch it runs); a localize call that would pass
    it is answered 503 with ``Retry-After`` at once, rather than wait without bound."""
    tune_malloc: bool = True
    """Keep batched activations on the heap (``models.allocator``: glibc's thresholds fixed, in the API and worker
    processes): on 2 cores, localization at batch 64 ran 1.42x faster. ``false`` leaves glibc's defaults."""
    compile_episode: bool = True
    """On the CPU, compile each loaded bundle's greedy episode (``torch.compile``, on a background thread at
    start), for one image and for batches of 2-15: one-image requests then spend ~2 ms in the episode instead of
    ~5-7 on 2 cores, and the engine's batches of concurrent requests 1.5-1.8x less (2-8 images), with the same
    boxes. Compiling needs a C++ compiler (the Docker image has one) and takes tens of seconds, a few from the cache
    in ``<storage_dir>/compile-cache`` (``TORCHINDUCTOR_CACHE_DIR`` overrides it); until then, and where it fails,
    the episode runs eager. On a GPU (``QLOC_DEVICE``), greedy episodes of up to 64 images run as replayed CUDA
    graphs, captured on first use (``models.compiled.GraphedSteer``). ``false``: always eager."""
    inference_threads: int = Field(0, ge=0, le=1024)
    """torch's intra-op threads in each API process. 0: half the cores shared out among the ``api_workers``
    processes (at least 1 each), the other half left to HTTP, decoding and the database: on 2 cores, 1 thread
    answers 32 concurrent clients faster than 2 (BENCHMARKS.md, "Localize under concurrent clients")."""
    route_threads: int = Field(1, ge=1, le=1024)
    """Request threads of an API process that may run the localize path's own work at once (reading the set,
    judging the answers with the calibration); the others wait their turn. Waiting for the model and decoding
    images take no turn. Python runs one thread at a time, and 32 threads handing its lock to one another
    spent more CPU than the work: on 2 cores, 32 clients got 1.27x the requests/s with 1 turn, 1.21x with 2
    (BENCHMARKS.md, "Localize under concurrent clients"). More help where the database is slow to answer."""
    access_log: bool = False
    """One log line per HTTP request from ``scripts/run api`` (uvicorn's access log, on stderr). Off by default:
    uvicorn writes it on the event loop, in every request's path (2 % of the API's busy time in a profile of one
    client; BENCHMARKS.md, "Localize under concurrent clients"); ``/metrics`` counts every route's requests,
    statuses and latencies without it. Errors are logged either way."""
    api_workers: int = Field(0, ge=0, le=64)
    """API processes ``scripts/run api`` starts (uvicorn ``--workers``), each with its own model, engine thread
    and batches: Python's lock serves one request's Python at a time per process, so on more cores more
    processes serve more concurrent clients. ``/metrics`` then adds up every process's numbers (Prometheus's
    multiprocess mode, in ``PROMETHEUS_MULTIPROC_DIR``: a fresh temporary folder unless set). 0 (default): one
    per core this process may use, at most ``AUTO_API_PROCESSES``, or ``GPU_API_PROCESSES`` where the model runs
    in the API on a CUDA device (each process its own GPU context and engine); ``api_processes``."""

    # --- auth: empty = off; on, each key sees only what it created
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Comma-separated API keys, each at least 16 characters. Empty (the default): no auth. Set: every ``/v1`` call
    needs one (``X-API-Key`` or ``Authorization: Bearer``), and each key sees only what was made with it."""
    metrics_auth: bool = True
    """With API keys set, ``/metrics`` needs one too (false: open to any scraper, as without keys)."""

    # --- upload limits
    max_file_bytes: int = Field(10 * MiB, ge=1)
    """Bytes one uploaded file may have (413 above it)."""
    max_image_pixels: int = Field(16_000_000, ge=1)
    """Width x height above which an image is refused before decoding (decompression bombs)."""
    max_files_per_request: int = Field(64, ge=1)
    """Files one request may carry (413 above it); a multipart body may hold every file at ``max_file_bytes`` plus
    1 MiB."""
    max_json_bytes: int = Field(4 * MiB, ge=1024)
    """The largest body that is not multipart/form-data (a JSON body: PATCH of a set, Label Studio's /predict and
    webhook; an urlencoded job form): such a body is read whole into memory, so it gets a limit of its own (413)."""
    max_request_pixels: int = Field(256_000_000, ge=1)
    """Width x height summed over a request's images (read from their headers, before decoding): above it, 413.
    The default takes 16 images at ``max_image_pixels``; it bounds the decoding work of one request."""
    decode_max_side: int = Field(896, ge=32)
    """Images are decoded downscaled to at most this longer side (a JPEG by its decoder, never at full
    resolution): 4x the largest shipped bundle input (224 px photos; cMNIST takes 84), so the bundle's own
    antialiased resize still starts from 4x its size. Boxes and sizes stay in the full image's pixels. Crops
    cut from whole images with ``boxes`` are cut from a decode fine enough that the crop keeps up to this side."""
    max_pool_images: int = Field(2000, ge=0)
    """Images an exemplar set's pool may hold (``POST /v1/exemplar-sets/{id}/images``, localize's ``keep``):
    a request that would pass it is refused whole (409). Every pool image may go into one job, whose worker
    holds them all in memory (preprocessed to the bundle's input: 28 KiB each for cMNIST, 588 KiB for photos)."""
    max_pool_bytes: int = Field(1024 * MiB, ge=0)
    """Bytes (as uploaded) an exemplar set's pool may hold, refused like ``max_pool_images``."""

    # --- job limits
    default_iterations: int = Field(200, ge=1)
    """Iterations of a job posted without ``iterations``."""
    max_iterations: int = Field(5000, ge=1)
    """The most ``iterations`` a job may ask for (422 above it)."""
    default_learning_rate: float = Field(1e-3, gt=0)
    """Adam's learning rate for a job posted without ``learning_rate``."""
    checkpoint_every: int = Field(25, ge=1)
    """A job writes a checkpoint (and scores it on its probes) every this many iterations, and at its last."""
    adapt_batch_size: int = Field(32, ge=1)
    """Images per adaptation iteration (at most the job's images)."""
    synthetic_probes: int = Field(256, ge=8, le=4096)
    """Synthetic probes per job: the set's exemplar crops pasted into the job's images, boxes known. With the
    set's labeled examples they score the starting policy and every checkpoint (``activate=auto``); the reward
    repair trains on as many more and keeps its head on half as many. 256 since 2026-11-27 (128 before), chosen
    on validation images: the guard's noise is smaller, so it refuses fewer real gains (new digits 2 -> 5 of 9
    jobs activated), for 1.5-3.4x a job's time on one CPU thread. On the test split no cMNIST-style job of 54 ended
    below its start; photo jobs with 5 labeled examples could until the labeled examples had to confirm a gain beyond
    their noise (``labeled_rule``; BENCHMARKS.md, "More probes", "Labeled examples beyond their noise")."""
    calibration_samples: int = Field(128, ge=8, le=4096)
    """Pasted crops and synthesized backgrounds (each) that a "not found" calibration is fit on (``app.calibration``):
    a new set's, and each checkpoint's that a job refreshes at its end (with the job's probes). Its time grows with
    it: at 128 the refresh is about half to three quarters of a small job's time on a CPU (a paired checkpoint refines
    every voter's answer on each sample); fewer make ``found`` and ``confidence`` noisier."""
    labeled_rule: Literal["beyond_noise", "agree"] = "beyond_noise"
    """How a set's labeled examples confirm a photo (RGB) job's checkpoint for ``activate=auto``, where pasted probes
    may not confirm it alone (``models.guard.GuardConfig.labeled_rule``). ``beyond_noise`` (the default since
    2026-11-27's eighth session): more of them right by more than twice the standard error of the paired
    difference, as on the probes: no photo job ended below its start, but few activate (BENCHMARKS.md, "Labeled
    examples beyond their noise"). ``agree`` (the rule before): at least as many right as at the start; on photos
    it took most real gains and let some jobs end up to 7.5 points below their start."""
    job_checkpoints: Literal["all", "chosen"] = "all"
    """Which of a job's checkpoints stay once it succeeds. ``all`` (the default): every one it wrote (one per
    ``checkpoint_every`` iterations), to activate or delete by hand (``DELETE /v1/checkpoints/{id}``). ``chosen``: the
    ones its outcome names, those it calibrates: the one it activated (``validation.activated_checkpoint_id``), the
    probes' best (the verdict's) and its last (``activate=true``'s, the job's ``checkpoint_id``); the others are
    deleted with their files as that route would delete them (one made active meanwhile, or that a queued job starts
    from, stays), so a set grows by at most three checkpoints per job. A failed or canceled job keeps what it wrote."""
    early_stop_patience: int = Field(2, ge=0, le=1000)
    """A job stops early after this many checkpoints in a row whose probe CorLoc is below the best so far by more
    than the probes' noise (0: never stop early)."""
    reward_repair: bool = True
    """Before adapting the policy, train the projection head on as many other synthetic probes (stage 1's ordinal
    loss, the backbone frozen) and keep it when held-out probes say it orders boxes better (``models.repair``):
    the reward then transfers to objects the bundle never saw. Checkpoints carry the head and prototype."""
    pair_start: Literal["photos", "always", "never"] = "photos"
    """Where a job's own reward repair was kept, its checkpoints carry the policy the job started from (format 4) and
    are served *paired* with it: each image keeps the checkpoint's answer only where both heads (the repaired one
    and the start's) prefer it, and the start's answer elsewhere (``models.companion.Companion.agree``). ``photos``
    (the default): on RGB bundles' jobs, where a checkpoint alone lost up to 27 points on held-out photo classes
    and 67 on a class of real photographs, and the pair kept more of the gain and lost far less (20 held-out-class jobs:
    +4.6 against +1.7 alone, worst −4.2 against −27; real photographs: 45.9 against 24.6 alone, the start 52.5);
    ``always``: also grayscale bundles' (whose guard confirms on pasted probes, and whose bundle head orders new kinds
    of objects poorly, so pairing would keep their starts' wrong answers); ``never``: checkpoints alone, as before.
    The job's guard scores the checkpoints paired too, as localize serves them (``models.repair.guarded_setup``'s
    ``start``); ``activate=auto`` keeps its rule (BENCHMARKS.md, "The two heads' agreement, served")."""
    pair_rule: Literal["agree", "consensus"] = "agree"
    """How a paired checkpoint (``pair_start``) answers. ``agree`` (the default): its own box only where both heads
    prefer it, the start's elsewhere (format 4). ``consensus`` (format 5): each image gets the answer, among the
    start's, the job's earlier checkpoints' and the checkpoint's own, that overlaps the others most
    (``models.companion.Companion.members``; one more episode per earlier checkpoint, the backbone still once).
    Measured 2026-11-30 (BENCHMARKS.md, "Consensus of a job's checkpoints"): on held-out photo classes (cut-outs on
    wallpapers, 25 jobs of fresh test seeds) the last checkpoint served by consensus gained more than paired (+6.8
    against +4.8) but its worst job fell further (-8.3 against -4.2); on the real photographs it lost far more
    (test 52.5 -> 27.9 against 45.9 paired): it follows the adapted checkpoints where they all drifted to the
    same wrong boxes; and a photo takes 3x as long (7 earlier checkpoints: 148 ms against 49 paired). So it stays
    opt-in. The guard scores checkpoints as they are served."""
    probe_style: Literal["photos", "rect", "soft"] = "rect"
    """How a job's synthetic probes are made (``models.data.probes.PROBE_STYLES``): ``rect``, the exemplar crop pasted
    as a rectangle over the job's image, the starting policy's answer covered by another image's rectangle; ``soft``,
    the crop pasted as its inscribed ellipse with a soft edge and the answer covered by a smooth fill from around
    it (no straight seam for the repaired reward to learn); ``photos``: ``soft`` for RGB bundles' jobs only. ``rect``
    stays the default: on held-out photo classes soft probes made a job's checkpoint alone better (fresh test seeds:
    +2.3 against +1.0, worst job -2.1 against -10.4) but not what a photo checkpoint serves, paired with its start
    (+1.9 against +2.3; real photographs 41.0 against 45.9), and confirmed no better (BENCHMARKS.md, "Probes without
    seams")."""
    reward_choice: bool = True
    """Adapt the policy on the reward that orders boxes best on the job's selection probes, among the embedding
    distance (the bundle's or the repaired head), normalized cross-correlation with the exemplar crops and the
    cosine of frozen backbone features (``models.repair``); the embedding stays unless another beats it clearly.
    Serving is unchanged. On by default: with reward repair on it kept the (repaired) embedding in every run
    measured, and without repair it turned glyph adaptation from harmful into a gain (BENCHMARKS.md, "Rewards
    chosen on the probes")."""
    repair_epochs: int = Field(30, ge=1, le=500)
    """Epochs of reward repair over its probes (``synthetic_probes``, 256 by default: a few seconds on a GPU, about
    a minute on a CPU core for the cMNIST bundle, two to three for a photo bundle)."""
    job_soft_time_limit: float = Field(3600.0, gt=0)
    """Seconds; the job is marked failed (its checkpoints kept) when it runs longer."""
    job_time_limit: float = Field(3660.0, gt=0)
    """Seconds; the worker process is killed past this (the reaper then fails or resumes the job)."""
    heartbeat_interval: float = Field(2.0, gt=0)
    """Seconds between two heartbeats of a running job (a thread of its run; progress writes renew it too)."""
    heartbeat_timeout: float = Field(10.0, gt=0)
    """A running job whose heartbeat is older than this is considered abandoned by a dead worker (at least
    twice ``heartbeat_interval``; the default lets 4 beats in a row be late: a busy CPU, a slow database).
    Compared across machines: worker clocks must agree (NTP) to well within it."""
    reaper_interval: float = Field(2.0, gt=0)
    """Seconds between two rounds of each worker's reaper (abandoned running jobs, unsent queued ones); a
    worker also runs one as soon as it is ready. A dead worker's job resumes within about
    ``heartbeat_timeout`` + ``reaper_interval`` (BENCHMARKS.md, "Recovery after kill -9")."""
    enqueue_grace: float = Field(30.0, gt=0)
    """Seconds a new job may stay ``queued`` with no confirmed send (``enqueued_at`` NULL) before the reaper
    sends its task itself: the API died between committing the job and sending it. Longer than a send
    takes, or the reaper and the API may both send (a duplicate, skipped by the worker)."""
    requeue_after: float = Field(300.0, gt=0)
    """Seconds after its last send that a job still ``queued`` is sent again (the broker lost the message).
    Sent at most once per this bound; behind a long backlog this only adds duplicates, each skipped at once."""
    max_job_attempts: int = Field(3, ge=1)
    """A job abandoned this many times is marked failed instead of being requeued."""
    worker_concurrency: int = Field(1, ge=1)
    """Tasks a worker runs at once: its pool's processes, one adaptation job each (Celery's concurrency; the worker's
    ``--concurrency`` option overrides it, as for a localize worker's threads)."""

    # --- Label Studio ML backend (/v1/labelstudio/{set_id}, app/routes/labelstudio.py)
    labelstudio_url: str | None = Field(None, validation_alias=AliasChoices(
        "QLOC_LABELSTUDIO_URL", "LABEL_STUDIO_URL"))
    """Label Studio's base URL (QLOC_LABELSTUDIO_URL, or LABEL_STUDIO_URL as its ML backends read it): task images
    given as Label Studio paths (``/data/upload/...``) are fetched from there. Unset: the ``hostname`` that Label
    Studio's own ``/setup`` call gives (its HOST setting)."""
    labelstudio_api_key: str | None = Field(None, repr=False, validation_alias=AliasChoices(
        "QLOC_LABELSTUDIO_API_KEY", "LABEL_STUDIO_API_KEY"))
    """Label Studio token sent with those fetches: a legacy token (``Authorization: Token``) or a personal access
    token (a JWT, exchanged for an access token). Unset: the ``access_token`` Label Studio's ``/setup`` gives."""
    labelstudio_fetch_timeout: float = Field(10.0, gt=0, le=300)
    """Seconds one task image fetch (connect, and each read) may take before the prediction is refused (422)."""
    labelstudio_fetch_hosts: Annotated[list[str] | None, NoDecode] = None
    """The hosts (``name`` or ``name:port``; comma-separated in the environment) that task image URLs may point at,
    redirects included, besides Label Studio's own address; a URL elsewhere is refused (422) before any request.
    Unset (the default): any host, as Label Studio's own ML backends fetch (a task may hold any public URL). Set it
    where the API can reach services that callers of ``/predict`` must not (a private network, cloud metadata):
    a task's URL is otherwise fetched from inside."""

    @field_validator("labelstudio_fetch_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [h.strip().lower() for h in v.split(",") if h.strip()]
        return v

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [k.strip() for k in v.split(",") if k.strip()]
        return v

    @model_validator(mode="after")
    def _check_limits(self) -> Settings:
        if self.job_time_limit <= self.job_soft_time_limit:
            raise ValueError("job_time_limit (hard) must exceed job_soft_time_limit")
        if self.heartbeat_timeout < 2 * self.heartbeat_interval:
            raise ValueError("heartbeat_timeout must be at least twice heartbeat_interval (one late beat "
                             "must not lose a live job's lease)")
        if self.default_iterations > self.max_iterations:
            raise ValueError("default_iterations must not exceed max_iterations")
        if any(len(k) < 16 for k in self.api_keys):
            raise ValueError("API keys must be at least 16 characters long")
        if self.inference == "workers" and not self.result_backend:
            raise ValueError("QLOC_INFERENCE=workers needs QLOC_RESULT_BACKEND (e.g. redis://redis:6379/1): the API "
                             "reads the localize workers' answers there; set it, or use QLOC_INFERENCE=local")
        if self.localize_queue == self.queue:
            raise ValueError("QLOC_LOCALIZE_QUEUE must differ from QLOC_QUEUE: localize requests must not wait "
                             "behind adaptation jobs")
        return self

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    @property
    def max_request_bytes(self) -> int:
        """The whole multipart body: every file at its limit plus room for the form's overhead."""
        return self.max_files_per_request * self.max_file_bytes + MiB

    @property
    def broker_visibility_timeout(self) -> int:
        """Redis redelivers an unacknowledged task after this: it must exceed the longest job."""
        return int(self.job_time_limit) + 600


AUTO_API_PROCESSES = 8
"""The most API processes ``api_workers=0`` starts."""

GPU_API_PROCESSES = 4
"""The most API processes ``api_workers=0`` starts where the model runs in the API on a CUDA device. One process
left the GPU idle behind Python's lock: on an H100 with 16 cores, 32 clients got 171 requests/s from one process
and 439 from four, one client the same 130 (BENCHMARKS.md, § GPU); each process holds its own CUDA context
(~0.5 GB of GPU memory) and graphs."""


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, where the system has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def api_processes(settings: Settings) -> int:
    """How many API processes ``scripts/run api`` starts: ``api_workers``, or (0) one per usable core up to
    ``AUTO_API_PROCESSES``, or up to ``GPU_API_PROCESSES`` when this API runs the model on a CUDA device."""
    if settings.api_workers:
        return settings.api_workers
    most = AUTO_API_PROCESSES
    if settings.inference == "local":
        if settings.device == "cuda":
            most = GPU_API_PROCESSES
        elif settings.device == "auto" and _nvidia():
            from models.inference import resolve_device  # torch (seconds to import): only where a GPU may be

            if resolve_device("auto").type == "cuda":
                most = GPU_API_PROCESSES
    return max(1, min(most, usable_cores()))


def _nvidia() -> bool:
    """Whether NVIDIA's driver is loaded (without it torch finds no CUDA device)."""
    return Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidiactl").exists()


@functools.cache
def get_settings() -> Settings:
    """The process's settings, read from the environment once."""
    return Settings()


UVICORN_OPTIONS: dict[str, Callable[[Settings], str]] = {
    "api-processes": lambda s: str(api_processes(s)),
    "access-log": lambda s: "--access-log" if s.access_log else "--no-access-log",
}
"""What ``scripts/run api`` asks for (``python -m app.config NAME ...``) and passes uvicorn."""


if __name__ == "__main__":  # scripts/run asks: python -m app.config api-processes access-log
    import sys

    names = sys.argv[1:]
    if not names or any(n not in UVICORN_OPTIONS for n in names):
        raise SystemExit(f"usage: python -m app.config {{{'|'.join(UVICORN_OPTIONS)}}} ...")
    from pydantic import ValidationError

    try:
        settings = get_settings()
    except ValidationError as e:  # one line per refused setting, without its value (hide_input_in_errors)
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'settings'}: {err['msg']}"
                             for err in e.errors(include_input=False, include_url=False))
        raise SystemExit(f"qloc: invalid settings (QLOC_* environment variables): {problems}") from None
    print(" ".join(UVICORN_OPTIONS[n](settings) for n in names))
