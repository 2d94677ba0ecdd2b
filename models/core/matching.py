"""Template matching: the window of an image most like an exemplar crop, by normalized cross-correlation at a few
scales (OpenCV's ``TM_CCOEFF_NORMED``, with torch: ``conv2d`` per size, or one FFT product for a set's templates of
many sizes, ``best_windows``). The baseline the benchmarks compare with
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
    is under ``min_std`` (flat: a patch, the black canvas) and flat templates score 0 (``ncc_maps``).
    """
    return ncc_maps(images01, template[None], min_std)[:, 0]


def ncc_maps(images01: Tensor, templates: Tensor, min_std: float = 1e-3) -> Tensor:
    """``ncc_map`` of several templates of one size ``templates [E, C, h, w]`` -> ``[N, E, H - h + 1, W - w + 1]``.
    Window sums come from integral images (``window_sums``), once for all the templates (they share the windows);
    the dot products from one ``conv2d`` with a template per output channel (one call per size: per-template calls
    cost 5x on the CPU, each a single-channel convolution)."""
    e, c, h, w = templates.shape
    if images01.dim() != 4 or images01.shape[1] != c:
        raise ValueError(f"images must be [N, {c}, H, W] for a {c}-channel template; got {tuple(images01.shape)}")
    if h > images01.shape[-2] or w > images01.shape[-1]:
        raise ValueError(f"template {h}x{w} is larger than the images {tuple(images01.shape[-2:])}")
    t = templates.to(images01)
    t = t - t.mean(dim=(2, 3), keepdim=True)
    t_norm = t.square().sum(dim=(1, 2, 3)).sqrt()  # [E]
    n = h * w
    num = F.conv2d(images01, t)  # [N, E, H', W']: sum of t * window (t has zero mean: the window's mean drops out)
    s1, s2 = window_sums(images01, h, w)
    var = (s2 - s1.square() / n).sum(dim=1, keepdim=True).clamp(min=0)  # [N, 1, H', W']: squared deviations
    flat = (var < c * n * min_std ** 2) | (t_norm < min_std * (c * n) ** 0.5)[:, None, None]  # a flat template: 0
    score = num / (var.sqrt() * t_norm[:, None, None]).clamp(min=torch.finfo(num.dtype).tiny)
    return score.masked_fill(flat, 0.0).clamp(-1.0, 1.0)


def integral_images(images01: Tensor) -> Tensor:
    """``images01 [N, C, H, W]`` -> the integral images of the pixels and of their squares, ``[N, 2C, H + 1, W + 1]``
    float64 (a zero first row and column): any window's sums in four lookups (``box_sums``), whatever its size."""
    both = torch.cat([images01, images01.square()], dim=1).double()
    return F.pad(both.cumsum(-1).cumsum(-2), (1, 0, 1, 0))


def box_sums(integral: Tensor, h: int, w: int) -> Tensor:
    """The sums over every ``h x w`` window of integral images ``[..., H + 1, W + 1]`` -> ``[..., H - h + 1,
    W - w + 1]``."""
    return integral[..., h:, w:] - integral[..., :-h, w:] - integral[..., h:, :-w] + integral[..., :-h, :-w]


def window_sums(images01: Tensor, h: int, w: int) -> tuple[Tensor, Tensor]:
    """The sums of the pixels and of their squares over every ``h x w`` window of ``images01 [N, C, H, W]`` ->
    two ``[N, C, H - h + 1, W - w + 1]`` (``integral_images``, ``box_sums``)."""
    sums = box_sums(integral_images(images01), h, w).to(images01.dtype)
    c = images01.shape[1]
    return sums[:, :c], sums[:, c:]


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


MAX_CHUNK_ELEMENTS = 2 ** 21
"""``best_windows`` correlates at most this many (image, template, pixel) entries at once (16 MB in float64)."""


def best_windows(images01: Tensor, templates: list[Tensor], min_std: float = 1e-3) -> tuple[Tensor, Tensor]:
    """Each template's best window in each image: ``ncc_map`` of ``templates`` (each ``[C, h_e, w_e]``, any sizes no
    larger than the images) over ``images01 [N, C, H, W]`` -> (the best scores ``[N, E]``, their windows
    ``[N, E, 4]`` float32 ``x1, y1, x2, y2``; the first best position in raster order).

    The same numbers as ``ncc_map`` (to float64 rounding), at a fraction of its cost for a set's templates of many
    sizes: the dot products of every template at every position from one FFT product (each template zero-padded to
    the image: a circular cross-correlation, exact on the valid positions), the window sums from one integral image
    read at each template's size (``integral_images``, ``box_sums``); invalid positions masked. In chunks of images
    (``MAX_CHUNK_ELEMENTS``)."""
    with torch.no_grad():
        n, c, hh, ww = images01.shape
        e = len(templates)
        dev = images01.device
        hs = torch.tensor([t.shape[-2] for t in templates], device=dev)
        ws = torch.tensor([t.shape[-1] for t in templates], device=dev)
        padded = torch.zeros(e, c, hh, ww, dtype=torch.float64, device=dev)
        for k, t in enumerate(templates):  # a set's few templates: their zero-mean copies, padded to the image
            t64 = t.to(dev, torch.float64)
            padded[k, :, :t.shape[-2], :t.shape[-1]] = t64 - t64.mean(dim=(1, 2), keepdim=True)
        t_norm = padded.square().sum(dim=(1, 2, 3)).sqrt()  # [E]
        count = (hs * ws).double()  # [E]: pixels per window
        flat_t = t_norm < min_std * (c * count).sqrt()
        spectrum = torch.fft.rfft2(padded).conj()  # [E, C, H, W // 2 + 1]
        y = torch.arange(hh, device=dev)[None, :, None]
        x = torch.arange(ww, device=dev)[None, None, :]
        valid = (y <= hh - hs[:, None, None]) & (x <= ww - ws[:, None, None])  # [E, H, W]
        tops = torch.empty(n, e, dtype=images01.dtype, device=dev)
        boxes = torch.empty(n, e, 4, dtype=torch.float32, device=dev)
        step = max(1, MAX_CHUNK_ELEMENTS // (e * hh * ww))
        for at in range(0, n, step):  # chunks of images, for memory: each chunk one vectorized pass
            img = images01[at:at + step].double()
            num = torch.fft.irfft2((torch.fft.rfft2(img)[:, None] * spectrum[None]).sum(dim=2),
                                   s=(hh, ww))  # [n, E, H, W]
            ii = integral_images(img)  # [n, 2C, H + 1, W + 1]
            var = num.new_zeros(num.shape)  # [n, E, H, W]: each window's sum of squared deviations (0 off the valid)
            for k, (h, w) in enumerate(zip(hs.tolist(), ws.tolist(), strict=True)):  # per template: four slices
                sums = box_sums(ii, h, w)  # [n, 2C, H', W']
                var[:, k, :hh - h + 1, :ww - w + 1] = (sums[:, c:] - sums[:, :c].square() / (h * w)).sum(dim=1)
            var = var.clamp(min=0)
            flat = (var < c * count[:, None, None] * min_std ** 2) | flat_t[:, None, None]
            score = (num / (var.sqrt() * t_norm[:, None, None]).clamp(min=torch.finfo(torch.float64).tiny))
            score = score.masked_fill(flat, 0.0).clamp(-1.0, 1.0).masked_fill(~valid, -torch.inf)
            top, idx = score.flatten(2).max(dim=2)  # [n, E]
            bx, by = (idx % ww).float(), torch.div(idx, ww, rounding_mode="floor").float()
            tops[at:at + step] = top.to(tops.dtype)
            boxes[at:at + step] = torch.stack([bx, by, bx + ws.float(), by + hs.float()], dim=-1)
        return tops, boxes


def template_matching(images01: Tensor, crops: list[Tensor], scales: tuple[float, ...] = TEMPLATE_SCALES,
                      ref_side: float | None = None, min_std: float = 1e-3, return_scores: bool = False
                      ) -> Tensor | tuple[Tensor, Tensor]:
    """The template-matching baseline: for each image of ``images01 [N, C, S, S]`` (in [0, 1]) the window
    whose normalized cross-correlation (``ncc_map``) with one of the exemplar ``crops [C, h, w]`` at one of
    the ``scales`` (``scaled_template``) is highest -> boxes ``[N, 4]`` in input pixels (``x1, y1, x2, y2``,
    integer edges; with ``return_scores`` also the scores ``[N]``).

    Vectorized over the images and the templates (``best_windows``: every template's correlation in one FFT
    product). Templates larger than the images are skipped; ties keep the first exemplar, then the smallest scale,
    then the first position in raster order.
    """
    with torch.no_grad():
        if not crops:
            raise ValueError("template matching needs at least one exemplar crop")
        n, _, hh, ww = images01.shape
        templates = [t for crop in crops for s in sorted(scales)  # in the tie-breaking order
                     if (t := scaled_template(crop, s, ref_side).to(images01)).shape[-2] <= hh and t.shape[-1] <= ww]
        if not templates:
            raise ValueError(f"every template is larger than the images {hh}x{ww}")
        tops, boxes = best_windows(images01, templates, min_std)
        best, first = tops.max(dim=1)  # the first of the best: the earlier exemplar, then the smaller scale
        chosen = boxes[torch.arange(n, device=boxes.device), first]
        return (chosen, best) if return_scores else chosen
