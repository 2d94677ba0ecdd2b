"""Local refinement of an answer on a reward the job verified: a small coarse-to-fine search around the box.

The agent walks in steps of ``alpha`` of the box's side, so its last box can sit a step off the object even
when the reward orders boxes well: on kinds of objects the bundle never saw, once reward repair has made the
embedding faithful on the client's images, the ranking of ~950 boxes by that embedding finds the object far
more often than the greedy walk ends on it (BENCHMARKS.md, reward repair). Refinement keeps the agent's walk --
the object is found by the policy -- and then tries ``grid x grid`` shifts of the box's centre and ``grid``
scales of its size around its last box, keeps the one nearest the prototype, and repeats with smaller steps
(``rounds`` times, the steps shrinking by ``decay``). The candidates of every round include the current box,
so the answer's distance never grows.

Vectorized over the batch: each round is one RoIAlign + head call on the cached feature map for
``B x grid^3`` boxes; the backbone does not run again.

Serving uses it for checkpoints adapted on a repaired reward of a grayscale bundle (``models.bundle.Reward.refine``,
``models.repair.refines``): the guard scored those checkpoints with it, so what the job verified is what localize
answers. ``RefineConfig.aspect_rounds`` (off) also searches the box's shape; tried on validation glyphs, it changed
CorLoc by less than a point (BENCHMARKS.md, "Kinds no choice ever looked at"), so what is served keeps the shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from models.nets.embedding import RoIEmbedder


@dataclass(frozen=True)
class RefineConfig:
    rounds: int = 8
    grid: int = 3
    """Shifts per axis and scales per round (odd: the middle one keeps the box)."""
    shift: float = 0.3
    """The first round's shift, as a fraction of the box's width (x) and height (y)."""
    scale: float = 0.2
    """The first round's scales are ``1 +- k * scale`` (k up to ``grid // 2``)."""
    decay: float = 0.7
    """Shift and scale steps are multiplied by this after every round. The defaults were chosen on validation
    images of glyph jobs (BENCHMARKS.md, reward repair): 27 boxes a round, 216 in all."""
    aspect_rounds: int = 0
    """Rounds after ``rounds`` that change the box's shape instead of its size: widths times ``(1 + aspect)^k``
    and heights divided by it (``k`` in ``-(grid // 2) .. grid // 2``; the step decaying by ``decay``). 0: the
    boxes keep the agent's shape (a cMNIST bundle's: squares)."""
    aspect: float = 0.2
    """The first shape round's step."""

    def __post_init__(self) -> None:
        if self.rounds < 0 or self.aspect_rounds < 0 or self.grid < 1 or self.grid % 2 == 0:
            raise ValueError(f"refine needs rounds >= 0, aspect_rounds >= 0 and an odd grid >= 1, got rounds="
                             f"{self.rounds}, aspect_rounds={self.aspect_rounds}, grid={self.grid}")
        if not 0 < self.shift < 1 or not 0 < self.scale < 1 or not 0 < self.decay <= 1 or not 0 < self.aspect < 1:
            raise ValueError(f"refine's shift, scale and aspect must be in (0, 1) and its decay in (0, 1], got "
                             f"shift, scale, decay, aspect = {self.shift}, {self.scale}, {self.decay}, {self.aspect}")


def neighbours(boxes: Tensor, size: tuple[float, float], min_side: float, shift: float, scale: float, grid: int,
               aspect: float = 0.0) -> Tensor:
    """Boxes around ``boxes [B, 4]`` -> ``[B, grid^3, 4]``: centre shifts of ``k * shift`` times the box's width
    and height (``k`` in ``-(grid // 2) .. grid // 2``), sides scaled by ``1 + k * scale`` (``aspect`` > 0: the
    width times ``(1 + aspect)^k`` and the height divided by it instead), each side at least ``min_side`` (or the
    image's side) and the box moved inside the ``size = (width, height)`` image. The candidates are ordered by the
    x shift, then the y shift, then the third axis, each increasing (``refine`` keeps the first of equally near
    ones); the middle one (``grid^3 // 2``) is the box itself when it lies inside the image with sides >=
    ``min_side``."""
    w_img, h_img = float(size[0]), float(size[1])
    k = torch.arange(grid, device=boxes.device, dtype=boxes.dtype) - grid // 2
    third = (1 + aspect) ** k if aspect > 0 else 1 + k * scale
    dx, dy, ds = torch.meshgrid(k * shift, k * shift, third, indexing="ij")
    dx, dy, ds = dx.reshape(1, -1), dy.reshape(1, -1), ds.reshape(1, -1)  # [1, K]
    w, h = (boxes[:, 2] - boxes[:, 0])[:, None], (boxes[:, 3] - boxes[:, 1])[:, None]  # [B, 1]
    cx, cy = (boxes[:, 0:1] + boxes[:, 2:3]) / 2 + dx * w, (boxes[:, 1:2] + boxes[:, 3:4]) / 2 + dy * h
    nw = (w * ds).clamp(min=min(min_side, w_img), max=w_img)
    nh = (h * (1 / ds if aspect > 0 else ds)).clamp(min=min(min_side, h_img), max=h_img)
    x1 = torch.minimum((cx - nw / 2).clamp(min=0), w_img - nw)
    y1 = torch.minimum((cy - nh / 2).clamp(min=0), h_img - nh)
    return torch.stack([x1, y1, x1 + nw, y1 + nh], dim=-1)


def refine(embedder: RoIEmbedder, feats: Tensor, prototypes: Tensor, boxes: Tensor, distances: Tensor,
           size: tuple[float, float], min_side: float, cfg: RefineConfig | None = None) -> tuple[Tensor, Tensor]:
    """Refine ``boxes [B, 4]`` (input pixels, distances ``[B]`` to ``prototypes [B, D]`` or ``[D]``) on the feature
    maps ``feats [B, C, h, w]`` -> (boxes ``[B, 4]``, distances ``[B]``): per round the neighbour (``neighbours``)
    nearest the prototype, or the box kept when none is nearer (so the distance never grows)."""
    with torch.no_grad():
        cfg = cfg or RefineConfig()
        if prototypes.dim() == 1:
            prototypes = prototypes.expand(boxes.shape[0], -1)
        rows = torch.arange(boxes.shape[0], device=boxes.device)
        for r in range(cfg.rounds + cfg.aspect_rounds):
            f = cfg.decay ** r
            shape = cfg.aspect * cfg.decay ** (r - cfg.rounds) if r >= cfg.rounds else 0.0  # the shape, not the size
            cands = neighbours(boxes, size, min_side, cfg.shift * f, cfg.scale * f, cfg.grid, shape)  # [B, K, 4]
            d = (embedder.embed(feats, cands) - prototypes[:, None]).norm(dim=-1).to(distances.dtype)  # [B, K]
            best, k = d.min(dim=1)
            better = best < distances
            boxes = torch.where(better[:, None], cands[rows, k], boxes)
            distances = torch.where(better, best, distances)
        return boxes, distances
