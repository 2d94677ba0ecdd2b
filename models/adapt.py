"""Stage 3: test-time policy adaptation on unlabeled images.

Only the agent learns; the embedder stays frozen and the reward is the decrease of the embedding
distance to the prototype of the client's exemplar crops, so no box is needed. Progress and
checkpoint hooks let a worker report progress, save, resume after a crash and honour a cancel.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from models.bundle import Bundle
from models.features import features_of
from models.inference import resolve_device
from models.policy import PolicyConfig, policy_step
from models.rollout import Scorer


@dataclass
class AdaptConfig(PolicyConfig):
    iterations: int = 200
    batch_size: int = 32
    seed: int = 0
    checkpoint_every: int = 25
    """``on_checkpoint`` is called every this many iterations, and at the end."""
    cache_bytes: int = 1 << 30
    """Backbone features of all images are computed once when they fit in this many bytes."""


class AdaptResult(NamedTuple):
    agent_state: dict[str, Tensor]
    iteration: int
    mean_reward: float
    stopped: bool


def adapt(bundle: Bundle, prototype: Tensor, images01: Tensor, cfg: AdaptConfig, *,
          agent_state: dict[str, Tensor] | None = None, resume: dict[str, Any] | None = None,
          on_progress: Callable[[int, int, float], None] | None = None,
          on_checkpoint: Callable[[dict[str, Any]], None] | None = None,
          should_stop: Callable[[], bool] | None = None, device: str | torch.device = "auto",
          scorer: Scorer | None = None) -> AdaptResult:
    """Adapt the policy to ``images01 [N, C, S, S]`` (input size, [0, 1]) with ``prototype [D]``.

    ``resume`` is a state an earlier run passed to ``on_checkpoint``; the run continues from its
    iteration with the same agent, optimizer and random state. ``should_stop`` is checked before
    every iteration (cancel); a stopped run still returns its current agent.
    ``scorer`` (``models.repair``): the distance the reward is made of, when not the embedding distance to
    ``prototype`` (a reward chosen on the job's probes); one that needs pixels gets each batch's images.
    """
    if images01.dim() != 4 or images01.shape[1] != bundle.config.input.channels:
        raise ValueError(f"images must be [N, {bundle.config.input.channels}, S, S]; got {tuple(images01.shape)}")
    if len(images01) == 0:
        raise ValueError("adaptation needs at least one unlabeled image")
    dev = resolve_device(device) if isinstance(device, str) else device
    bundle.to(dev).embedder.eval()
    agent = bundle.new_agent(agent_state).to(dev)
    reference = None
    if cfg.kl_coef > 0:  # the trust region: the policy the adaptation starts from, frozen
        reference = bundle.new_agent(agent_state).to(dev).eval()
        reference.requires_grad_(False)
    opt = torch.optim.Adam(agent.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    start = 0
    if resume is not None:
        agent.load_state_dict(resume["agent"])
        opt.load_state_dict(resume["optimizer"])
        gen.set_state(resume["rng"])
        start = int(resume["iteration"])
    proto = prototype.to(dev).float()
    n = len(images01)
    per_image = bundle.embedder.features(torch.zeros(1, *images01.shape[1:], device=dev)).numel() * 4
    cached = features_of(bundle, images01) if per_image * n <= cfg.cache_bytes else None
    rewards: list[float] = []
    it = start

    def state() -> dict[str, Any]:
        return {"iteration": it, "agent": {k: v.detach().cpu().clone() for k, v in agent.state_dict().items()},
                "optimizer": copy.deepcopy(opt.state_dict()), "rng": gen.get_state()}  # a snapshot, not a view

    stopped = False
    while it < cfg.iterations:
        if should_stop is not None and should_stop():
            stopped = True
            break
        idx = torch.randperm(n, generator=gen)[:cfg.batch_size]
        feats = cached[idx.to(cached.device)] if cached is not None else features_of(bundle, images01[idx])
        chosen = {}  # the embedding distance (default): policy_step called as it always was
        if scorer is not None:  # a reward chosen on the probes; the pixels only for a scorer that reads them
            chosen = {"scorer": scorer, "images01": images01[idx].to(dev) if scorer.pixels else None}
        stats = policy_step(bundle, agent, opt, feats, proto.expand(len(idx), -1), cfg, gen, reference=reference,
                            **chosen)
        it += 1
        rewards.append(stats["charts/return"])
        if on_progress is not None:
            on_progress(it, cfg.iterations, stats["charts/return"])
        if on_checkpoint is not None and (it % cfg.checkpoint_every == 0 or it == cfg.iterations):
            on_checkpoint(state())
    recent = rewards[-max(1, cfg.checkpoint_every):]
    mean_reward = sum(recent) / len(recent) if recent else 0.0
    return AdaptResult(state()["agent"], it, mean_reward, stopped)
