"""Box operations. Boxes are ``Tensor[..., 4]`` of ``(x1, y1, x2, y2)`` floats (see ``models``)."""

from __future__ import annotations

import torch
from torch import Tensor


def box_area(boxes: Tensor) -> Tensor:
    """Area of ``boxes (Tensor[..., 4])`` -> ``Tensor[...]``, computed in float32 or wider."""
    b = boxes.float() if boxes.dtype not in (torch.float32, torch.float64) else boxes
    return (b[..., 2] - b[..., 0]).clamp(min=0) * (b[..., 3] - b[..., 1]).clamp(min=0)


def paired_iou(a: Tensor, b: Tensor) -> Tensor:
    """IoU of ``a[..., 4]`` with ``b[..., 4]`` element-wise (broadcasting) -> ``Tensor[...]``."""
    a = a.float() if a.dtype != torch.float64 else a
    b = b.float() if b.dtype != torch.float64 else b
    lt = torch.maximum(a[..., :2], b[..., :2])
    rb = torch.minimum(a[..., 2:], b[..., 2:])
    wh = (rb - lt).clamp(min=0)  # [..., 2]
    inter = wh[..., 0] * wh[..., 1]
    union = box_area(a) + box_area(b) - inter
    return inter / union.clamp(min=1e-9)


def pairwise_iou(a: Tensor, b: Tensor) -> Tensor:
    """IoU matrix of ``a (Tensor[N, 4])`` against ``b (Tensor[M, 4])`` -> ``Tensor[N, M]``."""
    return paired_iou(a[:, None, :], b[None, :, :])


def clip_boxes(boxes: Tensor, width: float, height: float) -> Tensor:
    """Clip ``boxes (Tensor[..., 4])`` to the image ``[0, width] x [0, height]``."""
    x = boxes[..., 0::2].clamp(0, width)
    y = boxes[..., 1::2].clamp(0, height)
    return torch.stack([x[..., 0], y[..., 0], x[..., 1], y[..., 1]], dim=-1)


def check_boxes(boxes: Tensor, width: float | None = None, height: float | None = None) -> Tensor:
    """Raise ``ValueError`` unless ``boxes`` is ``[..., 4]`` with ``x1 < x2``, ``y1 < y2``, inside the image."""
    if boxes.shape[-1] != 4:
        raise ValueError(f"boxes must have a last dimension of 4 (x1, y1, x2, y2), got shape {tuple(boxes.shape)}")
    if not bool(((boxes[..., 2] > boxes[..., 0]) & (boxes[..., 3] > boxes[..., 1])).all()):
        raise ValueError("boxes must satisfy x1 < x2 and y1 < y2 (format x1, y1, x2, y2)")
    if width is not None and height is not None:
        eps = 1e-4
        inside = (boxes[..., :2] >= -eps).all() & (boxes[..., 2] <= width + eps).all()
        inside &= (boxes[..., 3] <= height + eps).all()
        if not bool(inside):
            raise ValueError(f"boxes must lie inside the {width}x{height} image")
    return boxes


def square_candidates(
    size: int, min_side: int, max_side: int, side_step: int = 4, stride: int = 4
) -> Tensor:
    """Dense square candidate boxes on a ``size x size`` image -> ``Tensor[K, 4]``.

    Squares of side ``min_side..max_side`` (step ``side_step``) whose top-left corners lie on a
    ``stride`` grid, clipped to the image; duplicates after clipping are removed.
    """
    sides = torch.arange(min_side, max_side + 1, side_step, dtype=torch.float32)
    starts = torch.arange(0, size, stride, dtype=torch.float32)
    s, y, x = torch.meshgrid(sides, starts, starts, indexing="ij")
    boxes = torch.stack([x, y, x + s, y + s], dim=-1).reshape(-1, 4)
    boxes = clip_boxes(boxes, size, size)
    wh = boxes[:, 2:] - boxes[:, :2]
    boxes = boxes[(wh >= min_side * 0.5).all(dim=1)]
    return torch.unique(boxes, dim=0)


def full_image_boxes(n: int, width: float, height: float, device=None) -> Tensor:
    """``n`` copies of the whole-image box -> ``Tensor[n, 4]``."""
    return torch.tensor([0.0, 0.0, float(width), float(height)], device=device).expand(n, 4).clone()
