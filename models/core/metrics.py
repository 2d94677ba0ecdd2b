"""Evaluation metrics: CorLoc, Spearman rank correlation, AP50 and recall at K for several instances per image."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from models.core.boxes import paired_iou


def corloc(pred: Tensor, gt: Tensor, threshold: float = 0.5) -> float:
    """% of images whose predicted box ``pred [N, 4]`` has IoU >= ``threshold`` with ``gt [N, 4]`` (either device)."""
    if pred.shape != gt.shape:
        raise ValueError(f"pred {tuple(pred.shape)} and gt {tuple(gt.shape)} must have the same shape")
    return float((paired_iou(pred, gt.to(pred.device)) >= threshold).float().mean() * 100)


def _ranks(x: Tensor) -> Tensor:
    """Average ranks (ties share the mean rank) of ``x [..., N]`` along the last axis."""
    order = x.argsort(dim=-1)
    ranks = torch.empty_like(x, dtype=torch.float64)
    ranks.scatter_(-1, order, torch.arange(x.shape[-1], dtype=torch.float64, device=x.device).expand_as(x).clone())
    # Resolve ties: replace each rank by the mean rank of its equal values.
    eq = x[..., :, None] == x[..., None, :]  # [..., N, N]
    return (eq.double() @ ranks[..., None]).squeeze(-1) / eq.double().sum(-1)


def spearman(a: Tensor, b: Tensor) -> Tensor:
    """Spearman rank correlation of ``a`` and ``b`` along the last axis (``[..., N]`` -> ``[...]``)."""
    ra, rb = _ranks(a), _ranks(b)
    ra = ra - ra.mean(-1, keepdim=True)
    rb = rb - rb.mean(-1, keepdim=True)
    return (ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1)).clamp(min=1e-12)


def detection_metrics(pred_boxes: Sequence[Tensor], pred_scores: Sequence[Tensor], gt_boxes: Sequence[Tensor],
                      k: int) -> dict[str, float]:
    """AP at IoU 0.5 and recall at ``k`` of detections on N images, as COCO's ``COCOeval`` computes them for
    one class, IoU threshold 0.5, ``maxDets=[k]`` and no area limit (fractions in [0, 1]; NaN without any
    ground truth).

    ``pred_boxes``: per image ``[m_i, 4]`` (``x1, y1, x2, y2``), ``pred_scores``: per image ``[m_i]``, higher
    is surer (pass ``-distance``); non-finite scores mark absent detections, so padded ``[N, M, 4]`` /
    ``[N, M]`` tensors work too. ``gt_boxes``: per image ``[g_i, 4]``. Each image keeps its ``k`` best
    detections; in score order, each is matched to the unmatched ground-truth box it overlaps most, if that
    IoU is >= 0.5. ``recall_at_k``: matched / ground-truth boxes. ``ap50``: the detections of all images
    ranked by score (stable: image order, then rank), precision made monotone, averaged over the 101
    recall points 0, 0.01, ..., 1 (COCO's interpolation; ``tests/models/test_multi.py`` checks it against
    ``pycocotools``).
    """
    n = len(gt_boxes)
    if not len(pred_boxes) == len(pred_scores) == n:
        raise ValueError(f"need one entry per image: {len(pred_boxes)} pred_boxes, {len(pred_scores)} pred_scores, "
                         f"{n} gt_boxes")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if n == 0:
        return {"ap50": float("nan"), "recall_at_k": float("nan")}
    gt = pad_sequence([g.reshape(-1, 4).double() for g in gt_boxes], batch_first=True)  # [N, G, 4]
    g_valid = pad_sequence([torch.ones(len(g.reshape(-1, 4)), dtype=torch.bool) for g in gt_boxes], batch_first=True)
    boxes = pad_sequence([b.reshape(-1, 4).double().cpu() for b in pred_boxes], batch_first=True)  # [N, M, 4]
    scores = pad_sequence([s.reshape(-1).double().cpu() for s in pred_scores], batch_first=True,
                          padding_value=float("nan"))  # [N, M]
    if boxes.shape[:2] != scores.shape:
        raise ValueError(f"pred_boxes {tuple(boxes.shape)} and pred_scores {tuple(scores.shape)} do not match")
    scores = torch.where(scores.isfinite(), scores, -torch.inf)
    scores, order = scores.sort(dim=1, descending=True, stable=True)
    scores, order = scores[:, :k], order[:, :k]  # [N, k']: each image's k best
    boxes = boxes.gather(1, order[..., None].expand(-1, -1, 4))
    p_valid = scores.isfinite()  # [N, k']
    n_gt = int(g_valid.sum())
    if n_gt == 0:
        return {"ap50": float("nan"), "recall_at_k": float("nan")}
    iou = paired_iou(boxes[:, :, None], gt.to(boxes)[:, None])  # [N, k', G]
    iou = iou.masked_fill(~g_valid[:, None], -1.0)
    matched = torch.zeros_like(g_valid)  # [N, G]
    tp = torch.zeros_like(p_valid)  # [N, k']
    rows = torch.arange(n)
    for j in range(scores.shape[1]):  # greedy matching in rank order, all images at once
        best, idx = iou[:, j].masked_fill(matched, -1.0).max(dim=1)  # [N]
        hit = p_valid[:, j] & (best >= 0.5)
        tp[:, j] = hit
        matched[rows[hit], idx[hit]] = True
    flat_scores, flat_tp = scores[p_valid], tp[p_valid]  # image-major, rank order within an image
    if len(flat_scores) == 0:
        return {"ap50": 0.0, "recall_at_k": 0.0}
    rank = flat_scores.argsort(descending=True, stable=True)
    tps = flat_tp[rank].double().cumsum(0)
    fps = (~flat_tp[rank]).double().cumsum(0)
    recall = tps / n_gt
    precision = tps / (tps + fps)
    precision = precision.flip(0).cummax(0).values.flip(0)  # the precision envelope: max over higher recalls
    points = torch.from_numpy(np.linspace(0.0, 1.0, 101))  # COCO's recall points, to the bit
    at = torch.searchsorted(recall, points, side="left")  # first rank reaching each recall point
    reached = at < len(recall)
    ap = torch.where(reached, precision[at.clamp(max=len(recall) - 1)], 0.0).mean()
    return {"ap50": float(ap), "recall_at_k": float(recall[-1])}
