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

``warm`` on a batch of two or more compiles the episode once for batches of 2 to ``BATCHED_MAX`` images (the batch
dimension symbolic: ``torch._dynamo.mark_dynamic``), what a server's engine runs when concurrent requests share a
forward pass: 1.5-1.8x faster than eager at batches of 2-8 on a 2-core VM, the same boxes. Larger batches run eager:
torch picks another convolution backend from 16 images up (the compiled code is guarded to fewer), and there the
operations' own arithmetic dominates (compiled was no faster at 16 and 32). One image keeps its own code,
specialized to batch 1 (the fastest for one client's latency).

On a GPU the same episode is launch-bound at every batch size a server runs (ten steps of small kernels, each
launched from Python): ``GraphedSteer`` captures it as a CUDA graph instead, per agent and batch bucket, on
its first greedy call (milliseconds, no compiler), and replays it: one launch per episode.
"""

from __future__ import annotations

import itertools
import threading
import time
import warnings
import weakref
from collections import OrderedDict

import torch
from torch import Tensor

from models.config import EnvConfig
from models.core.boxes import full_image_boxes
from models.nets.agent import Agent
from models.nets.embedding import RoIEmbedder
from models.rollout import Steer, steer

BATCHED_MAX = 15
"""The largest batch the batched episode's code runs (its guard: torch 2.14's CPU convolution picks its backend
by the batch, 16 images and up another one)."""


def _key(embedder: RoIEmbedder, agent: Agent, feats: Tensor, boxes: Tensor, cfg: EnvConfig,
         size: tuple[float, float], deterministic: object, generator: object) -> tuple | None:
    """What a compiled episode was made for (``None``: never compiled: sampled actions, several boxes per image,
    more than ``BATCHED_MAX`` images). Its first item is the batch: 1, or ``"2+"`` for the code compiled with a
    symbolic batch (2 to ``BATCHED_MAX`` images)."""
    if deterministic is not True or generator is not None:
        return None
    b = feats.shape[0]
    if not 1 <= b <= BATCHED_MAX or boxes.shape[0] != b or not feats.is_contiguous():
        return None
    return (1 if b == 1 else "2+", tuple(feats.shape[1:]), feats.dtype, feats.device.type, tuple(boxes.shape[1:]),
            boxes.stride(), repr(cfg), (float(size[0]), float(size[1])), repr(agent.cfg), repr(embedder.roi_cfg),
            torch.is_inference_mode_enabled())


class CompiledSteer:
    """``models.rollout.steer`` as compiled code for the episodes ``warm`` compiled, eager for every other.

    Thread-safe: ``warm`` may run on one thread while requests call it on another (an episode runs
    compiled only once its warm-up has finished)."""

    def __init__(self) -> None:
        self._compiled = torch.compile(steer, dynamic=False, fullgraph=True)
        # Batches of 2 to BATCHED_MAX: compiled with the batch dimension marked dynamic (``dynamic=None`` honours
        # the mark; ``False`` would specialize it). Both share ``steer``'s code cache, whose guards pick the code
        # made for a call's batch.
        self._batched = torch.compile(steer, dynamic=None, fullgraph=True)
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
        (under inference mode, as a server calls it): for one image if ``B`` is 1, else for every batch of 2 to
        ``BATCHED_MAX`` images -> seconds it took; raises what compiling raised (no C++ compiler, an unsupported
        operation), leaving that episode eager."""
        with torch.inference_mode():
            feats = feats.contiguous()
            boxes = full_image_boxes(feats.shape[0], size[0], size[1], device=feats.device)
            key = _key(embedder, agent, feats, boxes, cfg, size, True, None)
            if key is None:
                raise ValueError(f"an episode is compiled for 1 to {BATCHED_MAX} images, one box per image")
            if self.ready(key):
                return 0.0
            compiled = self._compiled
            if feats.shape[0] > 1:
                feats, boxes, compiled = feats.clone(), boxes.clone(), self._batched
                torch._dynamo.mark_dynamic(feats, 0)
                torch._dynamo.mark_dynamic(boxes, 0)
            start = time.perf_counter()
            # One compile at a time (inductor's state is process-wide), in this thread (no pool of compile
            # processes beside a server's).
            with self._lock, torch._inductor.config.patch(compile_threads=1), warnings.catch_warnings():
                # The RoI index's lru_cache is traced through: its value is a constant of the compiled shape.
                warnings.filterwarnings("ignore", message=".*lru_cache", category=UserWarning)
                # The eager episode first: it fills the module-level caches the episode reads (the action tables),
                # or the compiled code would be guarded on their being empty.
                slow = steer(embedder, agent, feats, boxes, cfg, size, True, None)
                fast = compiled(embedder, agent, feats, boxes, cfg, size, True, None)
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


class _Graph:
    """One captured episode: static inputs, the CUDA graph, and its static outputs."""

    def __init__(self, embedder: RoIEmbedder, agent: Agent, feats: Tensor, boxes: Tensor, cfg: EnvConfig,
                 size: tuple[float, float]):
        """``feats`` and ``boxes`` (tensors of its own, a full bucket) become the graph's static inputs."""
        self.feats, self.boxes = feats, boxes
        side = torch.cuda.Stream(feats.device)
        side.wait_stream(torch.cuda.current_stream(feats.device))
        with torch.cuda.stream(side):  # the eager episode first: fills the caches it reads, outside the capture
            for _ in range(2):
                steer(embedder, agent, self.feats, self.boxes, cfg, size, True, None)
        torch.cuda.current_stream(feats.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: request threads may run other CUDA work meanwhile
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.out = steer(embedder, agent, self.feats, self.boxes, cfg, size, True, None)

    def __call__(self, feats: Tensor, boxes: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, n = feats.shape[0], boxes.shape[0]
        self.feats[:b].copy_(feats)  # rows past ``b`` keep what they held: their episodes are not returned
        self.boxes[:n].copy_(boxes)
        self.graph.replay()
        return tuple(o[:, :n].clone() for o in self.out)  # type: ignore[return-value]


class GraphedSteer:
    """``models.rollout.steer`` on CUDA as a replayed CUDA graph: greedy episodes of up to ``max_batch`` images
    by an agent in eval mode run as one launch; any other episode (CPU, sampled, larger, under autograd, an agent
    in training mode: dropout) runs eager.

    A graph is captured on the first greedy call for its agent, feature shape and batch bucket (batches are
    padded to the next power of two: at most ``log2(max_batch) + 1`` graphs per agent and shape), and reads
    the agent's weights where they lie: it is keyed by their addresses (moved or replaced weights capture
    anew) and dropped with its agent. Replays are serialized (one set of static buffers per graph)."""

    def __init__(self, max_batch: int = 64, max_graphs: int = 64):
        self.max_batch, self.max_graphs = max_batch, max_graphs
        self._graphs: weakref.WeakKeyDictionary[Agent, OrderedDict[tuple, _Graph]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self.calls = 0
        """Episodes replayed so far."""
        self.captures = 0
        """Graphs captured so far."""

    def __call__(self, embedder: RoIEmbedder, agent: Agent, feats: Tensor, boxes: Tensor, cfg: EnvConfig,
                 size: tuple[float, float], deterministic: bool | Tensor = True,
                 generator: torch.Generator | None = None) -> tuple[Tensor, Tensor, Tensor]:
        b = feats.shape[0]
        if (deterministic is not True or generator is not None or not feats.is_cuda or b > self.max_batch
                or agent.training or torch.is_grad_enabled() or torch.cuda.is_current_stream_capturing()):
            return steer(embedder, agent, feats, boxes, cfg, size, deterministic, generator)
        bucket = 1 << (b - 1).bit_length()
        episodes = boxes.shape[0] // b
        weights = tuple(t.data_ptr() for t in itertools.chain(agent.parameters(), agent.buffers()))
        key = (bucket, episodes, tuple(feats.shape[1:]), feats.dtype, feats.device, repr(cfg),
               (float(size[0]), float(size[1])), repr(agent.cfg), repr(embedder.roi_cfg), weights,
               torch.is_inference_mode_enabled())
        with self._lock:
            graphs = self._graphs.setdefault(agent, OrderedDict())
            graph = graphs.get(key)
            if graph is None:
                pad = bucket - b
                graph = _Graph(embedder, agent, torch.cat([feats, feats[:1].expand(pad, *feats.shape[1:])]),
                               torch.cat([boxes, boxes[:1].expand(pad * episodes, 4)]), cfg, size)  # new tensors
                graphs[key] = graph
                self.captures += 1
                while len(graphs) > self.max_graphs:
                    graphs.popitem(last=False)
            else:
                graphs.move_to_end(key)
            self.calls += 1
            return graph(feats, boxes)


_GRAPHED = GraphedSteer()  # nothing to build until a GPU episode comes


def graphed_steer() -> GraphedSteer:
    """The process's one ``GraphedSteer``."""
    return _GRAPHED


def fast_steer(device: torch.device) -> Steer | None:
    """The quickest ready ``steer`` for episodes on ``device``: ``graphed_steer()`` on CUDA, the warmed
    ``CompiledSteer`` elsewhere (``None``: plain eager)."""
    return graphed_steer() if device.type == "cuda" else warmed_steer()
