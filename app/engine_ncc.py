"""What the local engine reads beside the model, on the batch it ran: the known-kinds check's probabilities of a set
that has one (``read_kinds``: one pass of the bundle's verifier over every such call's boxes; they are its verdict's
confidences), each other answer's NCC features with its set's templates (``read_ncc``; the route's verdict then reads
nothing itself), and ``rerank=auto``'s second look (``SecondLook``: which answers are doubtful, ``doubtful_answers``;
with ``rerank=templates``, template matching's window on them, ``template_windows``), grouped by set of templates
across the calls of a batch (concurrent requests on one set: one read). ``app.serving.run_prepared`` calls them;
``answer_rows`` is also the verdict's layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from models.calibration import Calibration
from models.core.templates import Templates
from models.inference import Localization

if TYPE_CHECKING:
    from app.serving import Prepared


@dataclass(frozen=True)
class SecondLook:
    """``rerank=auto``'s second look, taken by the engine where it reads the call's NCC features (``templates``): an
    image whose answer's ``calibration`` confidence is below ``below`` also gets up to ``candidates`` instances,
    searched on the feature map of the same forward pass (``LocalizeAnswer.looked``)."""

    calibration: Calibration
    below: float
    candidates: int
    template_bar: float | None = None
    """``rerank=templates``: template matching's window (``Templates.match``) is one more candidate of the doubtful
    images (``Instance.template``), taken only if its confidence reaches this; ``None``: not looked for."""


NccFeatures = tuple[Tensor, Tensor | None]
"""An answer's NCC features (``Templates.ncc``): with the exemplars ``[n, 1 + K]`` float64 and with the negative
exemplars (or ``None``), for each image's row of boxes (``answer_rows``)."""


def answer_rows(results: list[Localization]) -> tuple[Tensor, Tensor]:
    """Every image's answer and then its instances as one row, padded with the answer -> (boxes ``[n, 1 + K, 4]``
    float32, scores ``[n, 1 + K]`` float64), K the most instances of any image: one scoring pass for every box."""
    counts = [len(r.instances or ()) for r in results]
    pad = max(counts, default=0)
    rows = [[(r.box, r.score)] + [(i.box, i.score) for i in (r.instances or ())] + [(r.box, r.score)] * (pad - n)
            for r, n in zip(results, counts, strict=True)]
    boxes = torch.tensor([[list(b) for b, _ in row] for row in rows], dtype=torch.float32)
    scores = torch.tensor([[float(s) for _, s in row] for row in rows], dtype=torch.float64)
    return boxes, scores


def _by_templates(calls: list[Prepared], members: list[int], *, fit: bool = False) -> list[list[int]]:
    """The calls ``members`` grouped by their templates (the calls of concurrent requests on one set: one read),
    and by their second look's calibration too with ``fit``."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i in members:
        look = calls[i].second_look
        groups.setdefault((id(calls[i].templates), id(look.calibration) if fit and look else 0), []).append(i)
    return list(groups.values())


def doubtful_answers(calls: list[Prepared], starts: list[int], counts: list[int], batch: Tensor, boxes: Tensor,
                     distances: Tensor, answer_ncc: dict[int, NccFeatures], answer_kind: dict[int, Tensor]) -> Tensor:
    """The engine's second look (``SecondLook``): which of the batch's answers (``boxes [B, 4]`` input pixels,
    ``distances [B]``) are doubtful -> ``[B]`` bool: those whose calibration's confidence on their NCC features is
    under the call's bar (one read, and one confidence, per set of templates and calibration, kept in ``answer_ncc``:
    call index -> ``[n, 1]`` features, so that ``read_ncc`` does not read them again), and, for a call with a
    known-kinds check (``Prepared.kind``), whose check's probability is under it too (``app.calibration.
    doubtful_by_pixels``: the same rule where the route takes the second look). The check's probabilities are read
    first (one verifier pass per verifier, kept in ``answer_kind``: call index -> ``[n, 1]``, so that ``read_kinds``
    reads only the instances), and the NCC features of such a call only where the check doubts."""
    pick = torch.zeros(len(boxes), dtype=torch.bool)
    looking = [i for i, c in enumerate(calls) if c.second_look is not None and counts[i]]
    for members in _by_verifier(calls, [i for i in looking if calls[i].kind is not None]):
        rows = [r for i in members for r in range(starts[i], starts[i] + counts[i])]
        emb = calls[members[0]].kind[0].embed_boxes(batch[rows].cpu(), boxes[rows][:, None])  # type: ignore[index]
        for i, at in zip(members, accumulate([counts[i] for i in members], initial=0), strict=False):
            answer_kind[i] = calls[i].kind[1].probability(emb[at:at + counts[i]])  # type: ignore[index]
    checked = {i: [starts[i] + k for k in range(counts[i])
                   if i not in answer_kind or answer_kind[i][k, 0] < calls[i].second_look.below]  # type: ignore[union-attr]
               for i in looking}
    for members in _by_templates(calls, [i for i in looking if checked[i]], fit=True):
        rows = [r for i in members for r in checked[i]]
        look = calls[members[0]].second_look
        pos, neg = calls[members[0]].templates.ncc(batch[rows].cpu(), boxes[rows][:, None])  # type: ignore[union-attr]
        conf = look.calibration.confidence(distances[rows].double(), ncc=pos[:, 0],  # type: ignore[union-attr]
                                           ncc_negatives=None if neg is None else neg[:, 0])
        below = torch.tensor([calls[i].second_look.below for i in members], dtype=conf.dtype)  # type: ignore[union-attr]
        pick[rows] = conf < below.repeat_interleave(torch.tensor([len(checked[i]) for i in members]))
        for i, f in zip(members, _per_call(pos, neg, [len(checked[i]) for i in members]), strict=True):
            if calls[i].kind is None:  # every row read: what read_ncc would read (a check's calls read none)
                answer_ncc[i] = f
    return pick


def template_windows(calls: list[Prepared], counts: list[int], batch: Tensor, scales: Tensor, picked: Tensor
                     ) -> Tensor:
    """``rerank=templates``: template matching's window (``Templates.match``, the crops sized by ``scales [B, 2]``:
    ``Prepared.match_scales``) on each picked image of the batch (``picked [m]``, the doubtful answers' rows) whose
    call asks for it -> ``[m, 4]`` input pixels, NaN elsewhere; one match per set of templates."""
    out = torch.full((len(picked), 4), torch.nan)
    owner = torch.repeat_interleave(torch.arange(len(calls)), torch.tensor(counts))[picked]  # each row's call
    wanted = [i for i, c in enumerate(calls) if c.second_look is not None and c.second_look.template_bar is not None
              and c.templates is not None]
    for members in _by_templates(calls, wanted):
        at = torch.isin(owner, torch.tensor(members)).nonzero().flatten()
        if len(at):
            rows = picked[at]
            out[at] = calls[members[0]].templates.match(batch[rows].cpu(), scales[rows])  # type: ignore[union-attr]
    return out


def _per_call(pos: Tensor, neg: Tensor | None, counts: list[int]) -> list[NccFeatures]:
    """Features of the rows of several calls, one after the other -> each call's (``counts``: its rows)."""
    starts = accumulate(counts, initial=0)
    return [(pos[at:at + n], None if neg is None else neg[at:at + n]) for at, n in zip(starts, counts, strict=False)]


def _rows_on_input(members: list[int], starts: list[int], counts: list[int], scales: Tensor,
                   results: list[Localization]) -> tuple[list[int], Tensor]:
    """The batch's rows of the calls ``members`` and their answers' rows of boxes (``answer_rows``) in the pixels of
    the batch's input ``[m, 1 + K, 4]``."""
    rows = [r for i in members for r in range(starts[i], starts[i] + counts[i])]
    boxes, _ = answer_rows([results[r] for r in rows])
    return rows, boxes / scales[rows].repeat(1, 2)[:, None].to(boxes)  # (sx, sy, sx, sy): image pixels -> input


def read_ncc(calls: list[Prepared], starts: list[int], counts: list[int], batch: Tensor, scales: Tensor,
             results: list[Localization], answer_ncc: dict[int, NccFeatures] | None = None
             ) -> list[NccFeatures | None]:
    """Each call's answers read by its ``templates`` (``None`` without, or with a known-kinds check: the verdict's
    confidences are then the check's, ``read_kinds``): one ``Templates.ncc`` per set of
    templates for all the images of the calls that share it (concurrent requests on one set: one pass), on the
    batch the model read. What the route's verdict would read on the same images, without preprocessing them
    again or paying the pass's fixed cost per request. ``answer_ncc``: the answers' features already read
    (``doubtful_answers``); where every call of a set of templates has them, only the instances are read (each
    box is read on its own: the same features)."""
    known = answer_ncc or {}
    out: list[NccFeatures | None] = [None] * len(calls)
    reading = [i for i, c in enumerate(calls) if c.templates is not None and c.kind is None and counts[i]]
    for members in _by_templates(calls, reading):
        rows, boxes = _rows_on_input(members, starts, counts, scales, results)
        templates = calls[members[0]].templates
        if all(i in known for i in members):
            pos, neg = _with_instances(templates, batch[rows].cpu(), boxes, [results[r] for r in rows],  # type: ignore[arg-type]
                                       [known[i] for i in members])
        else:
            pos, neg = templates.ncc(batch[rows].cpu(), boxes)  # type: ignore[union-attr]
        for i, f in zip(members, _per_call(pos, neg, [counts[i] for i in members]), strict=True):
            out[i] = f
    return out


def _with_instances(templates: Templates, images01: Tensor, boxes: Tensor, results: list[Localization],
                    answers: list[NccFeatures]) -> NccFeatures:
    """The features of rows of boxes ``[m, 1 + K, 4]`` (input pixels; ``answer_rows``) whose answers' are known
    (``answers``, each ``[n, 1]``): the instances read, the rest (the answers, the padding) the answers'."""
    pos = torch.cat([p for p, _ in answers])
    neg = None if answers[0][1] is None else torch.cat([q for _, q in answers])  # type: ignore[misc]
    width = boxes.shape[1]
    pos, neg = pos.expand(-1, width).clone(), None if neg is None else neg.expand(-1, width).clone()
    more = [j for j, r in enumerate(results) if r.instances]
    if more and width > 1:
        p, q = templates.ncc(images01[more], boxes[more, 1:])
        pos[more, 1:] = p
        if neg is not None and q is not None:
            neg[more, 1:] = q
    return pos, neg


def _by_verifier(calls: list[Prepared], members: list[int]) -> list[list[int]]:
    """The calls ``members`` (each with a ``kind`` check) grouped by the verifier their check was made with."""
    groups: dict[int, list[int]] = {}
    for i in members:
        groups.setdefault(id(calls[i].kind[0]), []).append(i)  # type: ignore[index]
    return list(groups.values())


def read_kinds(calls: list[Prepared], starts: list[int], counts: list[int], batch: Tensor, scales: Tensor,
               results: list[Localization], answer_kind: dict[int, Tensor] | None = None) -> list[Tensor | None]:
    """Each call's ``kind`` check's probabilities ``[n, 1 + K]`` on its answers' rows of boxes (``answer_rows``;
    ``None`` without a check): one verifier pass per verifier over the rows of every call that has one (concurrent
    requests on sets of one bundle: one small CNN pass), on the batch the model read. ``answer_kind``: the answers'
    probabilities already read (``doubtful_answers``); where every call of a verifier has them, only the instances
    are read (each box is read on its own: the same probabilities)."""
    known = answer_kind or {}
    out: list[Tensor | None] = [None] * len(calls)
    for members in _by_verifier(calls, [i for i, c in enumerate(calls) if c.kind is not None and counts[i]]):
        rows, boxes = _rows_on_input(members, starts, counts, scales, results)
        verifier = calls[members[0]].kind[0]  # type: ignore[index]
        if all(i in known for i in members):
            width = boxes.shape[1]
            more = [j for j, r in enumerate(rows) if results[r].instances] if width > 1 else []
            emb = verifier.embed_boxes(batch[[rows[j] for j in more]].cpu(), boxes[more, 1:]) if more else None
            at_more = {j: k for k, j in enumerate(more)}
            for i, at in zip(members, accumulate([counts[i] for i in members], initial=0), strict=False):
                p = known[i].expand(-1, width).clone()
                mine = [j for j in range(at, at + counts[i]) if j in at_more]
                if mine and emb is not None:
                    p[[j - at for j in mine], 1:] = calls[i].kind[1].probability(  # type: ignore[index]
                        emb[[at_more[j] for j in mine]])
                out[i] = p
        else:
            emb = verifier.embed_boxes(batch[rows].cpu(), boxes)
            for i, at in zip(members, accumulate([counts[i] for i in members], initial=0), strict=False):
                out[i] = calls[i].kind[1].probability(emb[at:at + counts[i]])  # type: ignore[index]
    return out
