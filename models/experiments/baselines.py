"""Baselines for the tables: ``ranking`` (dense candidates scored by embedding distance) and
``finetune`` (the agent tuned with the IoU reward on the exemplar images, whose boxes are known)."""

from __future__ import annotations

import torch
from torch import Tensor

from models.bundle import Bundle
from models.core.boxes import square_candidates
from models.data.types import LabeledImages
from models.policy import PolicyConfig, features_of, policy_step


def ranking_candidates(bundle: Bundle, per_side: int = 14) -> Tensor:
    """Dense squares for the ranking baseline: ``per_side`` positions and sizes per axis -> ``[K, 4]``."""
    size = bundle.config.input.size
    step = max(2, round(size / per_side))
    return square_candidates(size, int(bundle.config.env.min_side), int(size * 0.9), side_step=step, stride=step)


@torch.no_grad()
def ranking(bundle: Bundle, images01: Tensor, prototype: Tensor, candidates: Tensor | None = None,
            batch: int = 16, chunk: int = 2048) -> Tensor:
    """For each image ``[N, C, S, S]`` the candidate box nearest ``prototype [D]`` -> ``[N, 4]``.

    Every candidate costs one RoIAlign + head call on the cached feature map (the backbone runs once
    per image), so the default grid is coarser than stage 1's: a 6-pixel grid on an 84-pixel image.
    """
    cands = ranking_candidates(bundle) if candidates is None else candidates  # [K, 4]
    dev = next(bundle.embedder.parameters()).device
    cands, proto = cands.to(dev), prototype.to(dev)
    out = []
    for i in range(0, len(images01), batch):
        feats = features_of(bundle, images01[i:i + batch])  # [b, C, h, w]
        dists = torch.cat([(bundle.embedder.embed(feats, cands[j:j + chunk].expand(len(feats), -1, -1)) - proto)
                           .norm(dim=-1) for j in range(0, len(cands), chunk)], dim=1)  # [b, K]
        out.append(cands[dists.argmin(dim=1)].cpu())
    return torch.cat(out)


def finetune(bundle: Bundle, exemplars: LabeledImages, prototype: Tensor, iterations: int = 100,
             cfg: PolicyConfig | None = None, seed: int = 0) -> dict[str, Tensor]:
    """The base policy tuned with the IoU reward on the exemplar images -> agent state dict."""
    cfg = cfg or PolicyConfig(reward="iou")
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    agent = bundle.new_agent()
    opt = torch.optim.Adam(agent.parameters(), lr=cfg.lr)
    dev = next(bundle.embedder.parameters()).device
    feats = features_of(bundle, exemplars.images)
    gt = exemplars.boxes.to(dev)
    protos = prototype.to(dev).expand(len(feats), -1)
    for _ in range(iterations):
        policy_step(bundle, agent, opt, feats, protos, cfg, gen, gt)
    return {k: v.detach().cpu() for k, v in agent.state_dict().items()}
