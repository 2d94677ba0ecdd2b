"""Stage 2: train the agent with the frozen embedder.

Each iteration takes the training images (all, or a random minibatch) and splits them into groups of
``group_size``; every image is localized with the prototype of exemplar crops from a *different*
group, as at test time. Features come from the backbone once for the whole stage, or from
``LabeledImages.feats``. The best iteration is chosen by CorLoc on the validation split, never on test.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from models.bundle import Bundle
from models.core.ordinal import group_prototypes
from models.core.seeding import seeded
from models.data.types import LabeledImages
from models.evaluate import evaluate_corloc
from models.features import crop_embeddings, features_of, prototypes_for
from models.nets.agent import Agent
from models.policy import PolicyConfig, policy_step


@dataclass
class AgentTrainConfig(PolicyConfig):
    iterations: int = 400
    group_size: int = 5
    batch_size: int | None = None
    """Training images per iteration, a random subset; ``None``: all of them every iteration."""
    eval_every: int = 25
    seed: int = 0


def train_agent(bundle: Bundle, train: LabeledImages, val: LabeledImages, val_exemplars: LabeledImages,
                cfg: AgentTrainConfig, on_log: Callable[[dict], None] | None = None) -> dict:
    """Train the bundle's base policy (best validation state kept in ``bundle.agent_state``) -> summary.

    Validation CorLoc uses the prototype of ``val_exemplars``' crops (of each image's own kind, for data of several
    kinds: ``LabeledImages.classes``, where each iteration trains on one kind)."""
    dev = bundle.device
    with seeded(cfg.seed, dev):  # the agent's initial weights draw from torch's global generator
        gen = torch.Generator().manual_seed(cfg.seed)
        agent = Agent(bundle.config.agent).to(dev)
        opt = torch.optim.Adam(agent.parameters(), lr=cfg.lr)
        feats = train.feats if train.feats is not None else features_of(bundle, train.images)
        crop_emb = crop_embeddings(bundle, train)  # [N, D]
        val_proto = prototypes_for(bundle, val_exemplars, val)
        gt = train.boxes.to(dev) if cfg.reward != "embedding" else None
        bs = None if cfg.batch_size is None else min(cfg.batch_size, len(train))
        best: tuple[float, dict | None, int] = (-1.0, None, 0)
        history = []
        for it in range(1, cfg.iterations + 1):
            if train.classes is not None:  # several kinds: one kind per iteration, drawn by its share of the data
                kind = train.classes[int(torch.randint(len(train), (1,), generator=gen))]
                pool = (train.classes == kind).nonzero().flatten()
                idx = pool[torch.randperm(len(pool), generator=gen)[:bs or len(pool)]]
                f, e = feats[idx.to(feats.device)], crop_emb[idx.to(crop_emb.device)]
                g = None if gt is None else gt[idx]
            elif bs is None:
                f, e, g = feats, crop_emb, gt
            else:
                idx = torch.randperm(len(train), generator=gen)[:bs]
                f, e = feats[idx.to(feats.device)], crop_emb[idx.to(crop_emb.device)]
                g = None if gt is None else gt[idx]
            protos = group_prototypes(e, cfg.group_size, shuffle=True, generator=gen)
            stats = policy_step(bundle, agent, opt, f, protos, cfg, gen, g)
            if it % cfg.eval_every == 0 or it == cfg.iterations:
                val_corloc, _ = evaluate_corloc(bundle, agent, val, val_proto)
                rec = {"iteration": it, **stats, "val/corloc": val_corloc}
                history.append(rec)
                if on_log:
                    on_log(rec)
                if val_corloc > best[0]:
                    best = (val_corloc, copy.deepcopy(agent.state_dict()), it)
    bundle.agent_state = {k: v.detach().cpu().clone() for k, v in best[1].items()}
    return {"val/corloc": best[0], "best_iteration": best[2], "history": history}
