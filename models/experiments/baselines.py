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
import torch.nn.functional as F
from torch import Tensor

from models.bundle import Bundle
from models.core.boxes import candidate_boxes, top_k_per_image
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


TEMPLATE_SCALES = (0.75, 0.87, 1.0, 1.15, 1.33)
"""Default template scales: each crop is resized so its long side is this times its own long side
(``ref_side=None``). Geometric, 0.75-1.33: the exemplars and the objects to find are pasted at the same
sizes by the generators -- cMNIST's 28x28 frame (ratio 1) and the glyphs' long side of 28-36 px (object /
exemplar ratios 0.78-1.29) -- so these five cover every ratio the benchmarks hold."""


def ncc_map(images01: Tensor, template: Tensor, min_std: float = 1e-3) -> Tensor:
    """Normalized cross-correlation of ``template [C, h, w]`` at every position of ``images01 [N, C, H, W]``
    -> ``[N, H - h + 1, W - w + 1]`` in [-1, 1]; entry ``(y, x)`` scores the window ``[y:y+h, x:x+w]``.

    OpenCV's ``TM_CCOEFF_NORMED``: the template and each window less their own mean (per channel), the
    dot product over the channels divided by both norms. Windows whose pixel std (over the channels)
    is under ``min_std`` (flat: a patch, the black canvas) and flat templates score 0. Window sums come
    from a separable ``avg_pool2d`` (h x 1 then 1 x w: 8x faster than one h x w pool at 30 px), the dot
    product from one ``conv2d`` over the whole batch.
    """
    c, h, w = template.shape
    if images01.dim() != 4 or images01.shape[1] != c:
        raise ValueError(f"images must be [N, {c}, H, W] for a {c}-channel template; got {tuple(images01.shape)}")
    if h > images01.shape[-2] or w > images01.shape[-1]:
        raise ValueError(f"template {h}x{w} is larger than the images {tuple(images01.shape[-2:])}")
    t = template.to(images01)
    t = t - t.mean(dim=(1, 2), keepdim=True)
    t_norm = t.square().sum().sqrt()
    n = h * w
    out_shape = (images01.shape[0], images01.shape[-2] - h + 1, images01.shape[-1] - w + 1)
    if float(t_norm) < min_std * (c * n) ** 0.5:  # a flat template correlates with nothing
        return images01.new_zeros(out_shape)
    num = F.conv2d(images01, t[None])[:, 0]  # sum of t * window (t has zero mean: the window's mean drops out)
    # Window sums of the pixels and their squares: one separable (h x 1, then 1 x w) mean pool of both.
    both = torch.cat([images01, images01.square()], dim=1)
    pooled = F.avg_pool2d(F.avg_pool2d(both, (h, 1), stride=1), (1, w), stride=1) * n
    s1, s2 = pooled[:, :c], pooled[:, c:]
    var = (s2 - s1.square() / n).sum(dim=1).clamp(min=0)  # [N, H', W']: sum of the squared deviations
    flat = var < c * n * min_std ** 2
    score = num / (var.sqrt() * t_norm).clamp(min=torch.finfo(num.dtype).tiny)
    return score.masked_fill(flat, 0.0).clamp(-1.0, 1.0)


def scaled_template(crop: Tensor, scale: float, ref_side: float | None = None) -> Tensor:
    """``crop [C, h, w]`` resized (aspect kept, bilinear with antialias) so its long side is ``scale`` x
    ``ref_side`` (default: its own long side); at least 2 px a side."""
    h, w = crop.shape[-2:]
    long = scale * (ref_side if ref_side is not None else max(h, w))
    k = long / max(h, w)
    nh, nw = max(2, round(h * k)), max(2, round(w * k))
    if (nh, nw) == (h, w):
        return crop
    return F.interpolate(crop[None].float(), size=(nh, nw), mode="bilinear", antialias=True,
                         align_corners=False)[0].clamp(0, 1)


@torch.no_grad()
def template_matching(images01: Tensor, crops: list[Tensor], scales: tuple[float, ...] = TEMPLATE_SCALES,
                      ref_side: float | None = None, min_std: float = 1e-3, return_scores: bool = False
                      ) -> Tensor | tuple[Tensor, Tensor]:
    """The template-matching baseline: for each image of ``images01 [N, C, S, S]`` (in [0, 1]) the window
    whose normalized cross-correlation (``ncc_map``) with one of the exemplar ``crops [C, h, w]`` at one of
    the ``scales`` (``scaled_template``) is highest -> boxes ``[N, 4]`` in input pixels (``x1, y1, x2, y2``,
    integer edges; with ``return_scores`` also the scores ``[N]``).

    Vectorized over the images (one ``conv2d`` per exemplar and scale). Templates larger than the images
    are skipped; ties keep the first exemplar, then the smallest scale, then the first position in raster order.
    """
    if not crops:
        raise ValueError("template matching needs at least one exemplar crop")
    n, _, hh, ww = images01.shape
    best = torch.full((n,), -torch.inf, dtype=images01.dtype, device=images01.device)
    boxes = torch.zeros(n, 4, dtype=torch.float32, device=images01.device)
    tried = 0
    for crop in crops:
        for s in sorted(scales):
            t = scaled_template(crop, s, ref_side).to(images01)
            h, w = t.shape[-2:]
            if h > hh or w > ww:
                continue
            tried += 1
            score = ncc_map(images01, t, min_std).flatten(1)  # [N, H' * W']
            top, idx = score.max(dim=1)
            x, y = (idx % (ww - w + 1)).float(), torch.div(idx, ww - w + 1, rounding_mode="floor").float()
            better = top > best
            best = torch.where(better, top, best)
            boxes[better] = torch.stack([x, y, x + w, y + h], dim=1)[better]
    if tried == 0:
        raise ValueError(f"every template is larger than the images {hh}x{ww}")
    return (boxes, best) if return_scores else boxes


# ---------------------------------------------------------------- several instances per image

class Detections(NamedTuple):
    """Up to K boxes per image, best first. ``boxes [B, K, 4]`` in input pixels; ``distances [B, K]`` to the
    prototype (lower is closer; ``inf`` where not ``valid``); ``valid [B, K]`` bool (fewer than K kept -> False);
    ``evaluations``: boxes embedded per image (the compute measure)."""

    boxes: Tensor
    distances: Tensor
    valid: Tensor
    evaluations: int


@torch.no_grad()
def box_distances(bundle: Bundle, feats: Tensor, boxes: Tensor, prototype: Tensor, max_boxes: int = 8192) -> Tensor:
    """Distance to ``prototype`` (``[D]``, or ``[B, D]`` one per image) of the embedding of every box of
    ``boxes [C, 4]`` (input pixels) on each image's features ``feats [B, C', h, w]`` -> ``[B, C]``.

    One RoIAlign + head call per chunk of candidates, all images at once; a chunk holds at most
    ``max_boxes`` boxes over the batch (``max_boxes`` RoI features live at a time)."""
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


@torch.no_grad()
def ranking_nms(bundle: Bundle, feats: Tensor, prototype: Tensor, k: int, candidates: Tensor,
                iou_threshold: float = 0.5) -> Detections:
    """The ranking baseline for several instances: embed every box of ``candidates [C, 4]`` on each image's
    features ``feats [B, C', h, w]``, rank by distance to ``prototype`` (``[D]`` or ``[B, D]``), keep the
    ``k`` best after non-maximum suppression at ``iou_threshold`` (``topk_nms``); ``C`` evaluations per image.
    ``models.evaluate.ranking_candidates`` gives the usual dense squares, ``ranking_candidates_within`` the
    same kind of squares for a budget."""
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


@torch.no_grad()
def sliding_window(bundle: Bundle, feats: Tensor, prototype: Tensor, k: int, window: tuple[float, float],
                   budget: int, iou_threshold: float = 0.5) -> Detections:
    """The sliding-window baseline: windows of the exemplars' size ``window = (w, h)`` (input pixels) on a
    grid of at most ``budget`` positions (``sliding_windows``), scored by embedding distance to
    ``prototype``, ``k`` kept after non-maximum suppression (``topk_nms``)."""
    wins = sliding_windows(bundle.config.input.size, window, budget)
    return nms_detections(wins, box_distances(bundle, feats, wins, prototype), k, iou_threshold)
