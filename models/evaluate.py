"""Metrics of a bundle on labeled images: CorLoc of an agent, OrdAcc of the embedding."""

from __future__ import annotations

import torch
from torch import Tensor

from models.bundle import Bundle
from models.core.boxes import square_candidates
from models.core.metrics import corloc
from models.core.ordinal import anchors_for, ordinal_accuracy, sample_pairs
from models.data.types import LabeledImages
from models.inference import Localizer, normalize
from models.nets.agent import Agent


def candidate_boxes(bundle: Bundle) -> Tensor:
    """Dense square candidates for pair sampling: sides from the minimum box side to ~0.9 x image."""
    size = bundle.config.input.size
    lo = int(bundle.config.env.min_side)
    step = max(2, size // 21)
    return square_candidates(size, lo, int(size * 0.9), side_step=step, stride=step)


@torch.no_grad()
def evaluate_ordacc(bundle: Bundle, data: LabeledImages, anchor: str = "proto", group_size: int = 5,
                    pairs: int = 32, seed: int = 0, batch: int = 100) -> float:
    """OrdAcc (%) on ``data``: ``inst`` anchors on each image's own ground truth, ``proto`` on the
    prototype of a *different* group of ``group_size`` images (as at test time)."""
    return ordacc_all(bundle, data, (anchor,), group_size, pairs, seed, batch)[anchor]


@torch.no_grad()
def ordacc_all(bundle: Bundle, data: LabeledImages, anchors: tuple[str, ...] = ("proto", "inst"),
               group_size: int = 5, pairs: int = 32, seed: int = 0, batch: int = 100) -> dict[str, float]:
    """OrdAcc (%) for several anchors from one pass over ``data`` -> ``{anchor: ordacc}``."""
    emb = bundle.embedder.eval()
    gen = torch.Generator().manual_seed(seed)
    dev = next(emb.parameters()).device
    cands = candidate_boxes(bundle)
    gts, poss, negs = [], [], []
    for i in range(0, len(data.images), batch):
        x = normalize(data.images[i:i + batch].to(dev), bundle.config.input)
        gt = data.boxes[i:i + batch]
        p = sample_pairs(gt, cands, pairs, generator=gen)
        out = emb.embed(emb.features(x), torch.cat([gt[:, None], p.pos, p.neg], 1).to(dev))  # [b, 1+2P, D]
        gts.append(out[:, 0])
        poss.append(out[:, 1:1 + pairs])
        negs.append(out[:, 1 + pairs:])
    gt_emb, pos, neg = torch.cat(gts), torch.cat(poss), torch.cat(negs)
    result = {}
    for anchor in anchors:
        if anchor not in ("proto", "inst"):
            raise ValueError(f"OrdAcc anchor must be 'proto' or 'inst', got {anchor!r}")
        a = gt_emb if anchor == "inst" else anchors_for("shuffle_proto", gt_emb, group_size, gen)
        result[anchor] = float(ordinal_accuracy(a, pos, neg))
    return result


@torch.no_grad()
def evaluate_corloc(bundle: Bundle, agent: Agent, data: LabeledImages, prototype: Tensor,
                    deterministic: bool = True, seed: int = 0, batch: int = 256, samples: int = 0,
                    nearest: bool = False) -> tuple[float, Tensor]:
    """CorLoc (%) of ``agent`` on ``data`` with one shared ``prototype [D]`` -> (corloc, boxes ``[N, 4]``).

    ``samples > 0``: the best-of-(1 + samples) search of ``Localizer.run`` (greedy episode included);
    ``nearest``: the visited box nearest the prototype is the answer (``Localizer.run``)."""
    loc = Localizer(bundle, device=next(bundle.embedder.parameters()).device)
    agent.eval()
    if samples > 0:
        gen = torch.Generator().manual_seed(seed)
    else:
        gen = None if deterministic else torch.Generator(device=loc.device).manual_seed(seed)
    boxes = torch.cat([loc.run(data.images[i:i + batch], prototype, agent, deterministic=deterministic,
                               generator=gen, samples=samples, nearest=nearest).boxes[-1].cpu()
                       for i in range(0, len(data.images), batch)])
    return corloc(boxes, data.boxes), boxes

