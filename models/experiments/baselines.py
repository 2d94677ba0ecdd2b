"""The baselines of the tables: the fine-tune baseline (the agent tuned with the IoU reward on the
exemplar images, whose boxes are known) and template matching (normalized cross-correlation of the
exemplar crops over every position and a few scales; no learning). (The ranking baseline is
``models.evaluate.ranking``.)

For several instances per image (issue 13): the ranking baseline with top-K non-maximum suppression
(``ranking_nms``) and a sliding window at the exemplars' size (``sliding_window``), each at a budget of
embedded boxes per image (``ranking_candidates_within``, ``sliding_windows``), the compute measure the
multi-instance benchmark holds equal."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import torch
from torch import Tensor

from models.bundle import Bundle
from models.core.boxes import candidate_boxes, top_k_per_image
from models.core.matching import TEMPLATE_SCALES, ncc_map, scaled_template, template_matching  # noqa: F401 (re-exported)
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


# ---------------------------------------------------------------- several instances per image

class Detections(NamedTuple):
    """Up to K boxes per image, best first. ``boxes [B, K, 4]`` in input pixels; ``distances [B, K]`` to the
    prototype (lower is closer; ``inf`` where not ``valid``); ``valid [B, K]`` bool (fewer than K kept -> False);
    ``evaluations``: boxes embedded per image (the compute measure)."""

    boxes: Tensor
    distances: Tensor
    valid: Tensor
    evaluations: int


def box_distances(bundle: Bundle, feats: Tensor, boxes: Tensor, prototype: Tensor, max_boxes: int = 8192) -> Tensor:
    """Distance to ``prototype`` (``[D]``, or ``[B, D]`` one per image) of the embedding of every box of
    ``boxes [C, 4]`` (input pixels) on each image's features ``feats [B, C', h, w]`` -> ``[B, C]``.

    One RoIAlign + head call per chunk of candidates, all images at once; a chunk holds at most
    ``max_boxes`` boxes over the batch (``max_boxes`` RoI features live at a time)."""
    with torch.no_grad():
        b = feats.shape[0]
        boxes = boxes.to(feats.device)
        proto = prototype.to(feats.device)
        proto = proto[:, None] if proto.dim() == 2 else proto  # [B, 1, D] or [D]
        chunk = max(1, max_boxes // b)
        return torch.cat([(bundle.embedder.embed(feats, boxes[j:j + chunk].expand(b, -1, -1)) - proto).norm(dim=-1)
                          for j in range(0, len(boxes), chunk)], dim=1)


def topk_nms(boxes: Tensor, distances: Tensor, k: int, iou_threshold: float = 0.5) -> tuple[Tensor, Tensor]:
    """Greedy non-maximum suppression stopped after ``k`` boxes, for every image at once.

    ``boxes``: ``[C, 4]`` shared by the images, or ``[B, C, 4]``; ``distances [B, C]`` (lower is better).
    Each round keeps each image's nearest remaining box and drops the boxes overlapping it with IoU >
    ``iou_threshold`` (torchvision's ``nms`` rule) -> (indices into C ``[B, k]``, valid ``[B, k]``; an image
    whose boxes run out has ``valid`` False from there on, its index 0). The first ``k`` of
    ``torchvision.ops.nms`` on each image: ``models.core.boxes.top_k_per_image``, as the instance search.
    """
    bsz, c = distances.shape
    boxes = boxes.expand(bsz, c, 4) if boxes.dim() == 2 else boxes  # [B, C, 4]
    flat = distances.flatten()
    ok = flat.isfinite().nonzero().flatten()  # an infinite distance is no candidate
    if not len(ok):
        zeros = torch.zeros(bsz, k, dtype=torch.long, device=distances.device)
        return zeros, zeros.bool()
    image = torch.arange(bsz, device=distances.device).repeat_interleave(c)
    idx, valid = top_k_per_image(boxes.reshape(-1, 4)[ok], -flat[ok], image[ok], bsz, k, iou_threshold)
    return torch.where(valid, ok[idx] % c, 0), valid


def nms_detections(boxes: Tensor, distances: Tensor, k: int, iou_threshold: float = 0.5) -> Detections:
    """``topk_nms`` of candidates ``boxes [C, 4]`` scored ``distances [B, C]`` -> their ``Detections`` (C evaluations
    per image): reuse one scoring for several ``k`` or thresholds."""
    boxes = boxes.to(distances.device)
    idx, valid = topk_nms(boxes, distances, k, iou_threshold)  # [B, k]
    kept = boxes.expand(len(distances), -1, -1).gather(1, idx[..., None].expand(-1, -1, 4))  # [B, k, 4]
    d = distances.gather(1, idx).masked_fill(~valid, torch.inf)
    return Detections(kept, d, valid, boxes.shape[0])


def ranking_nms(bundle: Bundle, feats: Tensor, prototype: Tensor, k: int, candidates: Tensor,
                iou_threshold: float = 0.5) -> Detections:
    """The ranking baseline for several instances: embed every box of ``candidates [C, 4]`` on each image's
    features ``feats [B, C', h, w]``, rank by distance to ``prototype`` (``[D]`` or ``[B, D]``), keep the
    ``k`` best after non-maximum suppression at ``iou_threshold`` (``topk_nms``); ``C`` evaluations per image.
    ``models.evaluate.ranking_candidates`` gives the usual dense squares, ``ranking_candidates_within`` the
    same kind of squares for a budget."""
    with torch.no_grad():
        return nms_detections(candidates, box_distances(bundle, feats, candidates, prototype), k, iou_threshold)


def ranking_candidates_within(bundle: Bundle, budget: int) -> Tensor:
    """The ranking baseline's dense squares (``candidate_boxes``: sides from ``env.min_side`` to 0.9 x the input
    side every ``side_step`` px, corners on a ``stride`` grid) on the finest grid within ``budget`` boxes per
    image -> ``[C, 4]``: the ``(side_step, stride)`` with the smallest ``max(side_step, stride)``, then the most
    boxes, among those giving at most ``budget``.

    ``models.evaluate.ranking_candidates(bundle, per_side)`` ties ``side_step = stride`` and so reaches few
    counts (949 boxes at 13-15 per side, 648 at 12, 396 at 10-11 on 84 px): a budget would often leave much of
    its compute unspent. Spending it on the most boxes instead would pick lopsided grids (24 sizes at a 22-px
    stride for 280 boxes on 84 px)."""
    return _squares_within(bundle.config.input.size, float(bundle.config.env.min_side), int(budget)).clone()


@lru_cache(maxsize=64)
def _squares_within(size: int, min_side: float, budget: int) -> Tensor:
    if budget < 1:
        raise ValueError(f"a budget of {budget} boxes per image is too small: need at least 1")
    max_side = int(size * 0.9)

    def squares(side_step: int, stride: int) -> Tensor:
        return candidate_boxes(size, min_side, max_side, side_step=side_step, stride=stride)

    best, best_key = None, None
    for stride in range(2, size + 1):
        lo, hi = 2, size  # the box count falls as side_step grows: binary search the smallest step within budget
        if len(squares(hi, stride)) > budget:
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            if len(squares(mid, stride)) <= budget:
                hi = mid
            else:
                lo = mid + 1
        found = squares(lo, stride)
        key = (max(lo, stride), -len(found))
        if best_key is None or key < best_key:
            best, best_key = found, key
    if best is None:
        raise ValueError(f"no grid of squares fits a budget of {budget} boxes per image")
    return best


def sliding_windows(size: int, window: tuple[float, float], budget: int) -> Tensor:
    """Windows of ``window = (w, h)`` px on a ``size x size`` image, ``nx x ny`` of them (the most <= ``budget``,
    ``|nx - ny| <= 1``) spread evenly from edge to edge (whole-pixel corners; one window per axis: centred)
    -> ``[nx * ny, 4]``."""
    if budget < 1:
        raise ValueError(f"a budget of {budget} boxes per image is too small: need at least 1")
    w, h = min(float(window[0]), size), min(float(window[1]), size)
    n = math.isqrt(budget)
    nx, ny = (n + 1, n) if (n + 1) * n <= budget else (n, n)

    def starts(count: int, extent: float) -> Tensor:
        if count == 1:
            return torch.tensor([round((size - extent) / 2)], dtype=torch.float32)
        return torch.linspace(0, size - extent, count).round()

    y, x = torch.meshgrid(starts(ny, h), starts(nx, w), indexing="ij")
    x, y = x.reshape(-1), y.reshape(-1)
    return torch.stack([x, y, x + w, y + h], dim=1)


def sliding_window(bundle: Bundle, feats: Tensor, prototype: Tensor, k: int, window: tuple[float, float],
                   budget: int, iou_threshold: float = 0.5) -> Detections:
    """The sliding-window baseline: windows of the exemplars' size ``window = (w, h)`` (input pixels) on a
    grid of at most ``budget`` positions (``sliding_windows``), scored by embedding distance to
    ``prototype``, ``k`` kept after non-maximum suppression (``topk_nms``)."""
    with torch.no_grad():
        wins = sliding_windows(bundle.config.input.size, window, budget)
        return nms_detections(wins, box_distances(bundle, feats, wins, prototype), k, iou_threshold)
