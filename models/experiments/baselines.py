"""The fine-tune baseline of the tables: the agent tuned with the IoU reward on the exemplar images,
whose boxes are known. (The ranking baseline is ``models.evaluate.ranking``.)"""

from __future__ import annotations

import torch
from torch import Tensor

from models.bundle import Bundle
from models.core.seeding import seeded
from models.data.types import LabeledImages
from models.features import features_of
from models.policy import PolicyConfig, policy_step


def finetune(bundle: Bundle, exemplars: LabeledImages, prototype: Tensor, iterations: int = 100,
             cfg: PolicyConfig | None = None, seed: int = 0) -> dict[str, Tensor]:
    """The base policy tuned with the IoU reward on the exemplar images -> agent state dict."""
    cfg = cfg or PolicyConfig(reward="iou")
    dev = bundle.device
    gen = torch.Generator().manual_seed(seed)
    with seeded(seed, dev):
        agent = bundle.new_agent()
        opt = torch.optim.Adam(agent.parameters(), lr=cfg.lr)
        feats = exemplars.feats if exemplars.feats is not None else features_of(bundle, exemplars.images)
        gt = exemplars.boxes.to(dev)
        protos = prototype.to(dev).expand(len(feats), -1)
        for _ in range(iterations):
            policy_step(bundle, agent, opt, feats, protos, cfg, gen, gt)
    return {k: v.detach().cpu() for k, v in agent.state_dict().items()}
