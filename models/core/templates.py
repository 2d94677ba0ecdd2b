"""Template matching on boxes: normalized cross-correlation (NCC) of a box's content with small templates.

The crops of an exemplar set (and its negative exemplars) as ``TEMPLATE_SIDE x TEMPLATE_SIDE`` 8-bit templates,
and each box read a few ways (``jittered``) and compared with every template at once (``box_ncc``: one
``roi_align`` and one matrix product): what the calibration reads beside the embedding (``models.calibration``),
and one of the rewards a job may choose on its probes (``models.repair``). Pure tensor math, no model.
"""

from __future__ import annotations

import base64
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from models.core.matching import scaled_template, template_matching

TEMPLATE_SIDE = 16
"""Templates and box contents are compared at ``TEMPLATE_SIDE x TEMPLATE_SIDE`` (aspect not kept: both sides are
resampled the same way)."""
JITTER = 0.1
"""The box is read 27 ways (``jittered``: shifted by up to ``JITTER`` of its width / height, scaled by
``1 +- JITTER``); the best read is its NCC with a template: an answer a few pixels off the object still
correlates (on cMNIST validation images, 4s vs other digits: AUROC 0.77 for the box as is, 0.93 with these reads
and the mean over the exemplars)."""


def zero_mean_unit(x: Tensor, min_std: float = 1e-3) -> Tensor:
    """``[..., C, h, w]`` -> each less its per-channel mean, divided by its norm (flat ones: all zero), flattened
    to ``[..., C * h * w]`` -- so a dot product of two of them is their NCC (OpenCV's ``TM_CCOEFF_NORMED``)."""
    x = x.double()
    x = (x - x.mean(dim=(-2, -1), keepdim=True)).flatten(-3)
    norm = x.norm(dim=-1, keepdim=True)
    return torch.where(norm > min_std * x.shape[-1] ** 0.5, x / norm.clamp(min=1e-12), torch.zeros_like(x))


MATCH_SIDE = 64
"""Crops kept for template matching (``Templates.crops``) are at most this long a side (larger ones downscaled)."""


def match_crops(crops: list[Tensor], side: int = MATCH_SIDE) -> tuple[list[Tensor], list[tuple[int, int]]]:
    """Crops ``[C, h, w]`` in [0, 1] as uploaded -> (the crops kept for template matching, on the 8-bit grid, long
    side at most ``side``; each one's ``(h, w)`` as uploaded)."""
    kept, sizes = [], []
    for c in crops:  # a set's few crops
        h, w = c.shape[-2:]
        small = scaled_template(c, 1.0, ref_side=min(side, max(h, w)))  # downscaled only past ``side``
        kept.append((small.float().clamp(0, 1) * 255).round() / 255)
        sizes.append((int(h), int(w)))
    return kept, sizes


def make_templates(crops: list[Tensor], side: int = TEMPLATE_SIDE) -> Tensor:
    """Crops ``[C, h_i, w_i]`` in [0, 1] -> templates ``[E, C, side, side]`` (float32 on a 1/255 grid; bilinear,
    antialiased)."""
    if not crops:
        return torch.zeros(0, 1, side, side)
    t = torch.stack([torch.nn.functional.interpolate(c[None].float(), size=(side, side), mode="bilinear",
                                                     antialias=True, align_corners=False)[0] for c in crops])
    return (t.clamp(0, 1) * 255).round() / 255  # 8 bits, as stored (``Templates.to_dict``): fit and use see the same


def jittered(boxes: Tensor, jitter: float = JITTER) -> Tensor:
    """Boxes ``[..., 4]`` -> ``[..., 27, 4]``: each shifted by ``-jitter, 0, +jitter`` of its width along x and of
    its height along y and scaled by ``1 - jitter, 1, 1 + jitter`` about its centre (``jitter`` 0: ``[..., 1, 4]``,
    the box alone). The 27 reads in the order x shift, y shift, scale (the last fastest); one broadcast per
    coordinate, not a loop (it is on every localize request of a calibrated grayscale set)."""
    if jitter <= 0:
        return boxes[..., None, :]
    g = _jitter_grid(jitter, boxes.dtype, boxes.device)  # [27, 3]: x shift, y shift (of the side), scale
    x1, y1, x2, y2 = boxes[..., None, :].unbind(-1)  # each [..., 1]
    w, h = x2 - x1, y2 - y1
    ncx, ncy = (x1 + x2) / 2 + g[:, 0] * w, (y1 + y2) / 2 + g[:, 1] * h
    hw, hh = g[:, 2] * w / 2, g[:, 2] * h / 2
    return torch.stack([ncx - hw, ncy - hh, ncx + hw, ncy + hh], -1)


@functools.lru_cache(maxsize=16)
def _jitter_grid(jitter: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.tensor([[dx * jitter, dy * jitter, k] for dx in (-1, 0, 1) for dy in (-1, 0, 1)
                         for k in (1 - jitter, 1.0, 1 + jitter)], dtype=dtype, device=device)


def box_contents(images01: Tensor, boxes: Tensor, side: int) -> Tensor:
    """The content of each box ``boxes [n, K, 4]`` (pixels of ``images01 [n, C, H, W]``) resampled to
    ``[n, K, C, side, side]`` (``torchvision.ops.roi_align``, aligned, adaptive sampling: an average over each
    bin, so a large box is antialiased; outside the image: 0)."""
    from torchvision.ops import roi_align

    n, k = boxes.shape[:2]
    if n == 0 or k == 0:
        return images01.new_zeros(n, k, images01.shape[1], side, side)
    rois = torch.cat([torch.arange(n, dtype=images01.dtype, device=images01.device).repeat_interleave(k)[:, None],
                      boxes.reshape(-1, 4).to(images01)], dim=1)
    return roi_align(images01.float(), rois.float(), (side, side), 1.0, -1, True).view(n, k, -1, side, side)


def box_ncc(images01: Tensor, boxes: Tensor, templates: Tensor, *, jitter: float = JITTER) -> Tensor:
    """NCC of the content of each box ``boxes [n, K, 4]`` (pixels of ``images01 [n, C, H, W]``) with each template
    ``templates [E, C, s, s]`` -> ``[n, K, E]`` in [-1, 1] (the best of the box's ``jittered`` reads; a flat box
    or template: 0). Vectorized: one ``roi_align`` and one matrix product for every box and template."""
    with torch.no_grad():
        return box_ncc_sets(images01, boxes, [templates], jitter=jitter)[0]


def box_ncc_sets(images01: Tensor, boxes: Tensor, sets: list[Tensor], *, jitter: float = JITTER) -> list[Tensor]:
    """``box_ncc`` with each of several sets of templates of one side (``[E_i, C, s, s]`` each) -> ``[n, K, E_i]``
    each: the boxes are read once (one ``roi_align``), then one matrix product per set (each the same numbers as
    ``box_ncc`` alone)."""
    n, k = boxes.shape[:2]
    if all(len(t) == 0 for t in sets):
        return [torch.zeros(n, k, 0, dtype=torch.float64) for _ in sets]
    side = next(t for t in sets if len(t)).shape[-1]
    jb = jittered(boxes.float(), jitter)  # [n, K, J, 4]
    j = jb.shape[2]
    content = zero_mean_unit(box_contents(images01, jb.reshape(n, k * j, 4), side))  # [n, K*J, D]
    out = []
    for templates in sets:  # a set or two (the exemplars, the negatives)
        if len(templates) == 0:
            out.append(torch.zeros(n, k, 0, dtype=torch.float64))
            continue
        t = zero_mean_unit(templates.to(content.device))  # [E, D]
        out.append((content @ t.T).view(n, k, j, len(t)).amax(dim=2).clamp(-1, 1))
    return out


def mean_ncc(ncc: Tensor, exclude: Tensor | None = None) -> Tensor:
    """``[n, E]`` NCCs -> their mean over the templates ``[n]``, leaving out for row ``i`` the template
    ``exclude[i]`` where it is ``>= 0`` (leave-one-out; a row with nothing left: 0). The mean, not the max:
    one exemplar that happens to look like another object weighs 1/E (AUROC 0.93 vs 0.92 for the max, cMNIST
    validation)."""
    n, e = ncc.shape
    if e == 0:
        return torch.zeros(n, dtype=torch.float64)
    keep = torch.ones_like(ncc, dtype=torch.float64)
    if exclude is not None:
        rows = (exclude >= 0).nonzero().flatten()
        keep[rows, exclude[rows]] = 0.0
    count = keep.sum(-1)
    mean = (ncc.double() * keep).sum(-1) / count.clamp(min=1)
    return torch.where(count > 0, mean, torch.zeros(n, dtype=torch.float64))


def source_template(images01: Tensor, true_boxes: Tensor, templates: Tensor, *, min_ncc: float = 0.5) -> Tensor:
    """Which template each sample was made from: the one whose NCC with the content of the sample's *true* box
    ``true_boxes [n, 4]`` (NaN: none) is highest, if at least ``min_ncc`` -> ``[n]`` (-1: none). A pasted crop
    matches its own template closely (only resampling and the feathered border differ), a labeled example's box
    is the crop it gave: used where the source is not known (labeled examples, a job's probes; pasted samples
    carry theirs, ``LabeledImages.sources``)."""
    out = torch.full((len(images01),), -1, dtype=torch.long)
    ok = ~true_boxes.isnan().any(-1)
    if len(templates) == 0 or not bool(ok.any()):
        return out
    ncc = box_ncc(images01[ok], true_boxes[ok][:, None], templates, jitter=0.0)[:, 0]  # [m, E]
    best, idx = ncc.max(dim=-1)
    out[ok] = torch.where(best >= min_ncc, idx, torch.full_like(idx, -1))
    return out


@dataclass
class Templates:
    """What the NCC features need at answer time, stored with the calibration (no file read per request): the
    exemplar crops (and the negative exemplars') as ``side x side`` 8-bit templates, and how answers' boxes are
    read -- on the image resized to the bundle's input ``size`` (``models.inference.preprocess``), ``channels``
    and ``fill`` for the conversion. 5 gray exemplars: 1.3 kB of base64; 64 RGB ones: 65 kB."""

    exemplars: Tensor
    negatives: Tensor | None
    size: int
    channels: int
    fill: tuple[float, ...]
    jitter: float = JITTER
    crops: list[Tensor] | None = None
    """The exemplar crops for template matching (``match``): each ``[C, h, w]`` on the 8-bit grid, its long side at
    most ``MATCH_SIDE`` (``match_crops``); ``None`` in calibrations made before they were kept."""
    crop_sizes: list[tuple[int, int]] | None = None
    """Each crop's ``(h, w)`` as uploaded (pixels of the image it was cut from)."""

    def to_dict(self) -> dict[str, Any]:
        def enc(t: Tensor) -> str:
            return base64.b64encode((t.clamp(0, 1) * 255).round().to(torch.uint8).numpy().tobytes()).decode()

        out = {"side": int(self.exemplars.shape[-1]), "channels": self.channels, "size": self.size,
               "fill": list(self.fill), "jitter": self.jitter, "count": len(self.exemplars),
               "exemplars": enc(self.exemplars),
               "negative_count": 0 if self.negatives is None else len(self.negatives),
               "negatives": None if self.negatives is None else enc(self.negatives)}
        if self.crops is not None and self.crop_sizes is not None:
            out["crops"] = [{"shape": list(c.shape), "size": list(hw), "data": enc(c)}
                            for c, hw in zip(self.crops, self.crop_sizes, strict=True)]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Templates:
        side, c = int(d["side"]), int(d["channels"])

        def dec(text: str, n: int) -> Tensor:
            raw = bytearray(base64.b64decode(text))
            return torch.frombuffer(raw, dtype=torch.uint8).float().view(n, c, side, side) / 255

        neg = dec(d["negatives"], int(d["negative_count"])) if d.get("negatives") else None
        crops = [torch.frombuffer(bytearray(base64.b64decode(k["data"])), dtype=torch.uint8).float().view(
            *[int(v) for v in k["shape"]]) / 255 for k in d["crops"]] if d.get("crops") else None
        sizes = [(int(k["size"][0]), int(k["size"][1])) for k in d["crops"]] if d.get("crops") else None
        return cls(dec(d["exemplars"], int(d["count"])), neg, int(d["size"]), c, tuple(d["fill"]),
                   float(d.get("jitter", JITTER)), crops, sizes)

    def match(self, images01: Tensor, scales: Tensor) -> Tensor:
        """Template matching's best window in each image of ``images01 [n, C, size, size]`` (the images resized to
        the input: ``scales [n, 2]`` = (w_i / size, h_i / size)) -> boxes ``[n, 4]`` in input pixels, NaN where
        there is none (no crops kept, every template larger than the image). Each crop is matched at its uploaded
        size in the image's pixels (as the benchmarks' baseline: exemplars cut from images of the same
        resolution), at the baseline's scales; one ``models.core.matching.template_matching`` per distinct scale
        of the images (usually one)."""
        out = torch.full((len(images01), 4), torch.nan)
        if not self.crops or self.crop_sizes is None or not len(images01):
            return out
        keys = [tuple(round(float(v), 6) for v in row) for row in scales]
        for key in dict.fromkeys(keys):  # distinct scales, in order
            rows = [i for i, k in enumerate(keys) if k == key]
            sx, sy = key
            crops = [torch.nn.functional.interpolate(c[None], size=(max(2, round(h / sy)), max(2, round(w / sx))),
                                                     mode="bilinear", antialias=True, align_corners=False)[0]
                     .clamp(0, 1) for c, (h, w) in zip(self.crops, self.crop_sizes, strict=True)]
            try:
                out[rows] = template_matching(images01[rows].float(), crops).to(out)
            except ValueError:  # every template larger than the images
                continue
        return out

    def ncc(self, images01: Tensor, boxes: Tensor) -> tuple[Tensor, Tensor | None]:
        """Boxes ``[n, K, 4]`` (pixels of ``images01 [n, C, size, size]``) -> the mean NCC with the exemplars
        ``[n, K]`` and with the negatives ``[n, K]`` (None without negatives): the test-time features, over
        every template."""
        n, k = boxes.shape[:2]
        with_negatives = self.negatives is not None and len(self.negatives) > 0
        sets = [self.exemplars, self.negatives] if with_negatives else [self.exemplars]
        read = [mean_ncc(x.view(n * k, -1)).view(n, k)  # the boxes read once for both sets
                for x in box_ncc_sets(images01, boxes, sets, jitter=self.jitter)]  # type: ignore[arg-type]
        return read[0], read[1] if with_negatives else None
