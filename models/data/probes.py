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

PROBE_SHAPES = ("rect", "ellipse")
PROBE_STYLES = ("rect", "soft")
"""How a job's probes are made (``models.guard.synthetic_probes``). ``rect``: the crop pasted as a rectangle, the
starting policy's answer covered with the same rectangle of another image. ``soft``: the crop pasted as its inscribed
ellipse with a soft edge (``shape="ellipse"``), the answer covered by a smooth fill from its surroundings
(``fill_boxes``): no straight seam anywhere, so a reward cannot learn where a paste is instead of what it shows.
Measured on photos (BENCHMARKS.md, "Probes without seams"): a better repaired reward, the same served answers."""


def paste_probes(crops: list[Tensor], images01: Tensor, n: int, *, object_side: float, generator: torch.Generator,
                 scale: tuple[float, float] = (0.8, 1.5), feather: int = 2, shape: str = "rect") -> LabeledImages:
    """``n`` probes -> ``LabeledImages`` ``[n, C, S, S]`` with the exact box of each pasted crop.

    Each probe takes a random image of ``images01 [N, C, S, S]`` and a random crop ``[C, h, w]`` (values
    in [0, 1]; its index is the probe's ``sources`` entry), resizes the crop so its long side is
    ``object_side`` times a factor drawn from ``scale`` (aspect kept, at most the image side), and blends it in
    at a random position with an alpha that ramps up over ``feather`` pixels at the crop's border. The box is
    the pasted rectangle. ``shape="ellipse"``: only the ellipse inscribed in the crop is pasted (its alpha ramping
    over ``feather`` pixels inside the ellipse's edge), so no straight seam outlines the box; the box is still the
    crop's rectangle, which the object fills edge to edge where the crop is tight.
    """
    if shape not in PROBE_SHAPES:
        raise ValueError(f"shape must be one of {PROBE_SHAPES}, got {shape!r}")
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
        alpha = _feathered(nh, nw, feather) if shape == "rect" else _elliptical(nh, nw, feather)
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


def _elliptical(h: int, w: int, feather: int) -> Tensor:
    """``[1, h, w]`` alpha: 1 inside the ellipse inscribed in ``h x w``, falling to 0 at its edge over ``feather``
    pixels or 8 % of the shorter side, whichever is more (measured along the shorter semi-axis), 0 outside."""
    ys = (torch.arange(h, dtype=torch.float32) + 0.5) / h * 2 - 1
    xs = (torch.arange(w, dtype=torch.float32) + 0.5) / w * 2 - 1
    r = (ys[:, None] ** 2 + xs[None, :] ** 2).sqrt()  # 1 on the inscribed ellipse
    band = max(feather, 0.08 * min(h, w), 1.0) / (min(h, w) / 2)
    return ((1 - r) / band).clamp(0, 1)[None]


def fill_boxes(images01: Tensor, boxes: Tensor, *, grow: float = 0.15, band: float = 0.15) -> Tensor:
    """Copies of ``images01 [N, C, S, S]`` with each image's ``boxes [N, 4]`` region (grown by ``grow`` of its side
    on each side) covered by a smooth fill from the pixels around it (push-pull: the image outside the region
    averaged down an image pyramid, then pulled back up into the hole), blended over ``band`` of the region's
    shorter side at its edge: an object that was there is gone, and no straight edge marks where."""
    n, _, h, w = images01.shape
    if n == 0:
        return images01.clone()
    b = boxes.to(images01.dtype)
    size = (b[:, 2:] - b[:, :2]).clamp(min=1)
    lo, hi = b[:, :2] - grow * size, b[:, 2:] + grow * size
    ys = torch.arange(h, dtype=images01.dtype) + 0.5
    xs = torch.arange(w, dtype=images01.dtype) + 0.5
    ramp = (band * (hi - lo).min(1).values).clamp(min=1.0)[:, None]  # [N, 1] pixels
    ay = (torch.minimum(ys[None] - lo[:, 1:2], hi[:, 1:2] - ys[None]) / ramp).clamp(0, 1)  # [N, H]
    ax = (torch.minimum(xs[None] - lo[:, 0:1], hi[:, 0:1] - xs[None]) / ramp).clamp(0, 1)  # [N, W]
    alpha = torch.minimum(ay[:, :, None], ax[:, None, :])[:, None]  # [N, 1, H, W]: 1 inside the hole
    known = (alpha == 0).to(images01.dtype)
    return images01 * (1 - alpha) + _push_pull(images01, known) * alpha


def _push_pull(images: Tensor, known: Tensor) -> Tensor:
    """``images [N, C, H, W]`` filled where ``known [N, 1, H, W]`` is 0 from the known pixels around, coarse to fine."""
    if min(images.shape[-2:]) <= 2:
        total = known.sum((2, 3), keepdim=True)
        mean = (images * known).sum((2, 3), keepdim=True) / total.clamp(min=1e-6)
        return torch.where(known > 0, images, mean.expand_as(images))
    num = F.avg_pool2d(images * known, 2, ceil_mode=True)
    den = F.avg_pool2d(known, 2, ceil_mode=True)
    coarse = _push_pull(num / den.clamp(min=1e-6), (den > 0).to(images.dtype))
    up = F.interpolate(coarse, size=images.shape[-2:], mode="bilinear", align_corners=False)
    return images * known + up * (1 - known)


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
