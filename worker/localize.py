"""The localize worker (``QLOC_INFERENCE=workers``): runs the API's model work from the localize queue.

Start one with a thread pool, so that several localize messages are in this process at once and can be
run as one batch::

    celery -A worker.celery_app worker -Q qloc-localize -n localize@%h --pool threads --concurrency 8 \
        --without-mingle --without-gossip

Each task thread checks and preprocesses its call and hands it to this process's ``BatchedInference``
(``app.serving``, the API's own batched backend): one engine thread runs the waiting calls of the same
bundle file, checkpoint and answer option as one forward pass (``QLOC_BATCH_WINDOW_MS``,
``QLOC_BATCH_MAX_IMAGES``, ``QLOC_INFERENCE_QUEUE_IMAGES`` of the worker's settings). Calls with
``samples > 0`` run alone: their random stream spans their own images.

Bundles and checkpoints are resolved as in the API's local mode, so a refusal carries the status and detail
the API would have answered itself (``app.remote.refusal``).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import replace
from typing import Any

import torch

from app import warmup
from app.calibration import calibrate_new_set
from app.calibration import negatives_confidence as calibration_of_negatives
from app.inference import BundleRegistry, LoadedBundle, UnknownBundle, prototype_to_bytes
from app.remote import (
    RETRY_AFTER,
    MadePrototype,
    decode_call,
    decode_image,
    encode_answer,
    encode_prototype,
    refusal,
    unb64,
)
from app.serving import BatchedInference, InferenceRefused, resolve_bundle
from models.calibration import Calibration
from worker.context import WorkerContext

log = logging.getLogger(__name__)

_lock = threading.Lock()
_backends: dict[int, BatchedInference] = {}


def inference(ctx: WorkerContext) -> BatchedInference:
    """This process's batched backend, started on first use (after a fork, the child's own)."""
    pid = os.getpid()
    with _lock:
        if pid not in _backends:
            s = ctx.settings
            warmup.install(ctx.bundles, s)  # this worker serves one-image calls too: their episode compiled
            # default_nearest None: the API already applied its QLOC_LOCALIZE_NEAREST; unset, the bundle decides
            _backends[pid] = BatchedInference(ctx.bundles, ctx.store, default_nearest=None,
                                              window_s=s.batch_window_ms / 1000, max_batch_images=s.batch_max_images,
                                              max_queue_images=s.inference_queue_images,
                                              retry_after_s=int(RETRY_AFTER))
        return _backends[pid]


def get_bundle(bundles: BundleRegistry, name: str, *, explicit: bool) -> LoadedBundle:
    """The bundle a new set is made with, refused as the API's local mode refuses it (``create_exemplar_set``)."""
    try:
        return bundles.get(name)
    except UnknownBundle as e:
        if explicit:
            raise InferenceRefused(422, str(e)) from e
        raise InferenceRefused(503, f"default bundle unavailable: {e}") from e
    except (OSError, ValueError, RuntimeError) as e:
        log.exception("bundle %s cannot be loaded", name)
        raise InferenceRefused(503, f"bundle {name!r} cannot be loaded") from e


def localize(ctx: WorkerContext, payload: dict[str, Any]) -> dict[str, Any]:
    """The ``qloc.localize`` task: an encoded ``LocalizeCall`` -> an encoded answer, or a refusal."""
    try:
        return encode_answer(inference(ctx).localize(decode_call(payload)))
    except InferenceRefused as e:
        return refusal(e)


def prototype(ctx: WorkerContext, payload: dict[str, Any]) -> dict[str, Any]:
    """The ``qloc.prototype`` task: exemplar crops -> the new set's prototype and bundle file, or a refusal."""
    try:
        loaded = get_bundle(ctx.bundles, payload["bundle"], explicit=bool(payload["explicit"]))
    except InferenceRefused as e:
        return refusal(e)
    crops = [decode_image(c) for c in payload["crops"]]
    proto = loaded.localizer.prototype(crops)
    made = MadePrototype(loaded.name, loaded.sha256, prototype_to_bytes(proto), int(proto.numel()))
    if payload.get("threshold") is not None:  # the set's calibration, as the API fits it in local mode
        examples = [(decode_image(e["image"]), tuple(e["box"])) for e in payload.get("examples", [])]
        negatives = [decode_image(c) for c in payload.get("negatives", [])]
        cal = calibrate_new_set(loaded, proto, crops, examples, negatives, threshold=float(payload["threshold"]),
                                verifier=ctx.bundles.verifier(loaded.name), samples=ctx.settings.calibration_samples)
        made = replace(made, calibration=cal.calibration, negatives=cal.negatives, num_negatives=cal.num_negatives)
    return encode_prototype(made)


def negatives_confidence(ctx: WorkerContext, payload: dict[str, Any]) -> dict[str, Any]:
    """The ``qloc.negatives_confidence`` task: a set's boxes -> their confidences by its negatives' fit
    (``app.calibration.negatives_confidence``, with the set's bundle file), or a refusal."""
    try:
        loaded = resolve_bundle(ctx.bundles, payload["bundle"], sha256=payload["bundle_sha256"],
                                prototype_dim=int(payload["prototype_dim"]))
    except InferenceRefused as e:
        return refusal(e)
    images = [decode_image(d) for d in payload["images"]]
    boxes = torch.tensor(payload["boxes"], dtype=torch.float32).view(len(images), -1, 4)
    with torch.inference_mode():
        conf = calibration_of_negatives(loaded, unb64(payload["prototype"]), unb64(payload["negatives"]),
                                        Calibration.from_dict(payload["calibration"]), images, boxes)
    return {"confidence": conf.tolist()}


def check_bundle(ctx: WorkerContext, payload: dict[str, Any]) -> dict[str, Any]:
    """The ``qloc.check_bundle`` task: is the set's bundle file the installed one -> ``{"ok": true}`` or a refusal."""
    try:
        resolve_bundle(ctx.bundles, payload["bundle"], sha256=payload["bundle_sha256"],
                       prototype_dim=int(payload["prototype_dim"]))
    except InferenceRefused as e:
        return refusal(e)
    return {"ok": True}
