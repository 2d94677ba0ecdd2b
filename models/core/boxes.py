"""Box operations. Boxes are ``Tensor[..., 4]`` of ``(x1, y1, x2, y2)`` floats (see ``models``)."""

from __future__ import annotations

import torch
from torch import Tensor


def box_area(boxes: Tensor) -> Tensor:
    """Area of ``boxes (Tensor[..., 4])`` -> ``Tensor[...]``, computed in float32 or wider."""
    b = boxes.float() if boxes.dtype not in (torch.float32, torch.float64) else boxes
    return (b[..., 2] - b[..., 0]).clamp(min=0) * (b[..., 3] - b[..., 1]).clamp(min=0)


def paired_intersection(a: Tensor, b: Tensor) -> Tensor:
    """Area of ``a[..., 4]`` intersected with ``b[..., 4]`` element-wise (broadcasting) -> ``Tensor[...]``."""
    a = a.float() if a.dtype != torch.float64 else a
    b = b.float() if b.dtype != torch.float64 else b
    lt = torch.maximum(a[..., :2], b[..., :2])
    rb = torch.minimum(a[..., 2:], b[..., 2:])
    wh = (rb - lt).clamp(min=0)  # [..., 2]
    return wh[..., 0] * wh[..., 1]


def paired_iou(a: Tensor, b: Tensor) -> Tensor:
    """IoU of ``a[..., 4]`` with ``b[..., 4]`` element-wise (broadcasting) -> ``Tensor[...]``."""
    inter = paired_intersection(a, b)
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


def candidate_boxes(size: int, min_side: float, max_side: float | None = None, *, side_step: float | None = None,
                    sides: int | None = None, stride: int | None = None, max_aspect: float = 1.0,
                    min_fraction: float = 0.5) -> Tensor:
    """Dense candidate boxes on a ``size x size`` image -> ``Tensor[K, 4]`` (the one recipe: stage 1's box
    pairs, OrdAcc and the ranking baseline all draw from it, with their own parameters).

    Widths and heights run from ``min_side`` to ``max_side`` (default ``size``), either every ``side_step``
    pixels or in ``sides`` geometric steps; pairs whose aspect ratio exceeds ``max_aspect`` are dropped
    (``1.0``: squares only). Top-left corners lie on a ``stride`` grid (default ``max(4, size // 16)``).
    Boxes are clipped to the image, those with a side under ``min_fraction * min_side`` after clipping are
    dropped, and the rest rounded to whole pixels and deduplicated.
    """
    if (side_step is None) == (sides is None):
        raise ValueError("give exactly one of side_step (linear sides) and sides (geometric steps)")
    hi = float(size if max_side is None else max_side)
    if sides is not None:
        s = torch.logspace(torch.log10(torch.tensor(float(min_side))), torch.log10(torch.tensor(hi)), sides)
    else:
        s = torch.arange(min_side, hi + 1, side_step, dtype=torch.float32)
    w, h = torch.meshgrid(s, s, indexing="ij")
    keep = (w / h <= max_aspect) & (h / w <= max_aspect)
    w, h = w[keep], h[keep]  # [S']
    stride = stride or max(4, size // 16)
    starts = torch.arange(0, size, stride, dtype=torch.float32)
    y, x = torch.meshgrid(starts, starts, indexing="ij")
    x, y = x.reshape(1, -1), y.reshape(1, -1)  # [1, G]
    boxes = torch.stack([x.expand(len(w), -1), y.expand(len(w), -1), x + w[:, None], y + h[:, None]], -1)
    boxes = clip_boxes(boxes.reshape(-1, 4), size, size)  # [S' * G, 4]
    wh = boxes[:, 2:] - boxes[:, :2]
    boxes = boxes[(wh >= min_side * min_fraction).all(dim=1)]
    return torch.unique(boxes.round(), dim=0)


def square_candidates(size: int, min_side: int, max_side: int, side_step: int = 4, stride: int = 4) -> Tensor:
    """Squares of side ``min_side..max_side`` (step ``side_step``) on a ``stride`` grid: ``candidate_boxes``
    with whole-pixel sides -> ``Tensor[K, 4]``."""
    return candidate_boxes(size, min_side, max_side, side_step=side_step, stride=stride)


def full_image_boxes(n: int, width: float, height: float, device=None) -> Tensor:
    """``n`` copies of the whole-image box -> ``Tensor[n, 4]``."""
    return torch.tensor([0.0, 0.0, float(width), float(height)], device=device).expand(n, 4).clone()


def top_k_per_image(boxes: Tensor, scores: Tensor, image: Tensor, b: int, k: int, iou: float
                   ) -> tuple[Tensor, Tensor]:
    """Non-maximum suppression per image over flat candidates (``boxes [M, 4]``, ``scores [M]`` higher is better,
    ``image [M]`` in ``0..b-1``) -> (indices ``[b, k]`` into the candidates, valid ``[b, k]``; an image with fewer
    survivors has ``valid`` False from there on, its index 0): each image's first ``k`` survivors of
    ``torchvision.ops.nms`` at IoU ``iou``, best first -- one ``batched_nms`` for every image."""
    from torchvision.ops import batched_nms

    keep = batched_nms(boxes, scores, image, iou)  # sorted by score, every image mixed
    img = image[keep]
    order = torch.sort(img, stable=True).indices  # group by image, score order kept within each
    keep, img = keep[order], img[order]
    counts = torch.bincount(img, minlength=b)
    first = torch.cumsum(counts, 0) - counts  # [B] where each image's survivors begin
    rank = torch.arange(len(keep), device=boxes.device) - first[img]
    sel = rank < k
    idx = torch.zeros(b, k, dtype=torch.long, device=boxes.device)
    valid = torch.zeros(b, k, dtype=torch.bool, device=boxes.device)
    idx[img[sel], rank[sel]] = keep[sel]
    valid[img[sel], rank[sel]] = True
    return idx, valid
