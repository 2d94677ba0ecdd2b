"""The discrete box actions of PAPER.md, applied to a whole batch at once.

0-3 shrink keeping the top-left / top-right / bottom-left / bottom-right corner; 4 shrink toward
the centre; 5 stay; 6-9 move left / right / up / down by ``alpha`` x side, snapping to the border;
10-13 (photos) height +20%, width +20%, width -20%, height -20%, about the centre. No side ever
falls below ``min_side`` (nor below its current length, if the image is smaller), and every box
stays inside the image.
"""

from __future__ import annotations

import torch
from torch import Tensor

ACTION_NAMES = (
    "shrink_tl", "shrink_tr", "shrink_bl", "shrink_br", "shrink_center", "stay",
    "left", "right", "up", "down",
    "taller", "wider", "narrower", "shorter",
)
MNIST_ACTIONS = 10
PHOTO_ACTIONS = 14


def apply_actions(
    boxes: Tensor, actions: Tensor, width: float, height: float, alpha: float = 0.2,
    min_side: float = 28.0, resize: float = 0.2,
) -> Tensor:
    """Move ``boxes (Tensor[B, 4])`` by ``actions (LongTensor[B])`` -> new ``Tensor[B, 4]``.

    Fully vectorized: every candidate outcome is computed for the batch and the chosen one gathered.
    """
    x1, y1, x2, y2 = boxes.unbind(-1)
    w, h = x2 - x1, y2 - y1
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    # Shrunk sides, never below min_side (nor growing a side that is already smaller).
    sw = torch.maximum(w * (1 - alpha), torch.minimum(w, torch.full_like(w, min_side)))
    sh = torch.maximum(h * (1 - alpha), torch.minimum(h, torch.full_like(h, min_side)))
    dx, dy = alpha * w, alpha * h

    def centred(nw: Tensor, nh: Tensor) -> Tensor:
        nw, nh = nw.clamp(max=width), nh.clamp(max=height)
        nx1 = (cx - nw / 2).clamp(min=0)
        nx1 = torch.minimum(nx1, width - nw)
        ny1 = (cy - nh / 2).clamp(min=0)
        ny1 = torch.minimum(ny1, height - nh)
        return torch.stack([nx1, ny1, nx1 + nw, ny1 + nh], -1)

    def shifted(ox: Tensor, oy: Tensor) -> Tensor:
        nx1 = torch.minimum((x1 + ox).clamp(min=0), width - w)
        ny1 = torch.minimum((y1 + oy).clamp(min=0), height - h)
        return torch.stack([nx1, ny1, nx1 + w, ny1 + h], -1)

    zero = torch.zeros_like(w)
    grow_w = torch.maximum(w * (1 + resize), w)
    grow_h = torch.maximum(h * (1 + resize), h)
    cut_w = torch.maximum(w * (1 - resize), torch.minimum(w, torch.full_like(w, min_side)))
    cut_h = torch.maximum(h * (1 - resize), torch.minimum(h, torch.full_like(h, min_side)))
    outcomes = torch.stack([
        torch.stack([x1, y1, x1 + sw, y1 + sh], -1),        # 0 keep top-left
        torch.stack([x2 - sw, y1, x2, y1 + sh], -1),        # 1 keep top-right
        torch.stack([x1, y2 - sh, x1 + sw, y2], -1),        # 2 keep bottom-left
        torch.stack([x2 - sw, y2 - sh, x2, y2], -1),        # 3 keep bottom-right
        centred(sw, sh),                                    # 4 shrink to centre
        boxes,                                              # 5 stay
        shifted(-dx, zero), shifted(dx, zero),              # 6, 7 left, right
        shifted(zero, -dy), shifted(zero, dy),              # 8, 9 up, down
        centred(w, grow_h), centred(grow_w, h),             # 10, 11 taller, wider
        centred(cut_w, h), centred(w, cut_h),               # 12, 13 narrower, shorter
    ], dim=1)  # [B, 14, 4]
    idx = actions.long().view(-1, 1, 1).expand(-1, 1, 4)
    return outcomes.gather(1, idx).squeeze(1)
