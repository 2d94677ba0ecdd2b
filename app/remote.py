"""Inference on workers (``QLOC_INFERENCE=workers``): the API's side of the localize queue.

In this mode the API loads no bundle: it has no model and needs no GPU. Everything that needs one is a
Celery task on ``QLOC_LOCALIZE_QUEUE`` (consumed by ``worker/localize.py``), answered through the result
backend (``QLOC_RESULT_BACKEND``):

- ``qloc.localize``: a ``LocalizeCall`` -> a ``LocalizeAnswer`` (the worker batches concurrent calls);
- ``qloc.prototype``: exemplar crops (and labeled examples) -> the prototype and the calibration of a new set,
  with the bundle file that made it;
- ``qloc.check_bundle``: is the set's bundle file still the installed one (before an adaptation job is stored);
- ``qloc.negatives_confidence``: the confidences of boxes by a set's negatives' fit (its boxes embedded by the
  set's bundle: sets with negative exemplars and no NCC fit).

A worker's refusal comes back as ``InferenceRefused`` with the status and detail the API would have given
in local mode (409 replaced bundle, 503 bundle unavailable, ...). A call no worker answers within
``QLOC_LOCALIZE_TIMEOUT`` seconds (``QLOC_SET_TIMEOUT`` for a new set's prototype and calibration: all busy,
or none consuming the queue) is refused with 503 and ``Retry-After``; its message expires, so a worker that
comes later skips it. Where no worker consumes the queue at all (``app.localize_watch.ConsumerWatch``: Celery's
``active_queues`` broadcast, every ``QLOC_LOCALIZE_WORKER_CHECK_S``), calls are refused at once and ``/readyz`` says
so.

The wire format (JSON, as every task of the project) is defined here for both sides: images travel as
their decoded pixels (raw bytes, zlib-compressed; palette images as PNG), so the worker sees the very
image the API decoded.
"""

from __future__ import annotations

import base64
import io
import logging
import time
import uuid
import zlib
from dataclasses import dataclass, replace
from typing import Annotated, Any

import torch
from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeout
from fastapi import Depends, HTTPException, Request, status
from PIL import Image
from torch import Tensor

from app.config import Settings
from app.localize_watch import ConsumerWatch, ping_backend
from app.serving import CheckpointRef, InferenceRefused, LocalizeAnswer, LocalizeCall
from models.inference import Instance, Localization

log = logging.getLogger(__name__)

LOCALIZE_TASK = "qloc.localize"
PROTOTYPE_TASK = "qloc.prototype"
BUNDLE_CHECK_TASK = "qloc.check_bundle"
NEGATIVES_TASK = "qloc.negatives_confidence"
RETRY_AFTER = "5"
"""Seconds a client is asked to wait after a 503 of the localize queue."""


# --- wire format (shared by the API and the localize worker)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def encode_image(img: Image.Image) -> dict[str, Any]:
    """A decoded image -> JSON, decoded by ``decode_image`` into the same pixels (what the model sees).

    Transparent images become RGBA first, as the model's preprocessing does before anything else; palette
    images travel as PNG (palette kept); the others as their raw bytes, zlib-compressed."""
    if img.mode == "PA" or (img.mode != "P" and "transparency" in img.info):
        img = img.convert("RGBA")  # models.inference.pil_to_tensor's first step for these
    if img.mode == "P":
        buf = io.BytesIO()
        img.save(buf, "PNG", compress_level=1)
        return {"png": _b64(buf.getvalue())}
    return {"mode": img.mode, "size": list(img.size), "raw": _b64(zlib.compress(img.tobytes(), 1))}


def decode_image(data: dict[str, Any]) -> Image.Image:
    if "png" in data:
        img = Image.open(io.BytesIO(unb64(data["png"])), formats=["PNG"])
        img.load()
        return img
    w, h = data["size"]
    return Image.frombytes(data["mode"], (int(w), int(h)), zlib.decompress(unb64(data["raw"])))


def encode_call(call: LocalizeCall) -> dict[str, Any]:
    ck = call.checkpoint
    return {"bundle": call.bundle, "bundle_sha256": call.bundle_sha256, "prototype_dim": call.prototype_dim,
            "prototype": _b64(call.prototype),
            "checkpoint": None if ck is None else {"id": str(ck.id), "blob": ck.blob, "sha256": ck.sha256},
            "images": [encode_image(im) for im in call.images], "trajectory": call.trajectory,
            "samples": call.samples, "nearest": call.nearest, "max_instances": call.max_instances,
            "extra_boxes": None if call.extra_boxes is None else [None if b is None else list(b)
                                                                  for b in call.extra_boxes]}


def decode_call(data: dict[str, Any]) -> LocalizeCall:
    ck = data["checkpoint"]
    return LocalizeCall(
        bundle=data["bundle"], bundle_sha256=data["bundle_sha256"], prototype_dim=int(data["prototype_dim"]),
        prototype=unb64(data["prototype"]),
        checkpoint=None if ck is None else CheckpointRef(uuid.UUID(ck["id"]), ck["blob"], ck["sha256"]),
        images=[decode_image(d) for d in data["images"]], trajectory=bool(data["trajectory"]),
        samples=int(data["samples"]), nearest=data["nearest"], max_instances=int(data.get("max_instances", 1)),
        extra_boxes=None if data.get("extra_boxes") is None else [
            None if b is None else (float(b[0]), float(b[1]), float(b[2]), float(b[3])) for b in data["extra_boxes"]])


def encode_answer(answer: LocalizeAnswer) -> dict[str, Any]:
    return {"nearest": answer.nearest, "refined": answer.refined,
            "results": [{"box": list(r.box), "score": r.score,
                         "trajectory": None if r.trajectory is None else [list(b) for b in r.trajectory],
                         "instances": None if r.instances is None else [[list(i.box), i.score, i.template]
                                                                         for i in r.instances]}
                        for r in answer.results]}


def decode_answer(data: dict[str, Any]) -> LocalizeAnswer:
    return LocalizeAnswer(
        [Localization(tuple(r["box"]), float(r["score"]),  # type: ignore[arg-type]
                      None if r["trajectory"] is None else [tuple(b) for b in r["trajectory"]],
                      None if r.get("instances") is None else [Instance(tuple(i[0]), float(i[1]),  # type: ignore[arg-type]
                                                                        bool(i[2]) if len(i) > 2 else False)
                                                               for i in r["instances"]])
         for r in data["results"]], bool(data["nearest"]), bool(data.get("refined", False)))


def refusal(e: InferenceRefused) -> dict[str, Any]:
    """What a worker answers instead of a result when the call is refused (``InferenceRefused``)."""
    return {"refused": {"status": e.status_code, "detail": e.detail, "headers": e.headers}}


@dataclass(frozen=True)
class MadePrototype:
    """A new exemplar set's prototype and the bundle file that made it."""

    bundle: str
    bundle_sha256: str
    prototype: bytes
    """float32 little-endian, as stored with the set."""
    prototype_dim: int
    calibration: dict[str, Any] | None = None
    """The set's calibration (``app.calibration.calibrate_new_set``), where it was asked for."""
    negatives: bytes | None = None
    """The negative exemplars' embeddings (float32 little-endian ``[J, D]``), where the set has some."""
    num_negatives: int = 0


def encode_prototype(made: MadePrototype) -> dict[str, Any]:
    return {"bundle": made.bundle, "bundle_sha256": made.bundle_sha256, "prototype": _b64(made.prototype),
            "prototype_dim": made.prototype_dim, "calibration": made.calibration,
            "negatives": None if made.negatives is None else _b64(made.negatives), "num_negatives": made.num_negatives}


# --- the API's side


class WorkerInference:
    """An ``InferenceBackend`` that sends each call to the localize queue and waits for its answer.

    Also makes prototypes and checks bundles there, so an API in this mode never loads a bundle."""

    def __init__(self, settings: Settings, celery: Celery):
        if not settings.result_backend:
            raise ValueError("WorkerInference needs a result backend (QLOC_RESULT_BACKEND)")
        self.settings, self.celery = settings, celery
        self.timeout = settings.localize_timeout
        self.default_nearest = settings.localize_nearest
        self.consumers = ConsumerWatch(celery, settings.localize_queue, settings.localize_worker_check_s)

    def localize(self, call: LocalizeCall) -> LocalizeAnswer:
        if call.nearest is None and self.default_nearest is not None:  # this server's QLOC_LOCALIZE_NEAREST
            call = replace(call, nearest=self.default_nearest)
        return decode_answer(self._ask(LOCALIZE_TASK, encode_call(call)))

    def prototype(self, bundle: str, crops: list[Image.Image], *, explicit: bool,  # noqa: PLR0913
                  examples: list[tuple[Image.Image, tuple[float, float, float, float]]] | None = None,
                  threshold: float | None = None, negatives: list[Image.Image] | None = None) -> MadePrototype:
        """The prototype of ``crops`` by the bundle installed as ``bundle``, and with ``threshold`` the new set's
        calibration too (``examples``: its labeled examples, whole images with their boxes; ``negatives``: its
        negative exemplars' crops, embedded too), as local mode fits it. ``explicit``: the client named the bundle
        (an unknown one is its mistake: 422), else it is the server's default (503)."""
        payload: dict[str, Any] = {"bundle": bundle, "explicit": explicit, "crops": [encode_image(c) for c in crops]}
        if threshold is not None:
            payload.update(threshold=threshold, examples=[{"image": encode_image(im), "box": list(box)}
                                                          for im, box in examples or []],
                           negatives=[encode_image(c) for c in negatives or []])
        out = self._ask(PROTOTYPE_TASK, payload, timeout=max(self.timeout, self.settings.set_timeout))
        if negatives and "negatives" not in out:  # a worker of the version before: it would drop them silently
            raise InferenceRefused(status.HTTP_503_SERVICE_UNAVAILABLE, "the localize worker is of an earlier "
                                   "version that cannot take negative_files; retry when it is upgraded",
                                   {"Retry-After": RETRY_AFTER})
        return MadePrototype(out["bundle"], out["bundle_sha256"], unb64(out["prototype"]), int(out["prototype_dim"]),
                             out.get("calibration"),  # none from a worker of the version before
                             None if out.get("negatives") is None else unb64(out["negatives"]),
                             int(out.get("num_negatives", 0)))

    def negatives_confidence(self, call: LocalizeCall, negatives: bytes, calibration: dict[str, Any],
                             images: list[Image.Image], boxes: Tensor) -> Tensor:
        """``app.calibration.negatives_confidence`` on a worker: boxes ``[n, K, 4]`` (a tensor, in the pixels of
        ``images``) of the set of ``call`` (its bundle file and prototype) -> ``[n, K]`` confidences by its
        negatives' fit of ``calibration`` (refused as localize is: 409 for a replaced bundle file, ...)."""
        out = self._ask(NEGATIVES_TASK, {
            "bundle": call.bundle, "bundle_sha256": call.bundle_sha256, "prototype_dim": call.prototype_dim,
            "prototype": _b64(call.prototype), "negatives": _b64(negatives), "calibration": calibration,
            "images": [encode_image(im) for im in images], "boxes": boxes.tolist()})
        return torch.tensor(out["confidence"], dtype=torch.float32).view(boxes.shape[:2])

    def check_bundle(self, bundle: str, *, sha256: str | None, prototype_dim: int) -> None:
        """Refused (409) unless the file installed as ``bundle`` is the one that made a set (``sha256``)."""
        self._ask(BUNDLE_CHECK_TASK, {"bundle": bundle, "bundle_sha256": sha256, "prototype_dim": prototype_dim})

    def ping(self) -> None:
        """Raise unless the result backend answers (``ping_backend``)."""
        ping_backend(self.celery)

    def _ask(self, task: str, payload: dict[str, Any], *, timeout: float | None = None) -> dict[str, Any]:
        queue, timeout = self.settings.localize_queue, timeout or self.timeout
        retry = {"Retry-After": RETRY_AFTER}
        absent = self.consumers.absent()
        if absent is not None:  # nobody would answer: refused now, not after the timeout
            raise InferenceRefused(status.HTTP_503_SERVICE_UNAVAILABLE, absent, retry)
        if self.consumers.backend_error is not None and not self._backend_answers():
            # sending would first wait on the result backend's connection retries (~20 s), then fail
            raise InferenceRefused(status.HTTP_503_SERVICE_UNAVAILABLE, BACKEND_DOWN, retry)
        try:  # expires: a message still queued when this call gives up is skipped by the worker that gets it
            res = self.celery.send_task(task, args=[payload], queue=queue, expires=timeout, ignore_result=False)
        except Exception as e:
            log.exception("%s: cannot send to queue %s", task, queue)
            raise InferenceRefused(status.HTTP_503_SERVICE_UNAVAILABLE,
                                   "the localize queue is unreachable; retry later" if self._backend_answers()
                                   else BACKEND_DOWN, retry) from e
        try:
            out = self._wait(res, timeout)
            failed = not res.successful()
        except WorkersGone as e:
            raise InferenceRefused(status.HTTP_503_SERVICE_UNAVAILABLE, str(e), retry) from e
        except CeleryTimeout as e:
            raise InferenceRefused(status.HTTP_503_SERVICE_UNAVAILABLE, (
                f"no localize worker answered within {timeout:g} s "
                f"({'QLOC_SET_TIMEOUT' if task == PROTOTYPE_TASK else 'QLOC_LOCALIZE_TIMEOUT'}): all busy, none "
                f"consuming queue {queue!r}, the one running it gone, or the workers answering to another result "
                "backend than this API's QLOC_RESULT_BACKEND; retry later"), retry) from e
        except Exception as e:
            log.exception("%s: cannot read the answer of task %s", task, res.id)
            raise InferenceRefused(status.HTTP_503_SERVICE_UNAVAILABLE, BACKEND_DOWN, retry) from e
        finally:
            try:
                res.forget()  # the answer is read (or given up on): drop it and its subscription
            except Exception:  # noqa: BLE001 -- it expires anyway (result_expires)
                log.debug("could not forget task %s", res.id, exc_info=True)
        if failed or not isinstance(out, dict):
            log.error("%s: task %s failed on the worker: %r", task, res.id, out)
            raise InferenceRefused(status.HTTP_503_SERVICE_UNAVAILABLE,
                                   f"the localize worker failed ({type(out).__name__}); retry later", retry)
        if "refused" in out:
            r = out["refused"]
            raise InferenceRefused(int(r["status"]), str(r["detail"]), r.get("headers"))
        return out

    def _wait(self, res: Any, timeout: float) -> Any:
        """``res``'s answer within ``timeout`` seconds; given up (``WorkersGone``) as soon as the watch sees that no
        worker consumes the queue while the call is still waiting there (a call sent as the last worker went away
        would otherwise wait the whole timeout), or that the worker that started it (its tasks track it: the state
        names the worker) is gone: killed, its call dies with it. A worker stopping gracefully finishes what it
        started but no longer answers the watch: a call of its that takes longer than two checks is given up too
        (503: the client's retry goes to another worker)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                return res.get(timeout=max(0.01, min(left, WAIT_SLICE_S)), propagate=False)
            except CeleryTimeout:
                if left <= WAIT_SLICE_S:
                    raise
                why = self._given_up(res)
                if why is not None:
                    raise WorkersGone(why) from None

    def _given_up(self, res: Any) -> str | None:
        """Why a call still waiting after a slice can no longer be answered, or ``None``. Reads the call's state from
        the result backend (once a second, and only for calls that take that long) while the watch has something to
        tell: no worker at all, or its names."""
        absent = self.consumers.absent()
        if absent is None and not self.consumers.recent:
            return None
        state = res.state
        if state == "PENDING":
            return absent
        if state == "STARTED":
            worker = (res.info or {}).get("hostname") if isinstance(res.info, dict) else None
            return None if worker is None else self.consumers.gone(str(worker))
        return None

    def _backend_answers(self) -> bool:
        try:
            self.ping()
            return True
        except Exception:  # noqa: BLE001
            return False


class WorkersGone(Exception):
    """No worker consumes the localize queue any more (``ConsumerWatch.absent``)."""


BACKEND_DOWN = "the result backend (QLOC_RESULT_BACKEND) is unreachable; retry later"
WAIT_SLICE_S = 1.0
"""Seconds between looks at ``ConsumerWatch`` while a call waits for its answer."""


def get_remote(request: Request) -> WorkerInference | None:
    """The app's ``WorkerInference`` in ``QLOC_INFERENCE=workers`` mode, else ``None`` (the API runs the model)."""
    return getattr(request.app.state, "remote", None)


async def remote_dep(request: Request) -> WorkerInference | None:
    """``get_remote`` as a dependency, run on the event loop: a sync one costs a thread hop per request."""
    return get_remote(request)


RemoteDep = Annotated[WorkerInference | None, Depends(remote_dep)]


def answer_refusal(e: InferenceRefused) -> HTTPException:
    """A refusal as the route's HTTP error (same status, detail and headers)."""
    return HTTPException(e.status_code, e.detail, headers=e.headers)
