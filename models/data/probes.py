"""Synthetic probes: the client's exemplar crops pasted into the client's own unlabeled images, at random
places and scales with soft edges, so each probe's box is known exactly.

What they can tell: whether a policy finds *this object's appearance* in *these images' backgrounds*
after adaptation as well as before -- a labeled check made from nothing but what the client uploaded.
What they cannot: the pasted crop is the exemplar itself (no new pose, lighting or occlusion), its
border is a seam however soft, and an unlabeled image may already hold a real object, which a policy
can rightly go to and be counted wrong. So probes compare policies (the same probes score the start
and every checkpoint) better than they estimate test CorLoc; labeled examples, where a set has them,
are better probes and come first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from models.data.types import LabeledImages


def paste_probes(crops: list[Tensor], images01: Tensor, n: int, *, object_side: float, generator: torch.Generator,
                 scale: tuple[float, float] = (0.8, 1.5), feather: int = 2) -> LabeledImages:
    """``n`` probes -> ``LabeledImages`` ``[n, C, S, S]`` with the exact box of each pasted crop.

    Each probe takes a random image of ``images01 [N, C, S, S]`` and a random crop ``[C, h, w]`` (values
    in [0, 1]; its index is the probe's ``sources`` entry), resizes the crop so its long side is
    ``object_side`` times a factor drawn from ``scale`` (aspect kept, at most the image side), and blends it in
    at a random position with an alpha that ramps up over ``feather`` pixels at the crop's border. The box is
    the pasted rectangle.
    """
    if not crops:
        raise ValueError("probes need at least one exemplar crop")
    if images01.dim() != 4 or len(images01) == 0:
        raise ValueError(f"probes need unlabeled images [N, C, S, S]; got {tuple(images01.shape)}")
    _, c, s, s2 = images01.shape
    if s != s2:
        raise ValueError(f"images must be square at the input size; got {s}x{s2}")
    out = images01[torch.randint(len(images01), (n,), generator=generator)].clone()
    which = torch.randint(len(crops), (n,), generator=generator)
    factors = torch.empty(n).uniform_(scale[0], scale[1], generator=generator)
    where = torch.rand(n, 2, generator=generator)
    boxes = torch.empty(n, 4)
    for i in range(n):  # builds a probe set once per job: not a per-request path
        crop = crops[int(which[i])]
        if crop.shape[0] != c:
            raise ValueError(f"crop has {crop.shape[0]} channels, images have {c}")
        h, w = crop.shape[-2:]
        k = min(object_side * float(factors[i]), 0.9 * s) / max(h, w)
        nh, nw = max(2, round(h * k)), max(2, round(w * k))
        patch = F.interpolate(crop[None].float(), size=(nh, nw), mode="bilinear", antialias=True,
                              align_corners=False)[0].clamp(0, 1)
        y, x = int(where[i, 0] * (s - nh + 1)), int(where[i, 1] * (s - nw + 1))
        alpha = _feathered(nh, nw, feather)
        region = out[i, :, y:y + nh, x:x + nw]
        out[i, :, y:y + nh, x:x + nw] = region * (1 - alpha) + patch * alpha
        boxes[i] = torch.tensor([x, y, x + nw, y + nh], dtype=torch.float32)
    return LabeledImages(out, boxes, sources=which)


def _feathered(h: int, w: int, feather: int) -> Tensor:
    """``[1, h, w]`` alpha: 1 inside, rising linearly over ``feather`` pixels from each border."""
    if feather <= 0:
        return torch.ones(1, h, w)
    ys = torch.arange(h, dtype=torch.float32)
    xs = torch.arange(w, dtype=torch.float32)
    dy = torch.minimum(ys + 0.5, h - 0.5 - ys) / feather
    dx = torch.minimum(xs + 0.5, w - 0.5 - xs) / feather
    return torch.minimum(dy[:, None], dx[None, :]).clamp(0, 1)[None]


def erase_boxes(images01: Tensor, boxes: Tensor, generator: torch.Generator) -> Tensor:
    """Copies of ``images01 [N, C, S, S]`` with each image's ``boxes [N, 4]`` region replaced by the same
    region of another image (the probes' backgrounds: where the starting policy saw the image's own object,
    so that a probe holds one object, the pasted one, as far as that policy can tell)."""
    n = len(images01)
    out = images01.clone()
    if n < 2:
        return out
    donor = (torch.arange(n) + 1 + torch.randint(n - 1, (n,), generator=generator)) % n
    b = boxes.round().long().clamp(min=0)
    for i in range(n):  # once per job
        x1, y1, x2, y2 = (int(v) for v in b[i])
        out[i, :, y1:y2, x1:x2] = images01[int(donor[i]), :, y1:y2, x1:x2]
    return out
