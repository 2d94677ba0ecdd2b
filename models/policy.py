"""The policy-gradient step shared by stage 2 (training), stage 3 (adaptation) and the fine-tune baseline."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from models.bundle import Bundle
from models.core.reinforce import reinforce_loss
from models.nets.agent import Agent
from models.rollout import Scorer, rollout


@dataclass
class PolicyConfig:
    """The REINFORCE settings shared by stage 2, stage 3 and the fine-tune baseline."""

    lr: float = 1e-3
    gamma: float = 0.99
    entropy_coef: float = 0.5
    normalize_advantages: bool = True
    reward: str = "embedding"
    """"embedding" (the paper's transferable reward), or the baselines "iou" / "iou_sign" (need boxes)."""
    kl_coef: float = 0.0
    """Weight of KL(policy || reference policy) per step (adaptation: the starting policy); 0 = off."""
    episodes: int = 1
    """Sampled episodes per image and step, on the image's one feature map; > 1 gives each episode
    the mean return of its image's other episodes as baseline (see ``reinforce_loss``)."""


def policy_step(bundle: Bundle, agent: Agent, opt: torch.optim.Optimizer, feats: Tensor, prototypes: Tensor,
                cfg: PolicyConfig, generator: torch.Generator | None = None, gt_boxes: Tensor | None = None,
                reference: Agent | None = None, scorer: Scorer | None = None, images01: Tensor | None = None) -> dict:
    """One sampled episode on ``feats [B, C, h, w]`` and one Adam step on the agent -> stats.

    With ``reference`` and ``cfg.kl_coef > 0`` the loss adds ``kl_coef`` x the mean per-step
    KL(agent || reference) at the visited states. ``scorer`` (``models.repair``; default the embedding distance)
    gives the ``"embedding"`` reward's distance; ``images01 [B, C, S, S]``: the pixels, for a scorer that needs them."""
    agent.train()
    s = float(bundle.config.input.size)
    ref = reference if cfg.kl_coef > 0 else None
    ro = rollout(bundle.embedder, agent, feats, prototypes, bundle.config.env, (s, s), deterministic=False,
                 generator=generator, reward=cfg.reward, gt_boxes=gt_boxes, reference=ref, episodes=cfg.episodes,
                 scorer=scorer, images01=images01)
    out = reinforce_loss(ro.log_probs, ro.entropies, ro.rewards, cfg.gamma, cfg.entropy_coef,
                         cfg.normalize_advantages, cfg.episodes)
    loss = out.loss
    stats = {}
    if ro.kl is not None:
        kl = ro.kl.mean()
        loss = loss + cfg.kl_coef * kl
        stats["losses/kl"] = float(kl.detach())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return {"losses/policy": float(out.policy.detach()), "losses/entropy": float(out.entropy.detach()),
            "charts/return": float(out.mean_return), "charts/final_distance": float(ro.distances[-1].mean()),
            **stats}


