"""The service's side of calibrated confidence and negative exemplars (the math: ``models.calibration``).

- ``calibrate_new_set``: when a set is made (``QLOC_INFERENCE=local``: the API has the model), the calibration
  of the bundle's base policy from what the set has -- its crops (pasted into synthesized backgrounds), its
  labeled examples, its negative exemplars -- and the negatives' embeddings.
- ``Judged`` / ``judge``: after a localize answer, each result's calibrated ``confidence`` and ``found``; with
  negative exemplars (and the model at hand), the confidence also weighs how near each box is to the
  look-alikes; ``rerank`` answers with the candidate (several-instances search) that calibration likes best:
  always (``true``), or (``auto``) only where the agent's own answer is clearly unlikely and a candidate is likely
  (``second_look``: the local engine searches the candidates of those images in the same forward pass).

What is computed here runs after the answer, in the route; the NCC features only where the inference backend did
not read them with its forward pass (``LocalizeCall.templates``: the local backends read them there, batched
across requests).

A calibration with templates (format version 2, ``models.core.templates.Templates``: the set's crops as 16x16 8-bit
templates, kept in the calibration's JSON -- no file is read per request) gives every answer the NCC fit's
confidence: the NCC of its box with the exemplars (and the negative exemplars), read on the image resized to the
bundle's input as the fit read it. It needs no model, so it holds with ``QLOC_INFERENCE=workers`` too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from PIL import Image
from torch import Tensor

from app.engine_ncc import NccFeatures, SecondLook, answer_rows
from app.inference import LoadedBundle, prototype_from_bytes
from app.lru import LoadingLRU
from app.schemas import Rerank
from models.calibration import Calibration, calibrate_policy, score_boxes
from models.core.templates import Templates
from models.data.types import LabeledImages
from models.inference import pil_to_tensor, preprocess, resize_batch
from models.verifier import KindVerifier

RERANK_CANDIDATES = 4
"""``rerank`` chooses among at least this many candidates per image (``max_instances``)."""

SECOND_LOOK_BELOW = 0.5
"""``rerank=auto`` looks again at answers whose confidence is below this fraction of ``LOOK_THRESHOLD`` (and takes
the likeliest candidate only if it reaches ``LOOK_THRESHOLD``): chosen on validation images (BENCHMARKS.md, "A second
look"), where a looser rule (any answer below the threshold, any likelier candidate) gained more on starting
policies but lost up to 4.5 points on adapted ones."""

LOOK_THRESHOLD = 0.5
"""The confidence the second look's rules read, whatever the set's ``threshold``: they were chosen at the default
threshold, and which box answers should not depend on where a user draws `found` (a set's threshold of 0.1 read as
the rules' would look again only below 0.05 and let the agent's wrong boxes through). The set's threshold (and
``min_confidence``) decides ``found`` only."""


def doubtful(confidence: float | None) -> bool:
    """``rerank=auto`` looks again at this answer: its confidence is below ``SECOND_LOOK_BELOW`` x ``LOOK_THRESHOLD``
    (for a set whose confidences are a known-kinds check's, ``doubtful_by_pixels`` must say so too)."""
    return confidence is not None and confidence < SECOND_LOOK_BELOW * LOOK_THRESHOLD


def doubtful_by_pixels(cal: Calibration, images: list[Image.Image], results: list) -> list[bool]:
    """The second look's other condition on a set with a known-kinds check: the calibration's NCC fit doubts each
    answer too (``doubtful`` on the fit's confidence of its NCC features with the exemplars). The check doubts an
    answer whether the box is wrong or the object absent; the look is for wrong boxes, and on validation digits (a
    second look wherever the check doubts: precision of `found` against other digits 0.990 -> 0.977, the worst
    digit 0.969 -> 0.923; recall 0.974 -> 0.977; CorLoc 99.6 either way; BENCHMARKS.md, "Known kinds") both must
    doubt. ``results``: ``Localization`` answers in the pixels of ``images``."""
    boxes = torch.tensor([[list(r.box)] for r in results], dtype=torch.float32)  # [n, 1, 4]
    scores = torch.tensor([float(r.score) for r in results], dtype=torch.float64)
    pos, neg = _read_ncc(cal.templates, images, boxes)  # type: ignore[arg-type]
    conf = cal.confidence(scores, ncc=pos[:, 0], ncc_negatives=None if neg is None else neg[:, 0])
    return [doubtful(c) for c in conf.tolist()]


TEMPLATE_BAR = 0.8
"""``rerank=templates``: template matching's window answers a doubtful image only if its confidence reaches this (the
other candidates: the set's threshold). Chosen on validation images among 0.5 / 0.7 / 0.8 / 0.9 (BENCHMARKS.md,
"`rerank=templates` (opt-in)"): most of the gain for few false alarms on images without the object."""


SECOND_LOOK_FOUND = 0.8
"""A second look's answer (a candidate ``rerank=auto`` / ``templates`` took in place of a doubtful one) is ``found``
only from this confidence (and the set's threshold): the likeliest of several candidates reaches the threshold by chance
more often than one answer does. Chosen on validation images through the API (``found_kinds_api.py --split val
--raw``, replayed per bar; the boxes do not change): 8 glyph kinds, `found` on empty images 7.4 % -> 1.3 %, precision
against empty images 0.881 -> 0.938 and against other glyphs 0.901 -> 0.925, recall 0.855 -> 0.840 (0.7: 2.2 %,
0.842; 0.9: 0.1 %, 0.747); ten digits (the kind check): recall unchanged, precision 0.987 -> 0.990."""


def second_look(fit: Calibration, candidates: int, *, templates: bool = False) -> SecondLook:
    """``rerank=auto``'s second look for the engine (``app.serving.SecondLook``): the ``doubtful`` answers get
    ``candidates`` instances (and, with ``templates``, template matching's window)."""
    return SecondLook(fit, SECOND_LOOK_BELOW * LOOK_THRESHOLD, candidates, TEMPLATE_BAR if templates else None)


def negatives_to_bytes(embeddings: Tensor) -> bytes:
    """``[K, D]`` -> float32 little-endian bytes (``exemplar_sets.negatives``)."""
    return embeddings.detach().cpu().numpy().astype("<f4").tobytes()


def negatives_from_bytes(data: bytes, dim: int) -> Tensor:
    """float32 little-endian bytes -> ``[K, dim]``."""
    return prototype_from_bytes(data).view(-1, dim)


@dataclass
class NewSetCalibration:
    calibration: dict
    negatives: bytes | None
    num_negatives: int


def calibrate_new_set(loaded: LoadedBundle, prototype: Tensor, crops: list[Image.Image],
                      labeled: list[tuple[Image.Image, tuple[float, float, float, float]]],
                      negative_crops: list[Image.Image], *, threshold: float, samples: int, seed: int = 0,
                      verifier: KindVerifier | None = None) -> NewSetCalibration:
    """The calibration of the bundle's base policy for a new set (greedy answers, the bundle's ``nearest``), and
    the negatives' embeddings. ``labeled``: (whole image as decoded, the box in its pixels). ``verifier``: the
    bundle's known-kinds verifier (``models.verifier``): a set of a kind it knows gets its check. ``samples``: pasted
    crops and synthesized backgrounds, each (``Settings.calibration_samples``)."""
    loc = loaded.localizer
    spec = loc.spec
    tensors = [pil_to_tensor(c, spec.channels, spec.fill) for c in crops]
    neg_tensors = [pil_to_tensor(c, spec.channels, spec.fill) for c in negative_crops]
    negatives = loc.embed_crops(neg_tensors).cpu() if neg_tensors else None
    examples = None
    if labeled:
        batch, scales = preprocess([im for im, _ in labeled], spec)
        k = torch.cat([scales, scales], dim=1)
        examples = LabeledImages(batch, torch.tensor([b for _, b in labeled], dtype=torch.float32) / k)
    cal = calibrate_policy(loc, prototype, tensors, nearest=loc.default_nearest, n=samples, seed=seed,
                           labeled=examples, negative_crops=neg_tensors or None, negative_embeddings=negatives,
                           threshold=threshold, verifier=verifier)
    return NewSetCalibration(cal.to_dict(), None if negatives is None else negatives_to_bytes(negatives),
                             0 if negatives is None else len(negatives))


def _on_input(t: Templates, images: list[Image.Image], boxes: Tensor) -> tuple[Tensor, Tensor]:
    """``images`` resized as the templates were fit (what the local backends read with their batch instead), and
    boxes ``[n, K, 4]`` in their pixels -> (the batch ``[n, C, S, S]``, the boxes in its pixels)."""
    batch, scales = resize_batch([pil_to_tensor(im, t.channels, t.fill) for im in images], t.size)
    return batch, boxes / torch.cat([scales, scales], dim=1)[:, None]  # [n, 1, 4]: image pixels -> input


def _read_ncc(t: Templates, images: list[Image.Image], boxes: Tensor) -> NccFeatures:
    """Boxes ``[n, K, 4]`` in the pixels of ``images`` -> their NCC features (``Templates.ncc``), read on the images
    resized as the templates were fit (``_on_input``)."""
    return t.ncc(*_on_input(t, images, boxes))


def matched_windows(t: Templates, images: list[Image.Image], decoded_scales: list[tuple[float, float]]
                    ) -> list[tuple[float, float, float, float] | None]:
    """``rerank=templates``' window (``Templates.match``) in the pixels of each of ``images`` (``None``: none),
    matched on the images resized as the templates were fit, each crop at its size in the decoded pixels
    (``decoded_scales``: full / decoded per image, ``DecodedImage.scale``): where the engine does not match them
    with its batch (``LocalizeCall.extra_boxes`` then carries them to any backend or device)."""
    batch, scales = resize_batch([pil_to_tensor(im, t.channels, t.fill) for im in images], t.size)
    full = scales * torch.tensor(decoded_scales, dtype=scales.dtype).view(-1, 2)
    boxes = t.match(batch, full) * torch.cat([scales, scales], dim=1)
    return [None if any(math.isnan(v) for v in row) else (row[0], row[1], row[2], row[3]) for row in boxes.tolist()]


@dataclass
class Judged:
    """One result's verdict: its (possibly re-ranked) box in the decoded image's pixels, score, confidence."""

    box: tuple[float, float, float, float]
    score: float
    confidence: float | None
    found: bool
    instances: list[Judged] | None = None
    """With ``max_instances``: each instance's verdict, best first (those under ``min_confidence`` left out)."""
    reranked: bool = False
    """The box is a candidate of the several-instances search chosen by ``rerank``, not the agent's answer."""


DECODED_CACHE_SIZE = 256
_DECODED: LoadingLRU[Calibration] = LoadingLRU(DECODED_CACHE_SIZE)


def decoded(calibration: dict, key: Hashable | None) -> Calibration:
    """``Calibration.from_dict(calibration)``, kept under ``key`` (the row it was read from: a stored calibration is
    written once, never changed) so that each request does not decode its templates again; ``None``: not kept."""
    if key is None:
        return Calibration.from_dict(calibration)
    return _DECODED.get(key, lambda: Calibration.from_dict(calibration))


NegativesScorer = Callable[[list[Image.Image], Tensor], Tensor]
"""Boxes ``[n, K, 4]`` in the pixels of the images -> the confidences ``[n, K]`` of the set's negatives' fit (the
boxes embedded by the set's bundle): ``negatives_confidence`` where the bundle is elsewhere (a localize worker)."""


def negatives_confidence(loaded: LoadedBundle, prototype: bytes, negatives: bytes, cal: Calibration,
                         images: list[Image.Image], boxes: Tensor) -> Tensor:
    """Boxes ``[n, K, 4]`` in the pixels of ``images`` -> ``P(correct)`` ``[n, K]`` by ``cal``'s richest fit with
    the boxes embedded by ``loaded`` (their distances to ``prototype`` and to the nearest of ``negatives``):
    one backbone pass per image."""
    batch, scales = preprocess(images, loaded.localizer.spec)  # scales: (w / S, h / S) of the images given
    k = torch.cat([scales, scales], dim=1)[:, None]  # [n, 1, 4]
    proto = prototype_from_bytes(prototype)
    _, _, conf = score_boxes(loaded.localizer, batch, boxes / k, proto, negatives_from_bytes(negatives, len(proto)),
                             cal)
    return conf


def judge(results: list, images: list[Image.Image], calibration: dict | None, *, threshold: float,  # noqa: PLR0913
          min_confidence: float | None, loaded: LoadedBundle | None, prototype: bytes,
          negatives: bytes | None, rerank: Rerank = "false", calibration_key: Hashable | None = None,
          ncc: NccFeatures | None = None, template_bar: float | None = None,
          verifier: KindVerifier | None = None, kind: Tensor | None = None,
          by_negatives: NegativesScorer | None = None) -> list[Judged]:
    """``results`` (``models.inference.Localization``, boxes in the pixels of ``images``) -> one ``Judged`` each.

    ``loaded`` (the bundle, in local mode; elsewhere ``by_negatives``, which embeds the boxes there) and
    ``negatives`` (the set's negative embeddings) let the confidence use the negatives' fit of the calibration
    (``calibration_key``: the row it was read from, see ``decoded``).
    Without a calibration: confidence None, found True. The results'
    ``instances`` are judged the same way, in the same pass as the answers (the pixels are read once);
    ``min_confidence`` drops those under it. ``rerank`` (``Rerank``; it needs the results' instances: the route
    asks for ``RERANK_CANDIDATES``) answers with the instance the calibration finds most likely right (with NCC
    fits and negatives: the one most like the exemplars and least like the look-alikes): ``true`` always,
    ``auto`` only where the answer is ``doubtful`` and the instance reaches ``LOOK_THRESHOLD`` (``threshold`` and
    ``min_confidence`` play no part: they decide ``found``, not the box; an instance ``auto`` took is ``found`` from
    ``SECOND_LOOK_FOUND`` and ``threshold``).
    A template-matching window among the instances (``Instance.template``, ``rerank=templates``) is a candidate only
    if it reaches ``template_bar`` too, and is never listed among the answer's instances. ``verifier``: the set's
    bundle's known-kinds verifier; where the calibration's kind check was made with it, its probabilities are the
    confidences (``_confidences``; ``kind``: those the engine read with its batch, ``LocalizeAnswer.kind``)."""
    if not results:
        return []
    counts = [len(r.instances or ()) for r in results]
    if calibration is None:
        confs: list[list[float | None]] = [[None] * (1 + n) for n in counts]
    else:
        boxes, scores = answer_rows(results)
        with torch.inference_mode():  # no autograd bookkeeping (torchvision's RoIAlign has a Python layer for it)
            conf = _confidences(decoded(calibration, calibration_key), images, boxes, scores, loaded=loaded,
                                prototype=prototype, negatives=negatives, ncc=ncc, verifier=verifier, kind=kind,
                                by_negatives=by_negatives)
        confs = [[float(c) for c in row[:1 + n]] for row, n in zip(conf.tolist(), counts, strict=True)]
    cut = threshold if min_confidence is None else min_confidence  # the request's own bar, lower or higher

    def judged(box, score: float, c: float | None) -> Judged:
        return Judged(tuple(box), float(score), c, c is None or c >= cut)

    out = []
    for r, cs in zip(results, confs, strict=True):
        answer = judged(r.box, r.score, cs[0])
        if r.instances is not None:
            every = [judged(i.box, i.score, c) for i, c in zip(r.instances, cs[1:], strict=True)]
            found = [j for j, i in zip(every, r.instances, strict=True) if not i.template]
            windows = [j for j, i in zip(every, r.instances, strict=True) if i.template and template_bar is not None
                       and j.confidence is not None and j.confidence >= template_bar]
            if rerank != "false" and every and every[0].confidence is not None and answer.confidence is not None:
                # auto: among the first RERANK_CANDIDATES (a larger max_instances leaves the answer as it was)
                pool = (found if rerank == "true" else found[:RERANK_CANDIDATES]) + windows
                best = max(pool, key=lambda j: j.confidence, default=None)  # type: ignore[arg-type, return-value]
                if best is not None and (rerank == "true" or (doubtful(answer.confidence)
                                                              and best.confidence >= LOOK_THRESHOLD)):  # type: ignore[operator]
                    moved = best.box != answer.box
                    is_found = best.found and (rerank == "true" or not moved
                                               or best.confidence >= SECOND_LOOK_FOUND)  # type: ignore[operator]
                    answer = Judged(best.box, best.score, best.confidence, is_found, reranked=moved)
            answer.instances = [j for j in found if min_confidence is None or j.confidence is None
                                or j.confidence >= min_confidence]
        out.append(answer)
    return out


def _confidences(cal: Calibration, images: list[Image.Image], boxes: Tensor, scores: Tensor, *,
                 loaded: LoadedBundle | None, prototype: bytes, negatives: bytes | None,
                 ncc: NccFeatures | None = None, verifier: KindVerifier | None = None,
                 kind: Tensor | None = None, by_negatives: NegativesScorer | None = None) -> Tensor:
    """Boxes ``[n, K, 4]`` in the pixels of ``images`` with scores ``[n, K]`` -> calibrated ``P(correct)``
    ``[n, K]``: the kind check's (a set of a kind ``verifier`` knows: ``kind`` as the engine read it, else the
    boxes read here on the images resized as the templates were fit, one small CNN pass), else by the richest fit
    the set allows: the NCC fit (a calibration with templates: no model needed), else the negatives' fit (a set
    with negatives: the boxes embedded, one backbone pass per image, here by ``loaded`` or on a worker by
    ``by_negatives``), else the score's."""
    if kind is not None and cal.kind is not None:  # read by the engine (its rows may be padded further)
        return kind[:, :scores.shape[1]]
    if cal.kind_applies(verifier):
        return cal.kind_confidence(verifier, *_on_input(cal.templates, images, boxes))  # type: ignore[arg-type, return-value]
    if cal.templates is not None and cal.ncc is not None:
        pos, neg = ncc if ncc is not None else _read_ncc(cal.templates, images, boxes)
        k = scores.shape[1]  # the engine's rows may be padded further (its batch's most instances)
        return cal.confidence(scores.flatten(), ncc=pos[:, :k].flatten(),
                              ncc_negatives=None if neg is None else neg[:, :k].flatten()).view(scores.shape)
    if negatives is None or cal.negatives is None or (loaded is None and by_negatives is None):
        return cal.confidence(scores.flatten()).view(scores.shape)
    if loaded is None:
        return by_negatives(images, boxes)  # type: ignore[misc]
    return negatives_confidence(loaded, prototype, negatives, cal, images, boxes)
