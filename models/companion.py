"""A policy whose answers compete, image by image, with a ``Localizer``'s own (``Localizer(companion=...)``):
what a paired checkpoint serves (``models.bundle.Start``). The rules: the answer nearer the localizer's prototype,
a judge's pick (``feature_distances``), both heads' agreement (``Companion.agree``, the default pairing, format 4),
or the consensus of the job's checkpoints (``Companion.members``, ``consensus``, format 5). ``compete`` runs them
on the feature map the localizer's own episode ran on (the backbone once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from models.bundle import Start
from models.core.boxes import paired_iou
from models.nets.agent import Agent
from models.rollout import Rollout

if TYPE_CHECKING:
    from models.inference import Localizer


@dataclass(frozen=True)
class Companion:
    """Another policy whose answer competes with a ``Localizer``'s own, image by image: typically an adaptation
    job's starting policy, as that policy was served (its head, its prototype), beside a checkpoint adapted on a
    repaired reward. ``localizer`` must share the backbone of the localizer it accompanies (the same bundle,
    another head): it runs on the same feature map."""

    localizer: Localizer
    agent: Agent
    prototype: Tensor
    """``[D]`` or ``[B, D]``, under ``localizer``'s head."""
    judge: Tensor | None = None
    """``[C * s * s]``: the exemplars' mean RoI-pooled backbone feature (``models.repair.FeatureScorer``). Given,
    each image keeps the answer whose RoI feature has the higher cosine with it (``feature_distances``): a judge
    that neither policy was trained on. ``None``: the answer nearer the localizer's prototype under its head."""
    agree: bool = False
    """Each image keeps the localizer's own answer only where *both* heads prefer it: it is nearer the localizer's
    prototype under the localizer's head, and nearer this companion's ``prototype`` under the companion's head;
    elsewhere (ties included) the companion's answer. What a paired checkpoint serves (``models.bundle.Start``):
    on 20 photo jobs of fresh test seeds it kept more of the adapted policy's gain than the checkpoint alone and lost
    far less (BENCHMARKS.md, "The two heads' agreement, served"). With a ``judge`` too, the judge must prefer it as
    well (all three agree)."""
    members: tuple[Agent, ...] | None = None
    """The consensus rule (what a format-5 checkpoint serves, ``models.bundle.Start.consensus``): more agents, run
    under the *accompanied* localizer's head and prototype (an adaptation job's earlier checkpoints). Given, even
    empty, each image is answered by the consensus of the companion's answer, the members' and the localizer's own:
    the answer with the highest summed IoU with the others (ties: the companion's, then the earliest member's);
    ``agree`` and ``judge`` are then not used. On held-out photo classes it kept more of the adapted policy's gain than
    ``agree``, but where a job's checkpoints all drift to the same wrong boxes (real photographs) it follows them
    (BENCHMARKS.md, "Consensus of a job's checkpoints")."""


def start_companion(base: Localizer, start: Start) -> Companion:
    """The policy a paired checkpoint's job started from (``models.bundle.Start``), as it was served, for ``base`` (a
    localizer of the bundle's own head, no companion): the start's head or the bundle's, its agent or the bundle's,
    its prototype, under the agreement rule (``Companion.agree``)."""
    theirs = base if start.head is None else type(base)(base.bundle.with_head(start.head, start.refine), base.device,
                                                        fast_episode=base.fast_episode)
    members = None if start.consensus is None else tuple(base.agent(a) for a in start.consensus)
    return Companion(theirs, theirs.agent(start.agent), start.prototype.float(), agree=True, members=members)


def consensus(finals: Tensor) -> Tensor:
    """Each image's consensus among ``M`` answers ``finals [M, B, 4]`` -> ``[B]`` the index of the answer with the
    highest summed IoU with the others (ties: the lowest index)."""
    f = finals.permute(1, 0, 2).float()  # [B, M, 4]
    return paired_iou(f[:, :, None], f[:, None]).sum(-1).argmax(-1)


def feature_distances(roi: Tensor, reference: Tensor) -> Tensor:
    """``1 - cos`` of RoI-pooled backbone features ``roi [..., C, s, s]`` with ``reference`` (``C * s * s``
    values) -> ``[...]``."""
    ref = reference.flatten().to(roi.device, roi.dtype)
    return 1.0 - F.cosine_similarity(roi.flatten(-3), ref.expand(*roi.shape[:-3], -1), dim=-1)


def compete(mine: Localizer, c: Companion, ro: Rollout, feats: Tensor, proto: Tensor, nearest: bool) -> Rollout:
    """``mine``'s greedy rollout ``ro`` (``Localizer.run_features``, ``proto`` its prototype) with each image's
    episode replaced by companion ``c``'s where its answer (as it serves it) is nearer ``proto`` under ``mine``'s
    head, or, where ``c`` has a ``judge``, nearer the judge's reference feature, or, where ``c.agree``, unless both
    heads prefer ``mine``'s answer; the answer's distance is then its distance under ``mine``'s head (ties keep
    ``mine``'s own, but for ``agree``); with ``c.members``, the consensus rule instead (``_consensus``). One more
    episode per image on the same feature map, one head call (with ``agree`` one more, the companion's head on both
    answers; and one RoI read of both answers for a judge)."""
    theirs = c.localizer.run_features(feats, c.prototype, c.agent, nearest=nearest)
    dist = mine.box_distances(feats, theirs.boxes[-1], proto)
    if c.members is not None:
        return _consensus(mine, c, ro, theirs, dist, feats, proto, nearest)
    if c.agree:  # both heads must prefer mine: one more head call, the companion's, on both answers
        both = torch.stack([ro.boxes[-1], theirs.boxes[-1]], 1)  # [B, 2, 4]: mine, theirs
        cp = c.prototype.to(feats.device)
        under_theirs = (c.localizer.embedder.embed(feats, both) - (cp[:, None] if cp.dim() == 2 else cp)
                        ).norm(dim=-1)
        keep = (ro.distances[-1] < dist) & (under_theirs[:, 0] < under_theirs[:, 1])
        if c.judge is not None:
            judged = feature_distances(mine.embedder.roi(feats, both), c.judge)
            keep &= judged[:, 0] < judged[:, 1]
        take = ~keep
    elif c.judge is None:
        take = dist < ro.distances[-1]
    else:
        both = torch.stack([ro.boxes[-1], theirs.boxes[-1]], 1)  # [B, 2, 4]: mine, theirs
        judged = feature_distances(mine.embedder.roi(feats, both), c.judge)
        take = judged[:, 1] < judged[:, 0]

    def mix(mine: Tensor | None, other: Tensor | None) -> Tensor | None:  # time-major [T(+1), B, ...]
        if mine is None or other is None:
            return None
        return torch.where(take.view(1, -1, *([1] * (mine.dim() - 2))), other, mine)

    out = Rollout(*(mix(m, o) for m, o in zip(ro, theirs, strict=True)))
    return out._replace(distances=torch.cat([out.distances[:-1], torch.where(take, dist, ro.distances[-1])[None]]))


def _consensus(mine: Localizer, c: Companion, ro: Rollout, theirs: Rollout, dist: Tensor, feats: Tensor,
               proto: Tensor, nearest: bool) -> Rollout:
    """The consensus rule (``Companion.members``): each image's episode is the one, among the companion's
    (``theirs``, its final distance ``dist`` under ``mine``'s head), the members' (run here under ``mine``'s
    head and ``proto``) and ``mine``'s own (``ro``), whose answer overlaps the others' most (``consensus``).
    One more episode per member on the same feature map."""
    plain = type(mine)(mine.bundle, mine.device, fast_episode=mine.fast_episode)  # its head, no companion
    runs = [theirs._replace(distances=torch.cat([theirs.distances[:-1], dist[None]])),
            *(plain.run_features(feats, proto, a, nearest=nearest) for a in c.members or ()), ro]
    pick = consensus(torch.stack([r.boxes[-1] for r in runs]))  # [B]

    def chosen(fields: list[Tensor | None]) -> Tensor | None:  # time-major [T(+1), B, ...] each
        if any(f is None for f in fields):
            return None
        x = torch.stack(fields)  # type: ignore[arg-type]
        at = pick.to(x.device).view(1, 1, -1, *([1] * (x.dim() - 3))).expand(1, *x.shape[1:])
        return x.gather(0, at)[0]

    return Rollout(*(chosen([r[i] for r in runs]) for i in range(len(ro))))
