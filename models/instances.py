"""Several instances per image: the agent's answer first, then other objects found from several start windows.

The agent is trained to find one object from the whole image. To find the others, on the one feature map
the backbone computed (``feats``):

1. **Coarse windows.** A coarse grid of windows (``InstanceConfig.sides`` sizes from the bundle's minimum box
   side up, ``per_side`` positions per axis) is embedded and ranked by distance to the prototype: a cheap
   ranking.
2. **Episodes from the best windows.** The ``starts`` best windows that do not overlap each other (NMS) start
   one greedy episode each (from the window itself, or enlarged ``start_scale`` times), all batched as one
   rollout (an agent that does not read the prototype moves without embedding; the visited boxes are embedded
   at once after).
3. **Candidates.** Every box the episodes visit, every coarse window and the agent's usual answer (``answer``,
   its episode from the whole image) is a candidate, scored by its embedding distance to the prototype (lower
   is closer); non-maximum suppression (IoU ``nms_iou``) keeps up to ``k`` per image, best first. With
   ``answer_first`` the usual answer comes first whatever its distance and suppresses what overlaps it.

On images holding several objects the usual answer is often *between* them (an agent trained on one object per
image): forcing it first lowered AP50 on the validation images (BENCHMARKS.md, several instances), so by
default it competes on its distance like any other box.

The cost per image is ``evaluations`` head evaluations (one RoIAlign and head call each) plus ``starts * steps``
agent steps, on top of the usual answer; the backbone is not run again. Everything is batched over the
images: no loop over them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from models.config import EnvConfig
from models.core.boxes import box_area, candidate_boxes, clip_boxes, paired_intersection, top_k_per_image
from models.nets.agent import Agent
from models.nets.embedding import RoIEmbedder
from models.rollout import rollout, steer


@dataclass(frozen=True)
class InstanceConfig:
    """How the other instances are looked for (defaults chosen on validation images: BENCHMARKS.md)."""

    per_side: int = 7
    """Positions per axis of the coarse windows."""
    sides: int = 3
    """Window sizes of the coarse grid, geometric from the bundle's minimum box side to ``max_fraction``."""
    max_fraction: float = 0.6
    """Largest coarse window side, as a fraction of the image side."""
    max_aspect: float = 1.0
    """Aspect ratios of the coarse windows up to this (1: squares)."""
    starts: int = 8
    """Episodes per image, from the best coarse windows that do not overlap (NMS at ``nms_iou``)."""
    start_scale: float = 1.0
    """Each episode starts from its window enlarged this many times about its centre (clipped to the image)."""
    nms_iou: float = 0.3
    """Two answers overlapping more than this are one object: the closer one is kept."""
    answer_first: bool = False
    """The agent's usual answer is the first instance whatever its distance (and suppresses the boxes that overlap
    it); ``False``: it is one candidate among the others."""

    def __post_init__(self) -> None:
        if self.per_side < 1 or self.sides < 1 or self.starts < 0:
            raise ValueError("per_side and sides must be >= 1, starts >= 0")
        if not 0.0 < self.nms_iou <= 1.0 or self.start_scale < 1.0 or not 0.0 < self.max_fraction <= 1.0:
            raise ValueError("nms_iou and max_fraction must be in (0, 1], start_scale >= 1")


class Instances(NamedTuple):
    """Up to ``k`` answers per image, best first (the agent's usual answer is row 0 with ``answer_first``)."""

    boxes: Tensor      # [B, K, 4] input pixels; rows past an image's count repeat its first box
    distances: Tensor  # [B, K] embedding distance to the prototype (lower is closer); +inf past the count
    valid: Tensor      # [B, K] bool: False past the image's count (fewer objects than K were told apart)
    evaluations: int   # head evaluations per image beyond the usual answer: the compute, for comparisons


def coarse_windows(size: int, min_side: float, cfg: InstanceConfig) -> Tensor:
    """The coarse grid of windows on a ``size x size`` input -> ``[W, 4]``."""
    hi = max(float(min_side), cfg.max_fraction * size)
    stride = max(1, round((size - min_side) / max(1, cfg.per_side - 1))) if cfg.per_side > 1 else size
    return candidate_boxes(size, min_side, hi, sides=cfg.sides, stride=stride, max_aspect=cfg.max_aspect,
                           min_fraction=1.0)


def _enlarge(boxes: Tensor, scale: float, size: float) -> Tensor:
    centre, half = (boxes[..., :2] + boxes[..., 2:]) / 2, (boxes[..., 2:] - boxes[..., :2]) * scale / 2
    return clip_boxes(torch.cat([centre - half, centre + half], -1), size, size)


def find_instances(embedder: RoIEmbedder, agent: Agent, feats: Tensor, prototypes: Tensor, env: EnvConfig,
                   size: int, k: int, answer: Tensor, answer_distance: Tensor,
                   cfg: InstanceConfig | None = None) -> Instances:
    """Up to ``k`` instances in each image of ``feats [B, C, h, w]`` (the backbone's, computed once).

    ``prototypes``: ``[D]`` or ``[B, D]``; ``answer [B, 4]`` / ``answer_distance [B]``: the agent's usual answer
    (input pixels), a candidate (kept first with ``cfg.answer_first``). ``size``: the input side. The method: the
    module's docstring."""
    with torch.no_grad():
        cfg = cfg or InstanceConfig()
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        b, dev = feats.shape[0], feats.device
        protos = (prototypes if prototypes.dim() == 2 else prototypes.expand(b, -1)).to(dev)
        answer, answer_distance = answer.to(dev), answer_distance.to(dev)
        if k == 1:
            return Instances(answer[:, None], answer_distance[:, None], torch.ones(b, 1, dtype=torch.bool, device=dev),
                             0)
        windows = coarse_windows(size, env.min_side, cfg).to(dev)  # [W, 4]
        w = len(windows)
        emb = embedder.embed(feats, windows.expand(b, -1, -1))  # [B, W, D]
        wdist = (emb - protos[:, None]).norm(dim=-1)  # [B, W]
        image_w = torch.arange(b, device=dev).repeat_interleave(w)
        cand_boxes, cand_dist, evaluations = [windows.expand(b, -1, -1)], [wdist], w
        if cfg.starts > 0:
            s = min(cfg.starts, w)
            idx, ok = top_k_per_image(windows.repeat(b, 1), -wdist.flatten(), image_w, b, s, cfg.nms_iou)
            # An image with fewer separate windows than ``s`` repeats its best (a wasted episode, not a wrong one).
            idx = torch.where(ok, idx, idx[:, :1])
            starts = _enlarge(windows.repeat(b, 1)[idx.flatten()], cfg.start_scale, float(size))  # [B*s, 4]
            if agent.cfg.use_prototype:  # the agent reads each step's embedding: the episodes embed as they go
                ro = rollout(embedder, agent, feats, protos, env, (float(size), float(size)), deterministic=True,
                             rewards=True, episodes=s, starts=starts)
                steps = ro.boxes.shape[0]
                visited = ro.boxes.permute(1, 0, 2).reshape(b, s * steps, 4)  # [B, s*(T+1), 4]
                visited_dist = ro.distances.T.reshape(b, s * steps)
            else:  # the moves alone, then every visited box embedded at once (one head call, not one per step)
                path, _, _ = steer(embedder, agent, feats, starts, env, (float(size), float(size)))
                steps = path.shape[0]
                visited = path.permute(1, 0, 2).reshape(b, s * steps, 4)
                visited_dist = (embedder.embed(feats, visited) - protos[:, None]).norm(dim=-1)
            cand_boxes.append(visited)
            cand_dist.append(visited_dist)
            evaluations += s * steps
        boxes = torch.cat([answer[:, None]] + cand_boxes, 1)  # [B, M, 4]: the answer first
        first = torch.full((b, 1), -torch.inf, device=dev) if cfg.answer_first else answer_distance[:, None]
        dist = torch.cat([first] + cand_dist, 1)  # [B, M]; -inf: the answer outranks all
        m = boxes.shape[1]
        image = torch.arange(b, device=dev).repeat_interleave(m)
        idx, valid = top_k_per_image(boxes.reshape(-1, 4), -dist.reshape(-1), image, b, k, cfg.nms_iou)
        flat_boxes, flat_dist = boxes.reshape(-1, 4), dist.reshape(-1)
        out_boxes = torch.where(valid[..., None], flat_boxes[idx], answer[:, None])
        out_dist = torch.where(valid, flat_dist[idx], torch.inf)
        if cfg.answer_first:
            out_dist[:, 0] = answer_distance
        return Instances(out_boxes, out_dist, valid, evaluations)


CONTAINED = 0.6
"""What is answered drops an instance when more than this fraction of the smaller of it and a better-ranked kept
instance lies in both (intersection over the smaller box): a part of an object found again around or inside it,
which IoU, low for a small box in a large one (0.28 for half a digit), lets through NMS. Chosen on validation images
among 0.5-0.9 and none (``mnist-general``, queries 4 / 2 / 7 / 9, seeds 100-101: AP50 at K = 4 / 8 0.8782 / 0.8903
without, 0.8794 / 0.8928 with 0.6; BENCHMARKS.md, "Several instances"); not used by the candidate searches (NMS, the
second look), only on the answer."""


def kept_apart(boxes: Tensor, valid: Tensor, contained: float = CONTAINED) -> Tensor:
    """``boxes [B, K, 4]`` of each image's instances, best first, ``valid [B, K]`` -> which of them to answer:
    ``valid`` without those mostly inside or around a better kept one (``CONTAINED``). Greedy over the K ranks,
    every image at once."""
    inter = paired_intersection(boxes[:, :, None], boxes[:, None])  # [B, K, K]
    area = box_area(boxes)  # [B, K]
    smaller = torch.minimum(area[:, :, None], area[:, None, :]).clamp(min=1e-9)
    inside = inter / smaller > contained
    keep = valid.clone()
    for j in range(1, boxes.shape[1]):
        keep[:, j] &= ~(keep[:, :j] & inside[:, j, :j]).any(1)
    return keep
