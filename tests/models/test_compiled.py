"""The compiled episodes (``models.compiled``), one image's and a batch's: the eager episode's very boxes, and never a
compile on a call.

Two compiles for the module (a tiny bundle: 4 steps, ~10-30 s each on 2 cores), then every check against the eager
``steer`` of the same function.
"""

from __future__ import annotations

import logging
import sys
import time

import pytest
import torch

from models.bundle import new_bundle
from models.compiled import BATCHED_MAX, CompiledSteer, compiled_steer, warmed_steer
from models.config import AgentConfig, EnvConfig, HeadConfig, InputSpec, ModelConfig
from models.core import actions
from models.inference import Localizer, preprocess

S = 32


def tiny_localizer(seed: int = 0) -> Localizer:
    """A tiny bundle whose agent's weights make actions differ between images and steps."""
    cfg = ModelConfig(
        input=InputSpec(channels=1, size=S, mean=(0.1307,), std=(0.3081,), exemplar_size=12, fill=(0.0,)),
        head=HeadConfig(in_features=64 * 7 * 7, hidden=32, out_features=16, dropout=0.0),
        agent=AgentConfig(conv_channels=4, hidden=8, embed_dim=16),
        env=EnvConfig(steps=4, alpha=0.2, min_side=8.0, resize=0.2))
    bundle = new_bundle("tiny", cfg, 0)
    bundle.agent_state = lively(bundle.agent_state, seed)
    return Localizer(bundle, "cpu")


def lively(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * (3.0 / v[0].numel() ** 0.5 if v.dim() > 1 else 0.1)
            for k, v in state.items()}


@pytest.fixture(scope="module")
def warmed() -> tuple[Localizer, CompiledSteer, float]:
    loc = tiny_localizer()
    seconds = loc.compile_episode()
    return loc, compiled_steer(), seconds


def python_moves(fn) -> int:  # type: ignore[no-untyped-def]
    """How many times ``fn()`` ran ``apply_actions`` as Python: once per step eager, never in compiled code (a
    check that the compiled code ran, not an eager fallback)."""
    n = 0

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        nonlocal n
        n += event == "call" and frame.f_code is actions.apply_actions.__code__

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


def answers(loc: Localizer, images: list[torch.Tensor], proto: torch.Tensor, agent_seed: int):
    agent = loc.agent(lively(loc.bundle.agent_state, agent_seed))
    out = []
    for x in images:  # one image per call: the compiled shape
        batch, scales = preprocess([x], loc.spec)
        out.append(loc.localize_batch(batch, scales, proto, agent, trajectory=True)[0])
    return out


def test_a_compiled_episode_moves_the_boxes_the_eager_one_does_for_any_checkpoint(warmed, monkeypatch):
    loc, compiled, seconds = warmed
    assert seconds > 0 and warmed_steer() is compiled
    g = torch.Generator().manual_seed(1)
    images = [torch.rand(1, 40 + 7 * i, 36, generator=g) for i in range(6)]
    proto = torch.randn(16, generator=g)
    for agent_seed in (0, 1, 2):  # other checkpoints' weights: the same compiled code, no recompile
        before = compiled.calls
        fast = answers(loc, images, proto, agent_seed)
        assert compiled.calls == before + len(images)
        with monkeypatch.context() as m:
            m.setattr("models.inference.fast_steer", lambda device: None)  # the eager episode
            slow = answers(loc, images, proto, agent_seed)
        assert compiled.calls == before + len(images)
        assert [a.trajectory for a in fast] == [a.trajectory for a in slow]
        assert [a.score for a in fast] == pytest.approx([a.score for a in slow], rel=1e-6)
        assert len({a.box for a in fast}) > 1  # the images got different answers: the check can fail


def test_batches_of_2_to_15_run_their_own_compiled_code_the_rest_eager_and_nothing_compiles_on_a_call(
        warmed, monkeypatch):
    loc, compiled, _ = warmed
    g = torch.Generator().manual_seed(2)
    proto = torch.randn(16, generator=g)
    agent = loc.agent(lively(loc.bundle.agent_state, 1))
    steps = loc.bundle.config.env.steps
    for n, runs_compiled in ((2, True), (3, True), (BATCHED_MAX, True), (BATCHED_MAX + 1, False), (24, False)):
        batch, scales = preprocess([torch.rand(1, 32 + i % 9, 30, generator=g) for i in range(n)], loc.spec)
        before = compiled.calls
        start = time.perf_counter()
        fast = loc.localize_batch(batch, scales, proto, agent, trajectory=True)
        assert time.perf_counter() - start < 5  # a compile takes ~10 s or more
        assert compiled.calls == before + runs_compiled, n
        moved = python_moves(lambda: loc.localize_batch(batch, scales, proto, agent))  # noqa: B023 -- called here
        assert moved == (0 if runs_compiled else steps), n  # 0: the compiled code ran, not an eager fallback
        with monkeypatch.context() as m:
            m.setattr("models.inference.fast_steer", lambda device: None)  # the eager episode
            slow = loc.localize_batch(batch, scales, proto, agent, trajectory=True)
        assert [a.trajectory for a in fast] == [a.trajectory for a in slow], n
        assert len({a.box for a in fast}) > 1
    # one image at a time: the one-image code; the same boxes as in a batch
    batch, scales = preprocess([torch.rand(1, 32, 32, generator=g) for _ in range(3)], loc.spec)
    together = loc.localize_batch(batch, scales, proto, agent)
    one = [loc.localize_batch(batch[i:i + 1], scales[i:i + 1], proto, agent)[0] for i in range(3)]
    for a, b in zip(one, together, strict=True):
        assert a.box == pytest.approx(b.box, abs=1e-4)
    before = compiled.calls
    sampled = loc.localize_batch(batch[:1], scales[:1], proto, agent, deterministic=False, seed=3)
    assert compiled.calls == before and len(sampled) == 1  # sampled actions: eager


def test_warming_again_compiles_nothing(warmed):
    loc, compiled, _ = warmed
    assert loc.compile_episode() == 0.0


def test_the_cuda_graph_steerer_runs_eager_off_a_gpu():
    """``GraphedSteer`` (``fast_steer`` on CUDA) takes every episode it cannot replay eager: on the CPU the moves
    are ``steer``'s, and nothing is captured (its graphs are checked on a GPU: ``tests/models/test_cuda.py``)."""
    from models.compiled import GraphedSteer, fast_steer, graphed_steer
    from models.core.boxes import full_image_boxes
    from models.rollout import steer

    loc = tiny_localizer()
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        feats = loc.embedder.features(torch.rand(2, 1, 32, 32, generator=g))
        boxes = full_image_boxes(2, 32.0, 32.0)
        cfg, agent = loc.bundle.config.env, loc.agent()
        graphs = GraphedSteer()
        got = graphs(loc.embedder, agent, feats, boxes, cfg, (32.0, 32.0))
        want = steer(loc.embedder, agent, feats, boxes, cfg, (32.0, 32.0))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert graphs.calls == graphs.captures == 0
    assert fast_steer(torch.device("cuda")) is graphed_steer()
    assert fast_steer(torch.device("cpu")) is not graphed_steer()


def test_a_failed_batched_compile_keeps_the_one_image_code_and_warns(monkeypatch, caplog):
    warmed_for = []

    class Steer:
        def __init__(self, fail_at: int):
            self.fail_at = fail_at

        def warm(self, embedder, agent, feats, cfg, size):  # type: ignore[no-untyped-def]
            warmed_for.append(feats.shape[0])
            if feats.shape[0] >= self.fail_at:
                raise RuntimeError("not supported with a symbolic batch")
            return 2.5

    loc = tiny_localizer()
    monkeypatch.setattr("models.inference.compiled_steer", lambda: Steer(fail_at=2))
    with caplog.at_level(logging.WARNING, logger="models.inference"):
        assert loc.compile_episode() == 2.5  # the one image's compile stands
    assert warmed_for == [1, 2] and "batched episode was not compiled (batches run eager)" in caplog.text
    warmed_for.clear()
    assert loc.compile_episode(batches=False) == 2.5 and warmed_for == [1]
    monkeypatch.setattr("models.inference.compiled_steer", lambda: Steer(fail_at=1))
    with pytest.raises(RuntimeError, match="symbolic batch"):  # the one-image compile's failure is the caller's
        loc.compile_episode()
