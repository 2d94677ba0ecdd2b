"""Ordinal embedding: group-based IoU-bin pair sampling, anchors, triplet loss, OrdAcc.

For two boxes j, k around the ground truth g the embedding should satisfy
IoU(j, g) > IoU(k, g)  <=>  ||f(j) - a|| < ||f(k) - a||  for the anchor a.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from models.core.boxes import paired_iou

ANCHORS = ("self", "proto", "shuffle_proto")


class BoxPairs(NamedTuple):
    """``P`` pairs per image: ``pos`` has the larger IoU with the ground truth, ``neg`` the smaller."""

    pos: Tensor      # [B, P, 4]
    neg: Tensor      # [B, P, 4]
    pos_iou: Tensor  # [B, P]
    neg_iou: Tensor  # [B, P]


def sample_pairs(gt: Tensor, candidates: Tensor, pairs: int, bins: int = 10,
                 generator: torch.Generator | None = None) -> BoxPairs:
    """Group-based sampling: bin ``candidates [K, 4]`` by IoU with ``gt [B, 4]`` into ``bins`` bins of
    equal width, pick two distinct non-empty bins, then one box from each -> ``pairs`` pairs per image."""
    b = gt.shape[0]
    iou = paired_iou(candidates[None], gt[:, None])  # [B, K]
    bin_of = (iou * bins).floor().clamp(max=bins - 1).long()  # [B, K]
    nonempty = torch.zeros(b, bins, device=gt.device).scatter_(1, bin_of, 1.0)  # [B, M]
    if bool((nonempty.sum(1) < 2).any()):
        raise ValueError("every image needs candidates in at least two IoU bins")
    chosen = torch.multinomial(nonempty.repeat_interleave(pairs, 0), 2, generator=generator)  # [B*P, 2]
    bin_p = bin_of.repeat_interleave(pairs, 0)  # [B*P, K]
    pick = [torch.multinomial((bin_p == chosen[:, i:i + 1]).float(), 1, generator=generator)  # [B*P, 1]
            for i in range(2)]
    iou_p = iou.repeat_interleave(pairs, 0)
    i0, i1 = (iou_p.gather(1, p).squeeze(1) for p in pick)
    first_pos = i0 > i1
    pos_idx = torch.where(first_pos, pick[0].squeeze(1), pick[1].squeeze(1))
    neg_idx = torch.where(first_pos, pick[1].squeeze(1), pick[0].squeeze(1))
    return BoxPairs(candidates[pos_idx].view(b, pairs, 4), candidates[neg_idx].view(b, pairs, 4),
                    torch.maximum(i0, i1).view(b, pairs), torch.minimum(i0, i1).view(b, pairs))


def group_prototypes(gt_emb: Tensor, group_size: int, shuffle: bool, generator: torch.Generator | None = None
                     ) -> Tensor:
    """Anchors from ground-truth embeddings ``gt_emb [B, D]`` -> ``[B, D]``.

    Images are randomly split into groups of ``group_size``; each image's anchor is the mean of its own
    group (``proto``) or, with ``shuffle``, of the next group (``shuffle_proto``), which never holds it.
    """
    b = gt_emb.shape[0]
    groups = max(1, b // group_size)
    if shuffle and groups < 2:
        raise ValueError(f"shuffle_proto needs at least 2 groups of {group_size}; batch is {b}")
    perm = torch.randperm(b, generator=generator, device="cpu").to(gt_emb.device)
    group_of = torch.empty(b, dtype=torch.long, device=gt_emb.device)
    group_of[perm] = torch.arange(b, device=gt_emb.device) % groups
    sums = torch.zeros(groups, gt_emb.shape[1], device=gt_emb.device, dtype=gt_emb.dtype).index_add(0, group_of, gt_emb)
    counts = torch.bincount(group_of, minlength=groups).clamp(min=1).to(gt_emb.dtype)
    protos = sums / counts[:, None]  # [G, D]
    target = (group_of + 1) % groups if shuffle else group_of
    return protos[target]


def anchors_for(kind: str, gt_emb: Tensor, group_size: int, generator: torch.Generator | None = None) -> Tensor:
    """``self`` | ``proto`` | ``shuffle_proto`` anchors for ``gt_emb [B, D]`` -> ``[B, D]``."""
    if kind == "self":
        return gt_emb
    if kind not in ANCHORS:
        raise ValueError(f"anchor must be one of {ANCHORS}, got {kind!r}")
    return group_prototypes(gt_emb, group_size, kind == "shuffle_proto", generator)


def triplet_loss(anchor: Tensor, pos: Tensor, neg: Tensor, margin: float) -> Tensor:
    """``mean(max(m + d(a, p) - d(a, n), 0))`` for ``anchor [B, D]``, ``pos``/``neg [B, P, D]`` (L2)."""
    d_pos = (pos - anchor[:, None]).norm(dim=-1)
    d_neg = (neg - anchor[:, None]).norm(dim=-1)
    return torch.relu(margin + d_pos - d_neg).mean()


def kind_margin_loss(emb: Tensor, own: Tensor, other: Tensor, margin: float) -> Tensor:
    """The cross-kind term on data of several kinds: each ground-truth box embedding ``emb [B, D]`` should be nearer
    its own kind's anchor ``own [B, D]`` than another kind's prototype ``other [D]`` by ``margin`` ->
    ``mean(max(m + d(e, own) - d(e, other), 0))`` (L2)."""
    near = (emb - own).norm(dim=-1)
    far = (emb - other).norm(dim=-1)
    return torch.relu(margin + near - far).mean()


def ordinal_accuracy(anchor: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
    """% of pairs ordered by distance to ``anchor [B, D]`` as by IoU (``pos`` closer) -> scalar."""
    d_pos = (pos - anchor[:, None]).norm(dim=-1)
    d_neg = (neg - anchor[:, None]).norm(dim=-1)
    return (d_pos < d_neg).float().mean() * 100


def class_batches(classes: Tensor, batch_size: int, drop_last: bool, generator: torch.Generator | None = None
                  ) -> list[Tensor]:
    """Minibatches of data of several kinds (``classes [N]`` long), each of one kind: every kind's images shuffled
    and cut into ``batch_size`` (a last, smaller one of each kind dropped with ``drop_last``), the batches then
    shuffled -> index tensors. Group anchors (``group_prototypes``) taken within a batch are then of the
    image's own kind."""
    out = []
    for c in classes.unique().tolist():
        idx = (classes == c).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=generator)]
        stop = len(idx) - batch_size + 1 if drop_last else len(idx)
        out += [idx[i:i + batch_size] for i in range(0, max(0, stop), batch_size)]
    order = torch.randperm(len(out), generator=generator).tolist()
    return [out[i] for i in order]
