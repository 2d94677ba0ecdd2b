"""A Python client of the qloc v1 API.

    from app.client import QlocClient

    with QlocClient("http://127.0.0.1:8000", api_key=None) as qloc:
        fours = qloc.create_exemplar_set(["crop1.png", "crop2.png"], name="fours")
        answer = qloc.localize(fours.id, ["scene.png"], trajectory=True)
        print(answer.results[0].box, answer.results[0].score)
        job = qloc.wait(qloc.create_adaptation(fours.id, ["a.png", "b.png"], iterations=200))
        print(job.status, job.verdict)
        coco = qloc.export(fours.id, ["scene.png"], format="coco")  # the answers as COCO detection results

Images are paths, bytes, PIL images or numpy arrays (``HxW`` or ``HxWxC``: uint8, uint16, floats in [0, 1] or
[0, 255], or bool masks). Ids are strings, UUIDs or the client's own models (an ``ExemplarSet``, a ``Checkpoint``, ...).
Every error the API answers raises ``QlocError`` with its status and ``detail``. Requests are retried on 503
(honouring ``Retry-After``) and on connection errors; a new adaptation job carries an ``Idempotency-Key``,
so a retried creation never starts a second job. Responses are parsed leniently: fields this client does
not know are kept (``model.model_extra``), not refused.
"""

from __future__ import annotations

import email.utils
import math
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import httpx
from pydantic import BaseModel

from app.client_images import ImageInput, files_fields
from app.client_models import (  # re-exported: ``from app.client import ...`` is the API
    TERMINAL,
    AdaptationJob,
    Checkpoint,
    ExemplarSet,
    Instance,
    Localization,
    LocalizeResponse,
    Page,
    PoolImage,
    PoolImages,
    Progress,
)
from app.client_progress import progress_bar

__all__ = [
    "TERMINAL", "AdaptationJob", "Checkpoint", "ExemplarSet", "Export", "ImageInput", "Instance", "LocalizeResponse",
    "Localization", "Page", "PoolImage", "PoolImages", "Progress", "QlocClient", "QlocError",
]

DEFAULT_URL = "http://127.0.0.1:8000"

SetRef = uuid.UUID | str | ExemplarSet
"""An exemplar set: its id, or the set as this client read it."""


# ---------------------------------------------------------------- errors


class QlocError(Exception):
    """An error answer of the API (``status`` and its ``detail``), or no answer at all (``status`` None)."""

    def __init__(self, status: int | None, detail: Any, *, method: str = "", url: str = "",
                 response: httpx.Response | None = None):
        self.status = status
        self.detail = detail
        self.method = method
        self.url = url
        self.response = response
        super().__init__(self._message())

    def _message(self) -> str:
        where = f"{self.method} {self.url}: " if self.method else ""
        if self.status is None:
            return f"{where}{self.detail}"
        return f"{where}HTTP {self.status}: {describe_detail(self.detail)}"


def describe_detail(detail: Any) -> str:
    """The API's ``detail`` as one line: a message, or FastAPI's list of validation issues."""
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):
        parts = []
        for issue in detail:
            if isinstance(issue, dict):
                loc = ".".join(str(p) for p in issue.get("loc", []) if p not in ("body", "query"))
                parts.append(f"{loc}: {issue.get('msg', issue)}" if loc else str(issue.get("msg", issue)))
            else:
                parts.append(str(issue))
        return "; ".join(parts)
    return str(detail)


# ---------------------------------------------------------------- the client


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


CREATE_SET_TIMEOUT = 900.0
"""Seconds ``create_exemplar_set`` waits for its answer at least (a set is made whether or not it is waited for)."""


class QlocClient:
    """The qloc v1 API over httpx.

    ``retries``: how many times a request is sent again after a 503 or a connection error (waiting
    ``Retry-After`` when the server gives it, else ``backoff`` seconds doubling each time, at most
    ``max_wait``). Only requests that are safe to repeat are retried after a connection error that may have
    reached the server (reads, and job creations, which carry an ``Idempotency-Key``); a request that could
    not connect at all is always retried. ``http_client``: an ``httpx.Client`` of your own (e.g. FastAPI's
    ``TestClient``), used as it is, with its own base URL; the client then does not close it.
    """

    def __init__(self, base_url: str = DEFAULT_URL, *, api_key: str | None = None, timeout: float = 120.0,
                 retries: int = 3, backoff: float = 0.5, max_wait: float = 30.0,
                 http_client: httpx.Client | None = None, sleep: Callable[[float], None] = time.sleep):
        self.api_key = api_key
        self.retries = retries
        self.backoff = backoff
        self.max_wait = max_wait
        self._sleep = sleep
        self._own = http_client is None
        self.http = http_client or httpx.Client(base_url=base_url, timeout=timeout)

    def close(self) -> None:
        if self._own:
            self.http.close()

    def __enter__(self) -> QlocClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ plumbing

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.api_key:
            headers["X-API-Key"] = self.api_key
        headers.update(extra or {})
        return headers

    def _wait(self, attempt: int, response: httpx.Response | None) -> None:
        delay = _retry_after(response) if response is not None else None
        if delay is None:
            delay = self.backoff * 2**attempt
        self._sleep(min(delay, self.max_wait))

    def request(self, method: str, path: str, *, params: dict[str, Any] | None = None,
                data: dict[str, Any] | None = None, files: list | None = None, headers: dict[str, str] | None = None,
                json: Any = None, idempotent: bool | None = None,
                on_503: Callable[[], dict[str, str] | None] | None = None, ok: Iterable[int] = (),
                timeout: float | None | object = httpx.USE_CLIENT_DEFAULT) -> httpx.Response:
        """Send one API request with the retries -> the response; an error status raises ``QlocError``.
        ``timeout``: this request's, in place of the client's.

        ``on_503`` is called before a retry after a 503 and returns new headers (``None``: do not retry)."""
        safe = method in ("GET", "HEAD", "OPTIONS") if idempotent is None else idempotent
        params = {k: v for k, v in (params or {}).items() if v is not None}
        data = {k: str(v) for k, v in (data or {}).items() if v is not None}
        hdrs = dict(headers or {})
        attempt = 0
        while True:
            try:
                r = self.http.request(method, path, params=params or None, data=data or None, files=files,
                                      json=json, headers=self._headers(hdrs), timeout=timeout)  # type: ignore[arg-type]
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # never reached the server
                if attempt >= self.retries:
                    raise QlocError(None, f"cannot connect to the API ({type(e).__name__}: {e})", method=method,
                                    url=str(path)) from e
                self._wait(attempt, None)
                attempt += 1
                continue
            except (httpx.ReadError, httpx.ReadTimeout, httpx.RemoteProtocolError, httpx.WriteError) as e:
                if not safe or attempt >= self.retries:
                    maybe = "" if safe else "; the server may have done it all the same: look before you retry"
                    raise QlocError(None, f"the connection failed ({type(e).__name__}: {e}){maybe}", method=method,
                                    url=str(path)) from e
                self._wait(attempt, None)
                attempt += 1
                continue
            if r.status_code == 503 and attempt < self.retries:
                new_headers = on_503() if on_503 is not None else {}
                if new_headers is not None:
                    hdrs.update(new_headers)
                    self._wait(attempt, r)
                    attempt += 1
                    continue
            if r.is_success or r.status_code in set(ok):
                return r
            raise self._error(r)

    @staticmethod
    def _error(r: httpx.Response) -> QlocError:
        try:
            body = r.json()
            detail = body.get("detail", body) if isinstance(body, dict) else body
        except ValueError:
            detail = r.text.strip()[:500] or r.reason_phrase
        return QlocError(r.status_code, detail, method=r.request.method, url=str(r.request.url), response=r)

    # ------------------------------------------------------------ health and bundles

    def health(self) -> dict[str, Any]:
        """``GET /healthz``: the process is up."""
        return self.request("GET", "/healthz").json()

    def ready(self) -> dict[str, Any]:
        """``GET /readyz``: ``{"status": "ok" | "unavailable", "checks": {...}}`` (a 503 is answered, not raised)."""
        return self.request("GET", "/readyz", ok=(503,), on_503=lambda: None).json()

    def bundles(self) -> dict[str, Any]:
        """``GET /v1/bundles``: ``{"data": [{"name", "default"}], "default": name, "default_photo": name or None}``."""
        return self.request("GET", "/v1/bundles").json()

    # ------------------------------------------------------------ exemplar sets

    def create_exemplar_set(self, images: ImageInput | Sequence[ImageInput], *, name: str | None = None,
                            bundle: str | None = None,
                            boxes: Sequence[Sequence[float]] | None = None,
                            negatives: ImageInput | Sequence[ImageInput] | None = None,
                            threshold: float | None = None) -> ExemplarSet:
        """Register exemplar crops; with ``boxes`` (one ``[x1, y1, x2, y2]`` per image), whole images whose
        boxes are cut out, kept as the set's labeled examples. ``bundle``: none, the server's default, or its photo
        default for crops that look like photos (the set's ``bundle`` says which). ``negatives``: crops of
        look-alikes to avoid; ``threshold``: the calibrated confidence at which an answer counts as found."""
        import json

        data = {"name": name, "bundle": bundle,
                "boxes": json.dumps([list(map(float, b)) for b in boxes]) if boxes is not None else None,
                "threshold": None if threshold is None else str(float(threshold))}
        files = files_fields(images) + (files_fields(negatives, "negative_files") if negatives is not None else [])
        # A set's creation runs on after a client gives up (a photo set's calibration: 15 s on 2 idle cores, minutes
        # on a loaded one), and a retry would make a second set: wait for it rather than time out at ``timeout``.
        read = self.http.timeout.read
        r = self.request("POST", "/v1/exemplar-sets", data=data, files=files,
                         timeout=None if read is None else max(read, CREATE_SET_TIMEOUT))
        return ExemplarSet.model_validate(r.json())

    def list_exemplar_sets(self, *, limit: int = 50, offset: int = 0) -> Page[ExemplarSet]:
        r = self.request("GET", "/v1/exemplar-sets", params={"limit": limit, "offset": offset})
        return Page[ExemplarSet].model_validate(r.json())

    def get_exemplar_set(self, set_id: SetRef) -> ExemplarSet:
        return ExemplarSet.model_validate(self.request("GET", f"/v1/exemplar-sets/{_id(set_id)}").json())

    def update_exemplar_set(self, set_id: SetRef, **change: str | float | None) -> ExemplarSet:
        """Change the set's ``name`` and / or ``threshold`` (keywords; ``name=None`` clears the name) -> the set.
        The same request twice gives the same set: retried after a lost connection."""
        threshold = change.get("threshold")
        if isinstance(threshold, float) and not math.isfinite(threshold):
            raise ValueError(f"threshold must be a finite number in [0, 1], got {threshold}")
        r = self.request("PATCH", f"/v1/exemplar-sets/{_id(set_id)}", json=change, idempotent=True)
        return ExemplarSet.model_validate(r.json())

    def delete_exemplar_set(self, set_id: SetRef) -> None:
        """Delete the set with its exemplars, jobs and checkpoints (409 while it has unfinished jobs)."""
        self.request("DELETE", f"/v1/exemplar-sets/{_id(set_id)}")

    def localize(self, set_id: SetRef, images: ImageInput | Sequence[ImageInput], *,
                 checkpoint: str | uuid.UUID | Checkpoint = "active", trajectory: bool = False,
                 samples: int | None = None, nearest: bool | None = None, keep: bool | None = None,
                 max_instances: int | None = None, **options: Any) -> LocalizeResponse:
        """One box per image, in its own pixels. ``checkpoint``: ``active``, ``base`` or a checkpoint id;
        ``samples``: best-of-N search; ``nearest``: the visited box nearest the exemplars; ``keep``: also add
        the images to the set's pool; ``max_instances``: up to that many objects per image (``instances``). Other
        query options the server knows pass through ``options`` (``min_confidence``, ``rerank``; for an export
        format, call ``export``). Retried on 503 (the server computed nothing then), but not after a lost answer when
        ``keep`` is set."""
        if options.get("format", "json") != "json":
            raise ValueError(f"format={options['format']!r} answers an export, not a LocalizeResponse: call "
                             "QlocClient.export")
        r = self._localize(set_id, images, checkpoint=checkpoint, trajectory=trajectory, samples=samples,
                           nearest=nearest, keep=keep, max_instances=max_instances, **options)
        return LocalizeResponse.model_validate(r.json())

    def export(self, set_id: SetRef, images: ImageInput | Sequence[ImageInput], *,
               format: Literal["coco", "labelstudio"] = "coco",  # noqa: A002 -- the server's parameter
               checkpoint: str | uuid.UUID | Checkpoint = "active",
               keep: bool | None = None, **options: Any) -> Export:
        """``localize`` answered in a labeling tool's format -> ``Export``: ``data``, the server's JSON as is (COCO:
        ``{"images", "categories", "annotations"}``, each annotation's ``bbox`` ``[x, y, w, h]`` in its image's
        pixels; Label Studio: a list of tasks with their predictions), and ``kept``, the pool ids of the images
        ``keep`` added.
        ``options``: ``image_ids``, ``category_id``, ``label``, ``max_instances``, ``min_confidence``, ..."""
        r = self._localize(set_id, images, checkpoint=checkpoint, keep=keep, format=format, **options)
        kept = r.headers.get(KEPT_HEADER)
        return Export(format, r.json(), None if kept is None else [k for k in kept.split(",") if k])

    def _localize(self, set_id: SetRef, images: ImageInput | Sequence[ImageInput], *,
                  checkpoint: str | uuid.UUID | Checkpoint, keep: bool | None, trajectory: bool = False,
                  samples: int | None = None, nearest: bool | None = None, max_instances: int | None = None,
                  **options: Any) -> httpx.Response:
        params: dict[str, Any] = {"checkpoint": _id(checkpoint), "trajectory": _bool(trajectory),
                                  "samples": samples, "nearest": None if nearest is None else _bool(nearest),
                                  "keep": None if keep is None else _bool(keep), "max_instances": max_instances}
        if not trajectory:
            del params["trajectory"]  # the server's default; exports refuse the parameter
        params.update({k: _bool(v) if isinstance(v, bool) else v for k, v in options.items()})
        return self.request("POST", f"/v1/exemplar-sets/{_id(set_id)}/localize", params=params,
                            files=files_fields(images), idempotent=not keep)

    # ------------------------------------------------------------ adaptation jobs

    def create_adaptation(self, set_id: SetRef, images: ImageInput | Sequence[ImageInput] | None = None,
                          *, source: Literal["files", "pool", "both"] | None = None, iterations: int | None = None,
                          learning_rate: float | None = None, seed: int | None = None,
                          activate: Literal["auto", "true", "false"] | bool = "auto",
                          idempotency_key: str | None = None) -> AdaptationJob:
        """Queue a test-time adaptation of the set's policy on unlabeled images -> the job (202): the ``images``
        given, the set's pool (``source="pool"``, no images), or both (``source="both"``).

        The request carries an ``Idempotency-Key`` (a new one unless given): a retry after a lost connection
        gets the job the first try created. After a 503 (the queue was unreachable: the job it made failed),
        a retry uses a new key when the key was generated here; a key of your own is never retried on 503."""
        if isinstance(activate, bool):
            activate = "true" if activate else "false"
        own_key = idempotency_key is None
        key = idempotency_key or str(uuid.uuid4())
        data = {"source": source, "iterations": iterations, "learning_rate": learning_rate, "seed": seed,
                "activate": activate}
        files = files_fields(images) if images is not None else None
        if files is None and source is None:
            data["source"] = "pool"  # no images: the set's pool, said explicitly (a multipart body needs a field)
        r = self.request("POST", f"/v1/exemplar-sets/{_id(set_id)}/adaptations", data=data, files=files,
                         headers={"Idempotency-Key": key}, idempotent=True,
                         on_503=(lambda: {"Idempotency-Key": str(uuid.uuid4())}) if own_key else (lambda: None))
        return AdaptationJob.model_validate(r.json())

    def get_adaptation(self, job_id: uuid.UUID | str | AdaptationJob) -> AdaptationJob:
        return AdaptationJob.model_validate(self.request("GET", f"/v1/adaptations/{_id(job_id)}").json())

    def list_adaptations(self, set_id: SetRef, *, limit: int = 50, offset: int = 0) -> Page[AdaptationJob]:
        r = self.request("GET", f"/v1/exemplar-sets/{_id(set_id)}/adaptations",
                         params={"limit": limit, "offset": offset})
        return Page[AdaptationJob].model_validate(r.json())

    def cancel_adaptation(self, job_id: uuid.UUID | str | AdaptationJob) -> AdaptationJob:
        """Cancel a queued job at once, a running one between two iterations (409 once it finished)."""
        r = self.request("POST", f"/v1/adaptations/{_id(job_id)}/cancel", idempotent=True)
        return AdaptationJob.model_validate(r.json())

    def wait(self, job: uuid.UUID | str | AdaptationJob, *, timeout: float | None = None, poll: float = 1.0,
             progress: bool = True, on_update: Callable[[AdaptationJob], None] | None = None) -> AdaptationJob:
        """Poll the job until it is ``succeeded``, ``failed`` or ``canceled`` -> its last state (not raised:
        look at ``status``, ``error`` and ``verdict``). ``progress`` draws a bar (tqdm, else plain text);
        ``timeout`` (seconds) raises ``TimeoutError`` with the job's last state."""
        deadline = None if timeout is None else time.monotonic() + timeout
        current = job if isinstance(job, AdaptationJob) else self.get_adaptation(job)
        bar = progress_bar(current.progress.total, f"job {str(current.id)[:8]}") if progress else None
        try:
            while True:
                if bar is not None:
                    reward, phase = current.progress.mean_reward, current.progress.phase
                    bar.update_to(current.progress.iteration, current.progress.total,
                                  current.status + (f" ({phase})" if phase and phase != "adapting" else "")
                                  + (f" reward {reward:.4f}" if reward is not None else ""))
                if on_update is not None:
                    on_update(current)
                if current.done:
                    return current
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"job {current.id} still {current.status} after {timeout}s")
                self._sleep(poll)
                current = self.get_adaptation(current.id)
        finally:
            if bar is not None:
                bar.close()

    # ------------------------------------------------------------ the set's image pool

    def add_pool_images(self, set_id: SetRef, images: ImageInput | Sequence[ImageInput]) -> PoolImages:
        """Add unlabeled images to the set's pool (for ``create_adaptation(source="pool")``) -> those added."""
        r = self.request("POST", f"/v1/exemplar-sets/{_id(set_id)}/images", files=files_fields(images))
        return PoolImages.model_validate(r.json())

    def list_pool_images(self, set_id: SetRef, *, limit: int = 50, offset: int = 0) -> PoolImages:
        r = self.request("GET", f"/v1/exemplar-sets/{_id(set_id)}/images",
                         params={"limit": limit, "offset": offset})
        return PoolImages.model_validate(r.json())

    def delete_pool_image(self, set_id: SetRef, image_id: uuid.UUID | str | PoolImage) -> None:
        self.request("DELETE", f"/v1/exemplar-sets/{_id(set_id)}/images/{_id(image_id)}", idempotent=True)

    def clear_pool(self, set_id: SetRef) -> None:
        """Empty the pool (409 while a queued or running job holds any of its images)."""
        self.request("DELETE", f"/v1/exemplar-sets/{_id(set_id)}/images", idempotent=True)

    # ------------------------------------------------------------ checkpoints

    def list_checkpoints(self, set_id: SetRef, *, limit: int = 50, offset: int = 0) -> Page[Checkpoint]:
        """The set's checkpoints, oldest first: its base policy, then those its jobs wrote (``parent_id``: lineage)."""
        r = self.request("GET", f"/v1/exemplar-sets/{_id(set_id)}/checkpoints",
                         params={"limit": limit, "offset": offset})
        return Page[Checkpoint].model_validate(r.json())

    def get_checkpoint(self, checkpoint_id: uuid.UUID | str | Checkpoint) -> Checkpoint:
        return Checkpoint.model_validate(self.request("GET", f"/v1/checkpoints/{_id(checkpoint_id)}").json())

    def delete_checkpoint(self, checkpoint_id: uuid.UUID | str | Checkpoint) -> None:
        """Delete an adapted checkpoint and its file (409: the set's base, its active one, or an unfinished job's).
        Retried after a lost connection, it may raise ``QlocError`` 404: the first try deleted it."""
        self.request("DELETE", f"/v1/checkpoints/{_id(checkpoint_id)}", idempotent=True)

    def activate_checkpoint(self, checkpoint_id: uuid.UUID | str | Checkpoint) -> ExemplarSet:
        """Make the checkpoint its set's active policy (an older one: a rollback) -> the set."""
        r = self.request("POST", f"/v1/checkpoints/{_id(checkpoint_id)}/activate", idempotent=True)
        return ExemplarSet.model_validate(r.json())


def _bool(v: bool) -> str:
    return "true" if v else "false"


def _id(x: Any) -> str:
    """An id as the URL takes it: a string, a UUID, or one of this client's models (its ``id``)."""
    return str(x.id) if isinstance(x, BaseModel) else str(x)


@dataclass(frozen=True)
class Export:
    """``QlocClient.export``'s answer."""

    format: str
    data: Any
    """The server's JSON as is (COCO detection results, or Label Studio tasks)."""
    kept: list[str] | None = None
    """The pool ids of the images ``keep=True`` added (the ``X-Qloc-Kept`` header), else ``None``."""


KEPT_HEADER = "X-Qloc-Kept"
