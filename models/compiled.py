"""One image's greedy moves compiled with ``torch.compile``: the latency path of a one-image request.

At batch 1 an episode step is some forty small tensor operations (RoIAlign, the agent's conv and GRU
cell, the action lookup), and eager PyTorch spends most of an episode dispatching them: ten steps took
~5-7 ms on a 2-core VM where inductor's fused C++ kernels take ~2 ms, with the same boxes
(``tests/models/test_compiled.py``). ``models.rollout.steer`` is what gets compiled, so the compiled
episode and the eager one are one function.

Compiling costs tens of seconds on a small CPU (a few from inductor's on-disk cache,
``TORCHINDUCTOR_CACHE_DIR``), so it is never done on a request: ``CompiledSteer.warm`` compiles ahead for one
feature-map shape and configuration (a server runs it on a background thread), and ``CompiledSteer`` is
called like ``steer``: an episode it was warmed for runs compiled, any other runs eager, and nothing it is
called with compiles anything (``torch._dynamo.run``: compiled code already made, or eager). The compiled
graph takes the agent's and the embedder's weights as inputs, so every checkpoint of a bundle shares it.
"""

from __future__ import annotations

import threading
import time
import warnings

import torch
from torch import Tensor

from models.config import EnvConfig
from models.core.boxes import full_image_boxes
from models.nets.agent import Agent
from models.nets.embedding import RoIEmbedder
from models.rollout import steer


def _key(embedder: RoIEmbedder, agent: Agent, feats: Tensor, boxes: Tensor, cfg: EnvConfig,
         size: tuple[float, float], deterministic: object, generator: object) -> tuple | None:
    """What a compiled episode was made for (``None``: never compiled: sampled actions)."""
    if deterministic is not True or generator is not None:
        return None
    return (tuple(feats.shape), feats.stride(), feats.dtype, feats.device.type, tuple(boxes.shape), boxes.stride(),
            repr(cfg), (float(size[0]), float(size[1])), repr(agent.cfg), repr(embedder.roi_cfg),
            torch.is_inference_mode_enabled())


class CompiledSteer:
    """``models.rollout.steer`` as compiled code for the episodes ``warm`` compiled, eager for every other.

    Thread-safe: ``warm`` may run on one thread while requests call it on another (an episode runs
    compiled only once its warm-up has finished)."""

    def __init__(self) -> None:
        self._compiled = torch.compile(steer, dynamic=False, fullgraph=True)
        self._run = torch._dynamo.run(self._compiled)  # compiled code already made, else eager: never compiles
        self._ready: set[tuple] = set()
        self._lock = threading.Lock()
        self.calls = 0
        """Episodes run compiled so far."""

    def ready(self, key: tuple | None) -> bool:
        return key is not None and key in self._ready

    def warm(self, embedder: RoIEmbedder, agent: Agent, feats: Tensor, cfg: EnvConfig,
             size: tuple[float, float]) -> float:
        """Compile the greedy episode from the whole image for feature maps shaped like ``feats [B, C, h, w]``
        (under inference mode, as a server calls it) -> seconds it took; raises what compiling raised (no
        C++ compiler, an unsupported operation), leaving that episode eager."""
        with torch.inference_mode():
            boxes = full_image_boxes(feats.shape[0], size[0], size[1], device=feats.device)
            key = _key(embedder, agent, feats, boxes, cfg, size, True, None)
            if self.ready(key):
                return 0.0
            start = time.perf_counter()
            # One compile at a time (inductor's state is process-wide), in this thread (no pool of compile
            # processes beside a server's).
            with self._lock, torch._inductor.config.patch(compile_threads=1), warnings.catch_warnings():
                # The RoI index's lru_cache is traced through: its value is a constant of the compiled shape.
                warnings.filterwarnings("ignore", message=".*lru_cache", category=UserWarning)
                # The eager episode first: it fills the module-level caches the episode reads (the action tables),
                # or the compiled code would be guarded on their being empty.
                slow = steer(embedder, agent, feats, boxes, cfg, size, True, None)
                fast = self._compiled(embedder, agent, feats, boxes, cfg, size, True, None)
                if not torch.equal(fast[0], slow[0]):  # never seen; a compiler that moves boxes is not used
                    raise RuntimeError("the compiled episode's boxes differ from the eager episode's")
                self._ready.add(key)
            return time.perf_counter() - start

    def __call__(self, embedder: RoIEmbedder, agent: Agent, feats: Tensor, boxes: Tensor, cfg: EnvConfig,
                 size: tuple[float, float], deterministic: bool | Tensor = True,
                 generator: torch.Generator | None = None) -> tuple[Tensor, Tensor, Tensor]:
        if self.ready(_key(embedder, agent, feats, boxes, cfg, size, deterministic, generator)):
            self.calls += 1
            return self._run(embedder, agent, feats, boxes, cfg, size, deterministic, generator)
        return steer(embedder, agent, feats, boxes, cfg, size, deterministic, generator)


_STEER: CompiledSteer | None = None
_STEER_LOCK = threading.Lock()


def compiled_steer() -> CompiledSteer:
    """The process's one ``CompiledSteer`` (compiled code is per process; one instance shares its warm-ups)."""
    global _STEER
    with _STEER_LOCK:
        if _STEER is None:
            _STEER = CompiledSteer()
        return _STEER


def warmed_steer() -> CompiledSteer | None:
    """The process's ``CompiledSteer`` once something has been compiled, else ``None`` (eager, at no cost)."""
    steer_ = _STEER
    return steer_ if steer_ is not None and steer_._ready else None
