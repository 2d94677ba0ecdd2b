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


# Each action moves each axis (x, then y) one way: the new side is one of the box's ``(w, shrunk, grown,
# cut)`` (``_SIDE``), placed by ``_MODE``: keep the low edge, keep the high edge, centre, shift by
# ``_SHIFT`` x ``alpha`` x side, or stay. Looked up per row, these move the whole batch with a few gathers
# instead of computing all 14 outcomes (what batch-1 inference felt most).
_LOW, _HIGH, _CENTRE, _SHIFTED, _STAY = range(5)
_SIDE = (  # 0 the side itself, 1 shrunk (alpha, min_side), 2 grown (resize), 3 cut (resize, min_side)
    (1, 1), (1, 1), (1, 1), (1, 1), (1, 1), (0, 0), (0, 0), (0, 0), (0, 0), (0, 0),
    (0, 2), (2, 0), (3, 0), (0, 3),
)
_MODE = (
    (_LOW, _LOW), (_HIGH, _LOW), (_LOW, _HIGH), (_HIGH, _HIGH), (_CENTRE, _CENTRE), (_STAY, _STAY),
    (_SHIFTED, _SHIFTED), (_SHIFTED, _SHIFTED), (_SHIFTED, _SHIFTED), (_SHIFTED, _SHIFTED),
    (_CENTRE, _CENTRE), (_CENTRE, _CENTRE), (_CENTRE, _CENTRE), (_CENTRE, _CENTRE),
)
_SHIFT = ((0, 0),) * 6 + ((-1, 0), (1, 0), (0, -1), (0, 1)) + ((0, 0),) * 4
_MODES = 5
_TABLES: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}


def _tables(device: torch.device, dtype: torch.dtype, width: float, height: float) -> tuple[Tensor, Tensor, Tensor]:
    """Per action, as flat indices: ``[A, 6]`` = (the new side of x and y in ``sides [B, 2 * 4]``, then
    x1, y1, x2, y2 in ``candidates [B, 2 * 2 * 5]``); ``[A, 2]`` shift signs; the image size ``[2]``. Built once."""
    key = (device, dtype, width, height)
    if key not in _TABLES:
        if len(_TABLES) >= 64:  # image sizes come from the bundles' specs: a few; never let it grow unbounded
            _TABLES.clear()
        side = [[axis * 4 + s for axis, s in enumerate(row)] for row in _SIDE]
        # candidates[b, axis, edge, mode] flattened: axis * 10 + edge * 5 + mode
        out = [[edge * _MODES + axis * 2 * _MODES + mode[axis] for edge in (0, 1) for axis in (0, 1)] for mode in _MODE]
        index = torch.tensor([s + o for s, o in zip(side, out, strict=True)], device=device)
        _TABLES[key] = (index, torch.tensor(_SHIFT, dtype=dtype, device=device),
                        torch.tensor((width, height), dtype=dtype, device=device))
    return _TABLES[key]


def apply_actions(
    boxes: Tensor, actions: Tensor, width: float, height: float, alpha: float = 0.2,
    min_side: float = 28.0, resize: float = 0.2,
) -> Tensor:
    """Move ``boxes (Tensor[B, 4])`` by ``actions (LongTensor[B])`` -> new ``Tensor[B, 4]``.

    Fully vectorized: both axes of the batch at once, each row's action looked up in the action tables.
    Every coordinate is computed by the same float operations as the action's own formula, so the boxes
    are exact (``tests/models/test_boxes_actions.py`` checks them against a per-action reference).
    """
    b = boxes.shape[0]
    lo, hi = boxes.reshape(b, 2, 2).unbind(1)  # [B, 2] each: (x1, y1), (x2, y2)
    index, shift, size = _tables(boxes.device, boxes.dtype, width, height)
    act = actions.long()
    index, shift = index.index_select(0, act), shift.index_select(0, act)  # [B, 6], [B, 2]
    side = hi - lo
    centre = (lo + hi) / 2
    # Shrunk sides, never below min_side (nor growing a side that is already smaller).
    floor = side.clamp(max=min_side)
    sides = torch.stack([
        side, torch.maximum(side * (1 - alpha), floor), torch.maximum(side * (1 + resize), side),
        torch.maximum(side * (1 - resize), floor),
    ], -1)  # [B, 2, 4]
    new = sides.view(b, 8).gather(1, index[:, :2])  # [B, 2] the new side per axis
    fit = torch.minimum(new, size)  # a centred box never outgrows the image
    centred = torch.minimum((centre - fit / 2).clamp(min=0), size - fit)
    shifted = torch.minimum((lo + alpha * side * shift).clamp(min=0), size - new)
    candidates = torch.stack([
        lo, hi - new, centred, shifted, lo,  # the low edge, by mode
        lo + new, hi, centred + fit, shifted + new, hi,  # the high edge
    ], -1)  # [B, 2 (axis), 2 * 5 (edge, mode)]
    return candidates.view(b, 20).gather(1, index[:, 2:])
