"""Template matching: the window of an image most like an exemplar crop, by normalized cross-correlation at a few
scales (OpenCV's ``TM_CCOEFF_NORMED``, with torch ``conv2d``). The baseline the benchmarks compare with
(``models.experiments.baselines`` re-exports it), and the window ``rerank=templates`` adds to the second look's
candidates (``models.core.templates.Templates.match``). Pure tensor math, no model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

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
