"""Where localize requests are computed: the seam between the routes and the model.

A route turns a request into a ``LocalizeCall`` (what to run: the set's bundle and prototype, the
checkpoint, the decoded images, the options) and hands it to the app's ``InferenceBackend``, which
answers a ``LocalizeAnswer`` or raises ``InferenceRefused`` (an HTTP status and a message for the
client). ``LocalInference`` runs it in the calling thread; ``BatchedInference`` (the API's default)
runs the calls of concurrent requests as few forward passes on one engine thread, with a bounded
waiting room (503 + ``Retry-After`` past it); a worker-side batcher can reuse it as is (it needs a
``BundleRegistry`` and a ``BlobStore``, no FastAPI). Other backends (on workers) keep the same contract,
so the routes do not change with the deployment.
"""

from __future__ import annotations

import logging
import math
import threading
import uuid
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Protocol

import torch
from fastapi import status
from PIL import Image
from torch import Tensor

from app.batching import Batcher, BatcherClosed, Expected, QueueFull
from app.engine_ncc import NccFeatures, SecondLook, doubtful_answers, read_kinds, read_ncc, template_windows
from app.images import Box
from app.inference import (
    BundleMismatch,
    BundleRegistry,
    LoadedBundle,
    UnknownBundle,
    prototype_from_bytes,
    read_served_checkpoint,
    short_sha,
)
from app.lru import LoadingLRU
from app.storage import BlobStore
from models.bundle import PolicyMismatch, Reward
from models.core.templates import Templates
from models.inference import Localization, Localizer, preprocess
from models.nets.agent import Agent
from models.verifier import KindCheck, KindVerifier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointRef:
    """An adapted checkpoint to run (the base policy is ``None`` in ``LocalizeCall.checkpoint``)."""

    id: uuid.UUID
    blob: str
    sha256: str


@dataclass(frozen=True)
class LocalizeCall:
    bundle: str
    """The set's bundle name."""
    bundle_sha256: str | None
    """The bundle file that made the set's prototype (``None``: a set made before it was recorded)."""
    prototype_dim: int
    prototype: bytes
    """float32 little-endian, as stored with the set."""
    checkpoint: CheckpointRef | None
    images: list[Image.Image] = field(repr=False)
    trajectory: bool = False
    samples: int = 0
    nearest: bool | None = None
    """``None``: the bundle's own default."""
    max_instances: int = 1
    """Up to this many objects per image (``Localization.instances``; 1: the one answer only)."""
    templates: Templates | None = field(default=None, repr=False, compare=False)
    """The set's calibration templates, where its confidence is the NCC fit: the local backends then read each
    answer's NCC features with the forward pass, on its input batch (``LocalizeAnswer.ncc``), batched across the
    calls of a batch, where the model runs on the CPU. Other backends and devices leave it (the route then reads
    them itself)."""
    second_look: SecondLook | None = field(default=None, repr=False, compare=False)
    """With ``max_instances == 1`` and ``templates``: the images whose answer is doubtful get candidates in the same
    pass (``LocalizeAnswer.looked``), where the backend reads the templates; elsewhere ignored."""
    decoded_scales: list[tuple[float, float]] | None = field(default=None, repr=False, compare=False)
    """Per image, (full / decoded) along x and y (``DecodedImage.scale``: an upload larger than
    ``QLOC_DECODE_MAX_SIDE`` is decoded downscaled), where the backend matches the templates (``second_look``): the
    set's crops, cut from full images, are matched at their size in the decoded pixels. ``None``: 1.0."""
    kind: KindCheck | None = field(default=None, repr=False, compare=False)
    """The set's known-kinds check (``models.verifier``), where its confidence is the check's: the local backends
    read it on every answer's row of boxes with the forward pass (``LocalizeAnswer.kind``), batched across the
    calls of a batch, where they read the ``templates``; elsewhere the route reads it."""
    extra_boxes: list[Box | None] | None = field(default=None, repr=False, compare=False)
    """With ``max_instances > 1``: per image, one more candidate to score (in its pixels; ``None``: none), added
    last to its instances as ``Instance.template`` (``rerank=templates``' window, found by the route where the
    engine does not look for it: every backend and device scores it)."""


@dataclass(frozen=True)
class LocalizeAnswer:
    results: list[Localization]
    """One per image, in the pixels of the images as given in the call."""
    nearest: bool
    """Whether the answers are the nearest visited boxes (the option as resolved)."""
    refined: bool = False
    """Whether the answers were refined on the checkpoint's repaired reward (``models.refine``)."""
    ncc: NccFeatures | None = None
    """The call's ``templates`` read on every answer's row of boxes (``None``: not read here)."""
    looked: bool = False
    """The engine took the call's ``second_look``: the results with ``instances`` are those of the doubtful answers,
    and only theirs."""
    kind: Tensor | None = None
    """The call's ``kind`` check's probabilities on every answer's row of boxes ``[n, 1 + K]`` (``None``: not read
    here)."""


class InferenceRefused(Exception):  # noqa: N818 -- an answer for the client, not a crash
    """The call cannot be served; ``status_code`` and ``detail`` are what the client gets."""

    def __init__(self, status_code: int, detail: str, headers: dict[str, str] | None = None):
        super().__init__(detail)
        self.status_code, self.detail, self.headers = status_code, detail, headers


class InferenceBackend(Protocol):
    def localize(self, call: LocalizeCall) -> LocalizeAnswer: ...


def on_its_way(inference: InferenceBackend) -> AbstractContextManager[object]:
    """Around a request's work before its first ``localize`` (reading its set, decoding its images): a batching
    backend then holds an idle engine back for it while others run (``BatchedInference.expect``)."""
    expect = getattr(inference, "expect", None)
    return expect() if expect is not None else nullcontext()


def resolve_bundle(bundles: BundleRegistry, name: str, *, sha256: str | None, prototype_dim: int | None
                   ) -> LoadedBundle:
    """The bundle file installed as ``name``, checked against what a set recorded; ``InferenceRefused`` otherwise."""
    try:
        loaded = bundles.get(name, expect_sha256=sha256)
    except BundleMismatch as e:
        raise InferenceRefused(status.HTTP_409_CONFLICT, str(e)) from e
    except UnknownBundle as e:
        raise InferenceRefused(status.HTTP_503_SERVICE_UNAVAILABLE, f"the set's bundle unavailable: {e}") from e
    except (OSError, ValueError, RuntimeError) as e:
        log.exception("bundle %s cannot be loaded", name)
        raise InferenceRefused(status.HTTP_503_SERVICE_UNAVAILABLE, f"bundle {name!r} cannot be loaded") from e
    if prototype_dim is not None and prototype_dim != loaded.bundle.prototype_dim:
        raise InferenceRefused(status.HTTP_409_CONFLICT, (
            f"bundle {name!r} (sha256 {short_sha(loaded.sha256)}) makes prototypes of dimension "
            f"{loaded.bundle.prototype_dim}, but this exemplar set's prototype has dimension {prototype_dim}: it was "
            "made by another bundle file of that name. Re-create the exemplar set from its crops."))
    return loaded


@dataclass(frozen=True)
class Served:
    """What runs a checkpoint: its agent, the localizer of its reward (the bundle's head, or the repaired head the
    checkpoint carries) and the prototype under that head (``None``: the set's own)."""

    agent: Agent
    localizer: Localizer
    prototype: Tensor | None


def policy_state(bundles: BundleRegistry, store: BlobStore, ckpt: CheckpointRef | None, loaded: LoadedBundle
                 ) -> tuple[dict[str, Tensor] | None, Reward | None]:
    """(agent state, repaired reward) of ``ckpt`` for ``loaded`` (cached; ``(None, None)`` = the bundle's own)."""
    if ckpt is None:
        return None, None

    def load() -> tuple[dict[str, Tensor], Reward | None]:
        return read_served_checkpoint(store, blob=ckpt.blob, sha256=ckpt.sha256, bundle=loaded.bundle,
                                      source=f"checkpoint {ckpt.id}")

    try:  # keyed by the bundle file too: another file under the same name checks the checkpoint again
        return bundles.cached_policy((ckpt.id, loaded.sha256), load)
    except PolicyMismatch as e:
        raise InferenceRefused(status.HTTP_409_CONFLICT, f"{e}; localize with checkpoint=base, or re-create the "
                                                         "exemplar set from its crops") from e
    except FileNotFoundError as e:
        if not store.exists(ckpt.blob):  # deleted (DELETE /v1/checkpoints/{id}) after this request read its row
            raise InferenceRefused(status.HTTP_404_NOT_FOUND, f"checkpoint {ckpt.id} not found: it was deleted") from e
        log.exception("checkpoint %s cannot be read (its head file?)", ckpt.id)  # the file is there, a part is not
        raise InferenceRefused(status.HTTP_503_SERVICE_UNAVAILABLE, f"checkpoint {ckpt.id} cannot be read") from e
    except (OSError, ValueError) as e:
        log.exception("checkpoint %s cannot be read", ckpt.id)
        raise InferenceRefused(status.HTTP_503_SERVICE_UNAVAILABLE, f"checkpoint {ckpt.id} cannot be read") from e


class LocalInference:
    """Runs each call in the calling thread, in this process."""

    def __init__(self, bundles: BundleRegistry, store: BlobStore, *, default_nearest: bool | None = None,
                 agent_cache_size: int = 32):
        self.bundles, self.store = bundles, store
        self.default_nearest = default_nearest
        """The server's ``QLOC_LOCALIZE_NEAREST``: used when the call leaves ``nearest`` unset."""
        self._served: LoadingLRU[Served] = LoadingLRU(agent_cache_size)

    def served(self, loaded: LoadedBundle, ckpt: CheckpointRef | None) -> Served:
        """The agent of ``ckpt`` (``None``: the bundle's own) on ``loaded``, with its reward's localizer and
        prototype, built once and kept (eval-mode modules used without gradient: threads may share them)."""
        def load() -> Served:
            state, reward = policy_state(self.bundles, self.store, ckpt, loaded)
            if reward is None:
                return Served(loaded.localizer.agent(state), loaded.localizer, None)
            # a repaired reward: the checkpoint's head on the bundle's (shared) backbone, and its prototype; paired
            # with the policy its job started from where it carries it (format 4; by consensus, format 5)
            localizer = loaded.localizer.with_reward(reward)
            return Served(localizer.agent(state), localizer, reward.prototype.float())

        return self._served.get((loaded.sha256, None if ckpt is None else ckpt.id), load)

    def prepare(self, call: LocalizeCall) -> tuple[Hashable, Prepared]:
        """Everything a call needs before the forward pass, checked (``InferenceRefused`` otherwise) and
        preprocessed, with the key of the calls it may share a forward pass with."""
        loaded = resolve_bundle(self.bundles, call.bundle, sha256=call.bundle_sha256,
                                prototype_dim=call.prototype_dim)
        served = self.served(loaded, call.checkpoint)
        nearest = next(v for v in (call.nearest, self.default_nearest, loaded.localizer.default_nearest)
                       if v is not None)
        batch, scales = preprocess(call.images, loaded.localizer.spec)
        prototype = served.prototype if served.prototype is not None else prototype_from_bytes(call.prototype)
        spec = loaded.localizer.spec
        # The engine reads the templates only on the batch they are read on, and only where the model runs on the
        # CPU: on a GPU its thread must not wait for CPU work that the request threads do side by side.
        t = call.templates
        same_input = (t is not None and loaded.localizer.device.type == "cpu"
                      and (t.size, t.channels, tuple(t.fill)) == (spec.size, spec.channels, tuple(spec.fill)))
        look = call.second_look if same_input and call.max_instances == 1 else None
        extra = None
        if call.extra_boxes is not None and call.max_instances > 1:
            if len(call.extra_boxes) != len(call.images):
                raise ValueError(f"extra_boxes: {len(call.extra_boxes)} for {len(call.images)} images")
            extra = torch.tensor([list(b) if b is not None else [math.nan] * 4 for b in call.extra_boxes],
                                 dtype=torch.float32).view(-1, 4) / scales.repeat(1, 2)  # input pixels
        match_scales = scales if call.decoded_scales is None else scales * torch.tensor(call.decoded_scales).view(-1, 2)
        kind = None
        if call.kind is not None and same_input:
            verifier = self.bundles.verifier(call.bundle)
            if call.kind.made_with(verifier):
                kind = (verifier, call.kind)
        prepared = Prepared(served.localizer, served.agent, batch, scales, prototype, call.trajectory, call.samples,
                            nearest, call.max_instances, t if same_input else None, look, extra, match_scales, kind)
        # A best-of-N search draws one random stream over its call's images: it runs alone (object() is unique).
        key = (loaded.sha256, None if call.checkpoint is None else call.checkpoint.id, nearest,
               object() if call.samples > 0 else 0, call.max_instances)
        return key, prepared

    def localize(self, call: LocalizeCall) -> LocalizeAnswer:
        _, prepared = self.prepare(call)
        return run_prepared([prepared])[0]


@dataclass(frozen=True)
class Prepared:
    """A call ready for the forward pass: its images preprocessed, its agent built, its options resolved."""

    localizer: Localizer
    agent: Agent
    batch: Tensor
    """``[n, C, S, S]`` in [0, 1], the bundle's input."""
    scales: Tensor
    """``[n, 2]``: (w_i / S, h_i / S)."""
    prototype: Tensor
    """``[D]``."""
    trajectory: bool
    samples: int
    nearest: bool
    max_instances: int = 1
    templates: Templates | None = None
    """``LocalizeCall.templates`` where ``batch`` is what they are read on."""
    second_look: SecondLook | None = None
    """``LocalizeCall.second_look`` where the engine takes it (``templates`` set, ``max_instances == 1``)."""
    extra: Tensor | None = None
    """``LocalizeCall.extra_boxes`` in input pixels ``[n, 4]`` (NaN rows: none), with ``max_instances > 1``."""
    match_scales: Tensor | None = None
    """``[n, 2]``: (full w_i / S, full h_i / S), the scales template matching sizes the crops by (``scales`` times
    ``LocalizeCall.decoded_scales``); ``None``: ``scales``."""
    kind: tuple[KindVerifier, KindCheck] | None = None
    """``LocalizeCall.kind`` with the bundle's verifier it was made with, where ``batch`` is what it reads."""


def run_prepared(calls: list[Prepared]) -> list[LocalizeAnswer]:
    """Calls of one bundle file, agent and options (``LocalInference.prepare``'s key: ``nearest``, ``max_instances``)
    -> one forward pass over
    all their images, each image with its own call's prototype -> one answer per call.

    Greedy episodes do not depend on the other images of the batch: the answers equal those of the calls
    run one by one (to float rounding). A call with ``samples > 0`` must run alone (its random stream)."""
    first = calls[0]
    if len(calls) > 1 and any(c.samples > 0 for c in calls):
        raise ValueError("a best-of-N search (samples > 0) runs alone")
    counts = [c.batch.shape[0] for c in calls]
    if len(calls) == 1:
        batch, scales, prototypes = first.batch, first.scales, first.prototype
    else:
        batch, scales = torch.cat([c.batch for c in calls]), torch.cat([c.scales for c in calls])
        prototypes = torch.stack([c.prototype for c in calls]).repeat_interleave(
            torch.tensor(counts), dim=0)  # [B, D]: each image its call's prototype
    starts = list(accumulate(counts, initial=0))[:-1]
    answer_ncc: dict[int, NccFeatures] = {}
    answer_kind: dict[int, Tensor] = {}
    looks = [c.second_look for c in calls if c.second_look is not None]  # where the engine takes it (``prepare``)
    look_again = None
    if looks:
        def look_again(boxes: Tensor, distances: Tensor) -> Tensor:
            return doubtful_answers(calls, starts, counts, batch, boxes.cpu(), distances.cpu(), answer_ncc,
                                    answer_kind)

    look_again_extra = None
    if any(lk.template_bar is not None for lk in looks):
        def look_again_extra(picked: Tensor) -> Tensor:
            match_scales = torch.cat([c.match_scales if c.match_scales is not None else c.scales for c in calls])
            return template_windows(calls, counts, batch, match_scales, picked)

    extra_boxes = None
    if any(c.extra is not None for c in calls):  # calls of one key share max_instances
        extra_boxes = torch.cat([c.extra if c.extra is not None else torch.full((n, 4), torch.nan)
                                 for c, n in zip(calls, counts, strict=True)])
    results = first.localizer.localize_batch(batch, scales, prototypes, first.agent, deterministic=True,
                                             trajectory=any(c.trajectory for c in calls), samples=first.samples,
                                             nearest=first.nearest, max_instances=first.max_instances,
                                             look_again=look_again,
                                             look_again_instances=max((lk.candidates for lk in looks), default=1),
                                             look_again_extra=look_again_extra, extra_boxes=extra_boxes)
    features = read_ncc(calls, starts, counts, batch, scales, results, answer_ncc)
    kinds = read_kinds(calls, starts, counts, batch, scales, results, answer_kind)
    answers = []
    for c, at, n, f, kd in zip(calls, starts, counts, features, kinds, strict=True):  # per call: its answers
        mine = results[at:at + n]
        if not c.trajectory and mine and mine[0].trajectory is not None:
            mine = [Localization(r.box, r.score, None, r.instances) for r in mine]
        answers.append(LocalizeAnswer(mine, c.nearest, c.localizer.bundle.refine, ncc=f,
                                      looked=c.second_look is not None, kind=kd))
    return answers


class BatchedInference(LocalInference):
    """Runs calls on one engine thread, calls of several requests that fit together as one forward pass
    (``app.batching.Batcher``; the embedded default).

    The request thread checks and preprocesses its call (``prepare``), then waits for the engine, which runs
    every waiting call of the same bundle file, checkpoint and ``nearest`` (prototypes may differ) at once, up
    to ``max_batch_images``; an idle engine starts at once, or after ``window_s`` (see ``Batcher``). At most
    ``max_queue_images`` images wait: past that a call is refused with 503 and ``Retry-After`` at once.
    """

    def __init__(self, bundles: BundleRegistry, store: BlobStore, *, default_nearest: bool | None = None,
                 window_s: float = 0.0, max_batch_images: int = 64, max_queue_images: int = 256,
                 retry_after_s: int = 1, observe: Callable[[int, list[float]], None] | None = None,
                 gather_s: float = 0.0):
        super().__init__(bundles, store, default_nearest=default_nearest)
        self.retry_after_s = retry_after_s
        self.batcher: Batcher[Prepared, LocalizeAnswer] = Batcher(
            self.run_batch, window_s=window_s, max_batch=max_batch_images, max_queue=max_queue_images,
            name="qloc-localize", observe=observe, gather_s=gather_s)
        self._expected = threading.local()

    @contextmanager
    def expect(self) -> Iterator[Expected]:
        """This thread's request is on its way to the engine (``Batcher.expect``) until its first ``localize``
        submits it, or the block ends."""
        with self.batcher.expect() as expected:
            self._expected.pending = expected
            try:
                yield expected
            finally:
                self._expected.pending = None

    def run_batch(self, key: Hashable, calls: list[Prepared]) -> list[LocalizeAnswer]:
        """What the engine thread runs for one batch (a subclass may wrap it)."""
        return run_prepared(calls)

    def localize(self, call: LocalizeCall) -> LocalizeAnswer:
        key, prepared = self.prepare(call)
        try:
            future = self.batcher.submit(key, prepared, size=prepared.batch.shape[0],
                                         expected=getattr(self._expected, "pending", None))
        except QueueFull as e:
            raise InferenceRefused(
                status.HTTP_503_SERVICE_UNAVAILABLE,
                f"localize is busy: {self.batcher.waiting} images are waiting for the model, at most "
                f"{self.batcher.max_queue} may (QLOC_INFERENCE_QUEUE_IMAGES); retry after "
                f"{self.retry_after_s} s", headers={"Retry-After": str(self.retry_after_s)}) from e
        except BatcherClosed as e:
            raise InferenceRefused(status.HTTP_503_SERVICE_UNAVAILABLE, "the server is shutting down; retry",
                                   headers={"Retry-After": str(self.retry_after_s)}) from e
        return future.result()

    def close(self) -> None:
        """Stop the engine thread once the calls already waiting are answered."""
        self.batcher.close()
