"""Metrics of a bundle on labeled images -- how well the embedding orders boxes (OrdAcc, Spearman) and
how often an agent finds the object (CorLoc) -- and the ranking baseline. Each runs the backbone on the
images, or uses the features a frozen backbone computed once (``LabeledImages.feats``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from models.bundle import Bundle
from models.core.boxes import candidate_boxes
from models.core.metrics import corloc, spearman
from models.core.ordinal import anchors_for, ordinal_accuracy, sample_pairs
from models.data.types import LabeledImages
from models.features import features_of
from models.inference import Localizer, normalize
from models.nets.agent import Agent


def training_candidates(bundle: Bundle) -> Tensor:
    """Dense squares for stage 1's pairs and OrdAcc: sides from the minimum box side to ~0.9 x image."""
    size = bundle.config.input.size
    step = max(2, size // 21)
    return candidate_boxes(size, int(bundle.config.env.min_side), int(size * 0.9), side_step=step, stride=step)


def ranking_candidates(bundle: Bundle, per_side: int = 14) -> Tensor:
    """Dense squares for the ranking baseline: ``per_side`` positions and sizes per axis -> ``[K, 4]``."""
    size = bundle.config.input.size
    step = max(2, round(size / per_side))
    return candidate_boxes(size, int(bundle.config.env.min_side), int(size * 0.9), side_step=step, stride=step)


def rect_candidates(bundle: Bundle, sides: int = 10, stride: int | None = None) -> Tensor:
    """Rectangles (aspect up to 2.5) in ``sides`` geometric steps, for photos: squares alone cannot reach
    a high IoU with a 2:1 object, which would cripple pair sampling and the ranking baseline."""
    c = bundle.config
    return candidate_boxes(c.input.size, c.env.min_side, sides=sides, stride=stride, max_aspect=2.5, min_fraction=0.75)


def evaluate_ordacc(bundle: Bundle, data: LabeledImages, anchor: str = "proto", group_size: int = 5,
                    pairs: int = 32, seed: int = 0, batch: int = 100, candidates: Tensor | None = None) -> float:
    """OrdAcc (%) on ``data``: ``inst`` anchors on each image's own ground truth, ``proto`` on the
    prototype of a *different* group of ``group_size`` images (as at test time)."""
    with torch.no_grad():
        return ordacc_all(bundle, data, (anchor,), group_size, pairs, seed, batch, candidates)[anchor]


def ordacc_all(bundle: Bundle, data: LabeledImages, anchors: tuple[str, ...] = ("proto", "inst"),
               group_size: int = 5, pairs: int = 32, seed: int = 0, batch: int = 100,
               candidates: Tensor | None = None) -> dict[str, float]:
    """OrdAcc (%) for several anchors from one pass over ``data`` -> ``{anchor: ordacc}``."""
    with torch.no_grad():
        emb = bundle.embedder.eval()
        gen = torch.Generator().manual_seed(seed)
        dev = bundle.device
        cands = training_candidates(bundle) if candidates is None else candidates
        gts, poss, negs = [], [], []
        for i in range(0, len(data), batch):
            if data.feats is not None:
                feats = data.feats[i:i + batch]
            else:
                feats = emb.features(normalize(data.images[i:i + batch].to(dev), bundle.config.input))
            gt = data.boxes[i:i + batch]
            p = sample_pairs(gt, cands, pairs, generator=gen)
            out = emb.embed(feats, torch.cat([gt[:, None], p.pos, p.neg], 1).to(dev))  # [b, 1+2P, D]
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


def ranking_metrics(bundle: Bundle, data: LabeledImages, prototype: Tensor, pairs: int = 16, seed: int = 0,
                    candidates: Tensor | None = None, chunk: int = 64) -> dict[str, float]:
    """How well embedding distance ranks boxes by IoU on ``data``, with group-sampled box pairs (two
    distinct IoU bins each, so ``2 * pairs`` boxes per image spread over the bins):

    - ``ordacc``: % of pairs whose distance to ``prototype [D]`` (or ``[N, D]``, one per image) orders them as
      their IoU does;
    - ``ordacc_inst``: the same with each image's own ground-truth embedding as the anchor;
    - ``spearman``: Spearman rho between distance to ``prototype`` and IoU over each image's boxes,
      averaged over images (negative is good: closer means more overlap).
    """
    with torch.no_grad():
        emb = bundle.embedder.eval()
        gen = torch.Generator().manual_seed(seed)
        cands = rect_candidates(bundle) if candidates is None else candidates
        p = sample_pairs(data.boxes, cands, pairs, generator=gen)
        boxes = torch.cat([data.boxes[:, None], p.pos, p.neg], 1)  # [N, 1 + 2P, 4]
        feats = data.feats if data.feats is not None else features_of(bundle, data.images)
        out = torch.cat([emb.embed(feats[i:i + chunk], boxes[i:i + chunk]) for i in range(0, len(feats), chunk)])
        gt, pos, neg = out[:, 0], out[:, 1:1 + pairs], out[:, 1 + pairs:]
        proto = prototype.to(out.device)
        proto = proto[:, None] if proto.dim() == 2 else proto  # one per image ([N, D]: data of several kinds)
        d_pos, d_neg = (pos - proto).norm(dim=-1), (neg - proto).norm(dim=-1)  # [N, P]
        i_pos, i_neg = (pos - gt[:, None]).norm(dim=-1), (neg - gt[:, None]).norm(dim=-1)
        ious = torch.cat([p.pos_iou, p.neg_iou], 1).to(out.device)
        rho = spearman(torch.cat([d_pos, d_neg], 1).double(), ious.double())  # [N]
        return {"ordacc": float((d_pos < d_neg).float().mean() * 100),
                "ordacc_inst": float((i_pos < i_neg).float().mean() * 100),
                "spearman": float(rho.mean())}


def localize_boxes(bundle: Bundle, agent: Agent, data: LabeledImages, prototype: Tensor, *,
                   deterministic: bool = True, seed: int = 0, samples: int = 0, nearest: bool = False,
                   batch: int | None = None) -> Tensor:
    """The agent's episodes on ``data`` with one shared ``prototype [D]`` (or one per image ``[N, D]``) ->
    trajectories ``[T+1, N, 4]`` (CPU).

    Through ``Localizer``, on cached features when ``data`` carries them (``batch`` default 128 / (1 +
    samples)) or on the images (``batch`` default 256). ``samples > 0``: the best-of-(1 + samples) search
    (greedy episode included); ``nearest``: the visited box nearest the prototype is the answer;
    ``deterministic=False``: one sampled episode."""
    with torch.no_grad():
        loc = Localizer(bundle, device=bundle.device)
        agent.eval()
        if samples > 0:
            gen = torch.Generator().manual_seed(seed)
        else:
            gen = None if deterministic else torch.Generator(device=loc.device).manual_seed(seed)
        kw = {"deterministic": deterministic, "generator": gen, "samples": samples, "nearest": nearest}
        def proto(i: int, step: int) -> Tensor:
            return prototype[i:i + step] if prototype.dim() == 2 else prototype

        if data.feats is not None:
            step = batch or max(1, 128 // (samples + 1))
            parts = [loc.run_features(data.feats[i:i + step], proto(i, step), agent, **kw).boxes
                     for i in range(0, len(data), step)]
        else:
            step = batch or 256
            parts = [loc.run(data.images[i:i + step], proto(i, step), agent, **kw).boxes
                     for i in range(0, len(data), step)]
        return torch.cat([p.cpu() for p in parts], dim=1)


def evaluate_corloc(bundle: Bundle, agent: Agent, data: LabeledImages, prototype: Tensor,
                    deterministic: bool = True, seed: int = 0, samples: int = 0, nearest: bool = False
                    ) -> tuple[float, Tensor]:
    """CorLoc (%) of ``agent`` on ``data`` (see ``localize_boxes``) -> (corloc, final boxes ``[N, 4]``)."""
    boxes = localize_boxes(bundle, agent, data, prototype, deterministic=deterministic, seed=seed, samples=samples,
                           nearest=nearest)[-1]
    return corloc(boxes, data.boxes), boxes


def ranking(bundle: Bundle, data: LabeledImages, prototype: Tensor | None, candidates: Tensor | None = None,
            batch: int = 16, chunk: int = 2048, scorer: Any = None) -> Tensor:
    """The ranking baseline: for each image the candidate box nearest ``prototype [D]`` -> ``[N, 4]`` (CPU).

    Every candidate costs one RoIAlign + head call on the image's feature map (the backbone runs once per
    image, or not at all when ``data`` carries features), ``batch`` images and ``chunk`` candidates at a time.
    ``scorer`` (``models.repair``'s candidates: ``box_distances(embedder, feats, boxes, images01)``) ranks by its
    distance instead of the embedding distance to ``prototype`` (then unused); one that reads pixels
    (``scorer.pixels``) is given ``data.images``.
    """
    with torch.no_grad():
        cands = ranking_candidates(bundle) if candidates is None else candidates  # [K, 4]
        dev = bundle.device
        cands = cands.to(dev)
        proto = prototype.to(dev) if scorer is None else None
        emb = bundle.embedder
        out = []
        for i in range(0, len(data), batch):
            feats = data.feats[i:i + batch] if data.feats is not None else features_of(bundle, data.images[i:i + batch])
            pixels = data.images[i:i + batch].to(dev) if getattr(scorer, "pixels", False) else None
            parts = [cands[j:j + chunk].expand(len(feats), -1, -1) for j in range(0, len(cands), chunk)]
            dists = torch.cat([(emb.embed(feats, c) - proto).norm(dim=-1) if scorer is None
                               else scorer.box_distances(emb, feats, c, pixels) for c in parts], dim=1)  # [b, K]
            out.append(cands[dists.argmin(dim=1)].cpu())
        return torch.cat(out)
