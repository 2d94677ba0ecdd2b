"""Evaluation metrics: CorLoc, Spearman rank correlation."""

from __future__ import annotations

import torch
from torch import Tensor

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
