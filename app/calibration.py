"""The service's side of calibrated confidence and negative exemplars (the math: ``models.calibration``).

- ``calibrate_new_set``: when a set is made (``QLOC_INFERENCE=local``: the API has the model), the calibration
  of the bundle's base policy from what the set has -- its crops (pasted into synthesized backgrounds), its
  labeled examples, its negative exemplars -- and the negatives' embeddings.
- ``Judged`` / ``judge``: after a localize answer, each result's calibrated ``confidence`` and ``found``; with
  negative exemplars (and the model at hand), the confidence also weighs how near each box is to the
  look-alikes; ``rerank`` answers with the candidate (several-instances search) that calibration likes best.

The inference backends are not involved: what is computed here runs after the answer, in the route.

A calibration with templates (format version 2, ``models.calibration.Templates``: the set's crops as 16x16 8-bit
templates, kept in the calibration's JSON -- no file is read per request) gives every answer the NCC fit's
confidence: the NCC of its box with the exemplars (and the negative exemplars), read on the image resized to the
bundle's input as the fit read it. It needs no model, so it holds with ``QLOC_INFERENCE=workers`` too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image
from torch import Tensor

from app.inference import LoadedBundle, prototype_from_bytes
from models.calibration import Calibration, calibrate_policy, score_boxes
from models.data.types import LabeledImages
from models.inference import pil_to_tensor, preprocess, resize_batch

RERANK_CANDIDATES = 4
"""``rerank=true`` chooses among at least this many candidates per image (``max_instances``)."""

CALIBRATION_SAMPLES = 128
"""Positives and negatives a calibration is fit on (each)."""


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
                      negative_crops: list[Image.Image], *, threshold: float, seed: int = 0) -> NewSetCalibration:
    """The calibration of the bundle's base policy for a new set (greedy answers, the bundle's ``nearest``), and
    the negatives' embeddings. ``labeled``: (whole image as decoded, the box in its pixels)."""
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
    cal = calibrate_policy(loc, prototype, tensors, nearest=loc.default_nearest, n=CALIBRATION_SAMPLES, seed=seed,
                           labeled=examples, negative_crops=neg_tensors or None, negative_embeddings=negatives,
                           threshold=threshold)
    return NewSetCalibration(cal.to_dict(), None if negatives is None else negatives_to_bytes(negatives),
                             0 if negatives is None else len(negatives))


def _ncc_confidences(cal: Calibration, images: list[Image.Image], boxes: Tensor, scores: Tensor) -> Tensor:
    """Boxes ``[n, K, 4]`` in the pixels of ``images`` with scores ``[n, K]`` -> the NCC fit's ``P(correct)``
    ``[n, K]`` (the calibration has templates)."""
    t = cal.templates
    assert t is not None
    batch, scales = resize_batch([pil_to_tensor(im, t.channels, t.fill) for im in images], t.size)
    k = torch.cat([scales, scales], dim=1)[:, None]  # [n, 1, 4]
    return cal.box_confidence(batch, boxes / k, scores)


@dataclass
class Judged:
    """One result's verdict: its (possibly re-ranked) box in the decoded image's pixels, score, confidence."""

    box: tuple[float, float, float, float]
    score: float
    confidence: float | None
    found: bool
    instances: list[Judged] | None = None
    """With ``max_instances``: each instance's verdict, best first (those under ``min_confidence`` left out)."""


def judge(results: list, images: list[Image.Image], calibration: dict | None, *, threshold: float,  # noqa: PLR0913
          min_confidence: float | None, loaded: LoadedBundle | None, prototype: bytes,
          negatives: bytes | None, rerank_boxes: bool) -> list[Judged]:
    """``results`` (``models.inference.Localization``, boxes in the pixels of ``images``) -> one ``Judged`` each.

    ``loaded`` (the bundle, in local mode) and ``negatives`` (the set's negative embeddings) let the confidence
    use the negatives' fit of the calibration. Without a calibration: confidence None, found True. The results'
    ``instances`` are judged the same way; ``min_confidence`` drops those under it. ``rerank_boxes`` (needs the
    results' instances: the route asks for ``RERANK_CANDIDATES``) answers with the instance the calibration finds
    most likely right (with NCC fits and negatives: the one most like the exemplars and least like the
    look-alikes)."""
    has_instances = any(r.instances is not None for r in results)
    answers = _judge_answers(results, images, calibration, threshold=threshold, min_confidence=min_confidence,
                             loaded=loaded, prototype=prototype, negatives=negatives)
    if not has_instances:
        return answers
    confs = _instance_confidences(results, images, calibration, loaded=loaded, prototype=prototype,
                                  negatives=negatives)
    cut = max(threshold, min_confidence if min_confidence is not None else 0.0)
    for a, r, cs in zip(answers, results, confs, strict=True):
        if r.instances is None:
            continue
        judged = [Judged(tuple(i.box), float(i.score), c, c is None or c >= cut)
                  for i, c in zip(r.instances, cs, strict=True)]
        if rerank_boxes and judged and judged[0].confidence is not None:
            best = max(judged, key=lambda j: j.confidence)  # type: ignore[arg-type, return-value]
            a.box, a.score, a.confidence, a.found = best.box, best.score, best.confidence, best.found
        a.instances = [j for j in judged if min_confidence is None or j.confidence is None
                       or j.confidence >= min_confidence]
    return answers


def _padded(results: list, counts: list[int]) -> tuple[Tensor, Tensor]:
    """Every image's instances as one row, padded with its first (an image without any: zeros) -> (boxes
    ``[n, K, 4]`` float32, scores ``[n, K]`` float64)."""
    pad = max(counts)
    rows = [list(r.instances) + [r.instances[0]] * (pad - n) if n else [] for r, n in zip(results, counts, strict=True)]
    boxes = torch.tensor([[i.box for i in row] if row else [[0.0] * 4] * pad for row in rows], dtype=torch.float32)
    scores = torch.tensor([[i.score for i in row] if row else [1.0] * pad for row in rows], dtype=torch.float64)
    return boxes, scores


def _instance_confidences(results: list, images: list[Image.Image], calibration: dict | None, *,
                          loaded: LoadedBundle | None, prototype: bytes, negatives: bytes | None
                          ) -> list[list[float | None]]:
    """The calibrated confidence of every instance of every result (``[]`` for a result without instances)."""
    counts = [len(r.instances or ()) for r in results]
    if calibration is None:
        return [[None] * n for n in counts]
    cal = Calibration.from_dict(calibration)
    if cal.templates is not None and cal.ncc is not None and any(counts):
        boxes, scores = _padded(results, counts)
        conf = _ncc_confidences(cal, images, boxes, scores)
        return [[float(c) for c in row[:n]] for row, n in zip(conf.tolist(), counts, strict=True)]
    if loaded is None or negatives is None or cal.negatives is None:
        flat = cal.confidence(torch.tensor([i.score for r in results for i in (r.instances or ())],
                                           dtype=torch.float64)).tolist()
        out, at = [], 0
        for n in counts:
            out.append(flat[at:at + n])
            at += n
        return out
    boxes, _ = _padded(results, counts)  # one row per image: one backbone pass per image, one scoring
    batch, scales = preprocess(images, loaded.localizer.spec)
    k = torch.cat([scales, scales], dim=1)[:, None]  # [n, 1, 4]
    proto = prototype_from_bytes(prototype)
    _, _, conf = score_boxes(loaded.localizer, batch, boxes / k, proto, negatives_from_bytes(negatives, len(proto)),
                             cal)
    return [[float(c) for c in row[:n]] for row, n in zip(conf.tolist(), counts, strict=True)]


def _judge_answers(results: list, images: list[Image.Image], calibration: dict | None, *, threshold: float,
                   min_confidence: float | None, loaded: LoadedBundle | None, prototype: bytes,
                   negatives: bytes | None) -> list[Judged]:
    """``judge`` of the answers (``box``) alone."""
    boxes = [tuple(r.box) for r in results]
    scores = [float(r.score) for r in results]
    if calibration is None:
        return [Judged(b, s, None, True) for b, s in zip(boxes, scores, strict=True)]
    cal = Calibration.from_dict(calibration)
    cut = max(threshold, min_confidence if min_confidence is not None else 0.0)
    use_negatives = loaded is not None and negatives is not None and cal.negatives is not None
    if cal.templates is not None and cal.ncc is not None:
        conf = _ncc_confidences(cal, images, torch.tensor(boxes, dtype=torch.float32)[:, None],
                                torch.tensor(scores, dtype=torch.float64)[:, None])[:, 0].tolist()
        return [Judged(b, s, c, c >= cut) for b, s, c in zip(boxes, scores, conf, strict=True)]
    if not use_negatives:
        conf = cal.confidence(torch.tensor(scores, dtype=torch.float64)).tolist()
        return [Judged(b, s, c, c >= cut) for b, s, c in zip(boxes, scores, conf, strict=True)]
    assert loaded is not None and negatives is not None
    proto = prototype_from_bytes(prototype)
    neg = negatives_from_bytes(negatives, len(proto))
    batch, scales = preprocess(images, loaded.localizer.spec)  # scales: (w / S, h / S) of the images given
    k = torch.cat([scales, scales], dim=1)  # [n, 4]
    final = torch.tensor(boxes, dtype=torch.float32) / k
    _, _, conf = score_boxes(loaded.localizer, batch, final[:, None], proto, neg, cal)
    return [Judged(b, s, float(c), float(c) >= cut) for b, s, c in zip(boxes, scores, conf[:, 0], strict=True)]
