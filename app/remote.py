"""Inference on workers (``QLOC_INFERENCE=workers``): the API's side of the localize queue.

In this mode the API loads no bundle: it has no model and needs no GPU. Everything that needs one is a
Celery task on ``QLOC_LOCALIZE_QUEUE`` (consumed by ``worker/localize.py``), answered through the result
backend (``QLOC_RESULT_BACKEND``):

- ``qloc.localize``: a ``LocalizeCall`` -> a ``LocalizeAnswer`` (the worker batches concurrent calls);
- ``qloc.prototype``: exemplar crops (and labeled examples) -> the prototype and the calibration of a new set,
  with the bundle file that made it;
- ``qloc.check_bundle``: is the set's bundle file still the installed one (before an adaptation job is stored).

A worker's refusal comes back as ``InferenceRefused`` with the status and detail the API would have given
in local mode (409 replaced bundle, 503 bundle unavailable, ...). A call no worker answers within
``QLOC_LOCALIZE_TIMEOUT`` seconds (none consuming the queue, or all busy) is refused with 503 and
``Retry-After``; its message expires, so a worker that comes later skips it.

The wire format (JSON, as every task of the project) is defined here for both sides: images travel as
their decoded pixels (raw bytes, zlib-compressed; palette images as PNG), so the worker sees the very
image the API decoded.
"""

from __future__ import annotations

import base64
import io
import logging
import uuid
import zlib
from dataclasses import dataclass, replace
from typing import Annotated, Any

from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeout
from fastapi import Depends, HTTPException, Request, status
from PIL import Image

from app.config import Settings
from app.serving import CheckpointRef, InferenceRefused, LocalizeAnswer, LocalizeCall
from models.inference import Instance, Localization

log = logging.getLogger(__name__)

LOCALIZE_TASK = "qloc.localize"
PROTOTYPE_TASK = "qloc.prototype"
BUNDLE_CHECK_TASK = "qloc.check_bundle"
RETRY_AFTER = "5"
"""Seconds a client is asked to wait after a 503 of the localize queue."""


# --- wire format (shared by the API and the localize worker)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
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
        img = Image.open(io.BytesIO(_unb64(data["png"])), formats=["PNG"])
        img.load()
        return img
    w, h = data["size"]
    return Image.frombytes(data["mode"], (int(w), int(h)), zlib.decompress(_unb64(data["raw"])))


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
        prototype=_unb64(data["prototype"]),
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


def encode_prototype(made: MadePrototype) -> dict[str, Any]:
    return {"bundle": made.bundle, "bundle_sha256": made.bundle_sha256, "prototype": _b64(made.prototype),
            "prototype_dim": made.prototype_dim, "calibration": made.calibration}


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

    def localize(self, call: LocalizeCall) -> LocalizeAnswer:
        if call.nearest is None and self.default_nearest is not None:  # this server's QLOC_LOCALIZE_NEAREST
            call = replace(call, nearest=self.default_nearest)
        return decode_answer(self._ask(LOCALIZE_TASK, encode_call(call)))

    def prototype(self, bundle: str, crops: list[Image.Image], *, explicit: bool,
                  examples: list[tuple[Image.Image, tuple[float, float, float, float]]] | None = None,
                  threshold: float | None = None) -> MadePrototype:
        """The prototype of ``crops`` by the bundle installed as ``bundle``, and with ``threshold`` the new set's
        calibration too (``examples``: its labeled examples, whole images with their boxes), as local mode fits it.
        ``explicit``: the client named the bundle (an unknown one is its mistake: 422), else it is the server's
        default (503)."""
        payload: dict[str, Any] = {"bundle": bundle, "explicit": explicit, "crops": [encode_image(c) for c in crops]}
        if threshold is not None:
            payload.update(threshold=threshold, examples=[{"image": encode_image(im), "box": list(box)}
                                                          for im, box in examples or []])
        out = self._ask(PROTOTYPE_TASK, payload)
        return MadePrototype(out["bundle"], out["bundle_sha256"], _unb64(out["prototype"]), int(out["prototype_dim"]),
                             out.get("calibration"))  # none from a worker of the version before

    def check_bundle(self, bundle: str, *, sha256: str | None, prototype_dim: int) -> None:
        """Refused (409) unless the file installed as ``bundle`` is the one that made a set (``sha256``)."""
        self._ask(BUNDLE_CHECK_TASK, {"bundle": bundle, "bundle_sha256": sha256, "prototype_dim": prototype_dim})

    def ping(self) -> None:
        """Raise unless the result backend answers (a real round trip: a read of a key no task has)."""
        self.celery.backend.get_task_meta(f"qloc-ping-{uuid.uuid4()}")

    def _ask(self, task: str, payload: dict[str, Any]) -> dict[str, Any]:
        queue, timeout = self.settings.localize_queue, self.timeout
        retry = {"Retry-After": RETRY_AFTER}
        try:  # expires: a message still queued when this call gives up is skipped by the worker that gets it
            res = self.celery.send_task(task, args=[payload], queue=queue, expires=timeout, ignore_result=False)
        except Exception as e:
            log.exception("%s: cannot send to queue %s", task, queue)
            raise InferenceRefused(status.HTTP_503_SERVICE_UNAVAILABLE,
                                   "the localize queue is unreachable; retry later", retry) from e
        try:
            out = res.get(timeout=timeout, propagate=False)
            failed = not res.successful()
        except CeleryTimeout as e:
            raise InferenceRefused(status.HTTP_503_SERVICE_UNAVAILABLE, (
                f"no localize worker answered within {timeout:g} s (QLOC_LOCALIZE_TIMEOUT): all busy, or none "
                f"consuming queue {queue!r}; retry later"), retry) from e
        except Exception as e:
            log.exception("%s: cannot read the answer of task %s", task, res.id)
            raise InferenceRefused(status.HTTP_503_SERVICE_UNAVAILABLE,
                                   "the result backend is unreachable; retry later", retry) from e
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
