"""The samples a set's calibration is fitted on, made from its crops without labels from the user
(``models.calibration``): positives, the crops pasted into backgrounds at random places and scales (exact boxes,
``models.data.probes``), plus the set's labeled examples; negatives, the backgrounds alone, with the user's
negative exemplars and stand-ins for other objects (the crops transformed or scrambled) pasted into them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from models.config import InputSpec
from models.core.templates import make_templates, zero_mean_unit
from models.data.probes import paste_probes
from models.data.types import LabeledImages

PROBE_SCALE = (0.85, 1.15)
"""Pasted crops' long side, as a factor of the bundle's ``exemplar_size``: near the scale the agent sees objects
(``models.guard``'s probes range wider, 0.6-1.2, to compare policies; here the answers' scores should look like
those of real objects, and small pastes score far worse than real objects do on cMNIST)."""



def synthetic_backgrounds(crops: list[Tensor], spec: InputSpec, n: int, generator: torch.Generator,
                          *, tile: int | None = None) -> Tensor:
    """``n`` images ``[n, C, S, S]`` with no object on them, made from what a new set has: the bundle's fill,
    mild noise, a few flat rectangles, and small tiles cut at random from the exemplar crops and scattered
    (the domain's strokes and textures without the object's shape)."""
    s, c = spec.size, spec.channels
    tile = tile or max(3, spec.exemplar_size // 4)
    fill = torch.tensor(spec.fill, dtype=torch.float32).view(1, c, 1, 1)
    out = (fill + 0.04 * torch.randn(n, c, s, s, generator=generator)).clamp(0, 1)
    crops = [cr.float().clamp(0, 1) for cr in crops if cr.shape[0] == c]
    for i in range(n):  # once per calibration: not a request path
        for _ in range(int(torch.randint(1, 4, (1,), generator=generator))):
            w, h = (int(v) for v in torch.randint(s // 6, s // 2, (2,), generator=generator))
            x, y = (int(v) for v in torch.randint(0, s - max(w, h) + 1, (2,), generator=generator))
            out[i, :, y:y + h, x:x + w] = torch.rand(c, 1, 1, generator=generator) * 0.8 + 0.1
        for _ in range(int(torch.randint(4, 17, (1,), generator=generator)) if crops else 0):
            cr = crops[int(torch.randint(len(crops), (1,), generator=generator))]
            ch, cw = cr.shape[-2:]
            k = spec.exemplar_size / max(ch, cw)  # at the scale objects are seen
            th, tw = max(1, min(ch, round(tile / k))), max(1, min(cw, round(tile / k)))
            fy, fx = int(torch.randint(0, ch - th + 1, (1,), generator=generator)), int(
                torch.randint(0, cw - tw + 1, (1,), generator=generator))
            patch = torch.nn.functional.interpolate(cr[None, :, fy:fy + th, fx:fx + tw], size=(tile, tile),
                                                    mode="bilinear", align_corners=False)[0]
            x, y = (int(v) for v in torch.randint(0, s - tile + 1, (2,), generator=generator))
            out[i, :, y:y + tile, x:x + tile] = torch.maximum(out[i, :, y:y + tile, x:x + tile], patch) \
                if spec.fill[0] < 0.5 else torch.minimum(out[i, :, y:y + tile, x:x + tile], patch)
    return out.clamp(0, 1)


def transformed_crops(crops: list[Tensor], templates: Tensor, *, max_ncc: float = 0.8) -> list[Tensor]:
    """Each crop rotated by 90, 180, 270 degrees and flipped left-right and upside down: the object's strokes in
    other shapes, stand-ins for other objects of the domain whose NCC with the exemplars is as high as real
    ones' (cMNIST validation: median 0.45 vs 0.46 for real other digits, 0.30 for scrambled crops). A transform
    that still looks like an exemplar (NCC with one of ``templates`` >= ``max_ncc``: a symmetric object) is
    left out: it is the object, not another."""
    out = []
    t = zero_mean_unit(templates)
    for c in crops:
        for tc in (*(torch.rot90(c, k, (1, 2)) for k in (1, 2, 3)), c.flip(-1), c.flip(-2)):
            if float((zero_mean_unit(make_templates([tc], templates.shape[-1]))[0] @ t.T).max()) < max_ncc:
                out.append(tc.contiguous())
    return out


def scrambled_crops(crops: list[Tensor], generator: torch.Generator, per_crop: int = 4) -> list[Tensor]:
    """Each crop cut into a 2x2 or 3x3 grid whose cells are shuffled (never the identity), ``per_crop`` times:
    the object's own strokes and colours without its shape, stand-ins for *other* objects of the domain (an
    empty background alone is far easier to reject than another object: cMNIST's other digits score much
    closer to a 4's prototype than gray patches do)."""
    out = []
    for c in crops:
        for j in range(per_crop):
            k = 2 + j % 2
            ch, h, w = c.shape
            hs, ws = h // k, w // k
            if hs < 1 or ws < 1:
                continue
            cells = c[:, :hs * k, :ws * k].reshape(ch, k, hs, k, ws).permute(1, 3, 0, 2, 4).reshape(k * k, ch, hs, ws)
            perm = torch.randperm(k * k, generator=generator)
            if bool((perm == torch.arange(k * k)).all()):
                perm = perm.roll(1)
            out.append(cells[perm].reshape(k, k, ch, hs, ws).permute(2, 0, 3, 1, 4).reshape(ch, k * hs, k * ws))
    return out


@dataclass
class Samples:
    """What a calibration is fit on: positives (images with the object's box) and negative images."""

    positives: LabeledImages
    negatives: Tensor
    negative_boxes: Tensor | None = None
    """``[m, 4]``: the box of the look-alike pasted in each negative (NaN where none), to leave it out of its
    NCC with the negative templates."""
    shapes: Tensor | None = None
    """More negatives for the NCC fits only (``transformed_crops`` pasted): other shapes of the domain."""
    negative_sources: Tensor | None = None
    """``[m]``: the negative exemplar pasted in each negative (-1: none or not known)."""
    negative_objects: Tensor | None = None
    """``[m]`` bool: the negative holds another object (a scrambled exemplar, a look-alike), not background only."""


def make_samples(crops: list[Tensor], backgrounds01: Tensor, n: int, *, object_side: float,
                 generator: torch.Generator, negative_crops: list[Tensor] | None = None,
                 labeled: LabeledImages | None = None) -> Samples:
    """``n`` positives (``crops`` pasted into ``backgrounds01``, plus the ``labeled`` examples) and ``n``
    negatives: the backgrounds as they are, scrambled exemplars pasted (``scrambled_crops``), and with
    ``negative_crops`` the user's look-alikes pasted (a third each; without look-alikes, half and half)."""
    pos = paste_probes(crops, backgrounds01, n, object_side=object_side, scale=PROBE_SCALE, generator=generator)
    if labeled is not None and len(labeled):
        pos = LabeledImages(torch.cat([labeled.images, pos.images]), torch.cat([labeled.boxes, pos.boxes]),
                            sources=torch.cat([torch.full((len(labeled),), -1, dtype=torch.long), pos.sources]))
    n_look = n // 3 if negative_crops else 0
    n_scr = (n - n_look) // 2
    plain = backgrounds01[torch.randint(len(backgrounds01), (n - n_look - n_scr,), generator=generator)]
    parts = [plain]
    boxes = [torch.full((len(plain), 4), torch.nan)]
    sources = [torch.full((len(plain),), -1, dtype=torch.long)]
    objects = [torch.zeros(len(plain), dtype=torch.bool)]
    for these, k, known in ((scrambled_crops(crops, generator), n_scr, False), (negative_crops, n_look, True)):
        if k and these:
            pasted = paste_probes(these, backgrounds01, k, object_side=object_side, scale=PROBE_SCALE,
                                  generator=generator)
            parts.append(pasted.images)
            boxes.append(pasted.boxes if known else torch.full((k, 4), torch.nan))
            sources.append(pasted.sources if known else torch.full((k,), -1, dtype=torch.long))
            objects.append(torch.ones(k, dtype=torch.bool))
    return Samples(pos, torch.cat(parts), torch.cat(boxes), negative_sources=torch.cat(sources),
                   negative_objects=torch.cat(objects))
