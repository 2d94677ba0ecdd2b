"""Stage 2: train the agent with the frozen embedder; also the shared policy-gradient step.

Each iteration splits the training images into groups of ``group_size``; every image is localized
with the prototype of exemplar crops from a *different* group, as at test time. The best
iteration is chosen by CorLoc on the validation split, never on test.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from models.bundle import Bundle
from models.core.ordinal import group_prototypes
from models.data.types import LabeledImages, exemplar_crops
from models.evaluate import evaluate_corloc
from models.inference import Localizer
from models.nets.agent import Agent
from models.policy import PolicyConfig, features_of, policy_step


@dataclass
class AgentTrainConfig(PolicyConfig):
    iterations: int = 400
    group_size: int = 5
    eval_every: int = 25
    seed: int = 0


def train_agent(bundle: Bundle, train: LabeledImages, val: LabeledImages, val_exemplars: LabeledImages,
                cfg: AgentTrainConfig, on_log: Callable[[dict], None] | None = None) -> dict:
    """Train the bundle's base policy (best validation state kept in ``bundle.agent_state``) -> summary."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    loc = Localizer(bundle, device=next(bundle.embedder.parameters()).device)
    agent = Agent(bundle.config.agent).to(loc.device)
    opt = torch.optim.Adam(agent.parameters(), lr=cfg.lr)
    feats = features_of(bundle, train.images)  # frozen backbone: once for the whole stage
    crop_emb = loc.embed_crops(exemplar_crops(train))  # [N, D]
    val_proto = loc.prototype(exemplar_crops(val_exemplars))
    gt = train.boxes.to(loc.device) if cfg.reward != "embedding" else None
    best = (-1.0, None, 0)
    history = []
    for it in range(1, cfg.iterations + 1):
        protos = group_prototypes(crop_emb, cfg.group_size, shuffle=True, generator=gen)
        stats = policy_step(bundle, agent, opt, feats, protos, cfg, gen, gt)
        if it % cfg.eval_every == 0 or it == cfg.iterations:
            val_corloc, _ = evaluate_corloc(bundle, agent, val, val_proto)
            rec = {"iteration": it, **stats, "val/corloc": val_corloc}
            history.append(rec)
            if on_log:
                on_log(rec)
            if val_corloc > best[0]:
                best = (val_corloc, copy.deepcopy(agent.state_dict()), it)
    bundle.agent_state = {k: v.cpu() for k, v in best[1].items()}
    return {"val/corloc": best[0], "best_iteration": best[2], "history": history}
