"""Calibrated confidence for localize answers: "is the box on the object?" as a probability.

An answer's score (the embedding distance of its box to the prototype, lower is closer) has no scale a user
can threshold: it depends on the bundle, the set and the policy. This module turns it into
``P(answer correct)`` per exemplar set and policy, without labels from the user:

- *positives*: the set's exemplar crops pasted into backgrounds at random places and scales (exact boxes known,
  ``models.data.probes``), plus the set's labeled examples; an answer there is correct when its IoU with the
  pasted box is at least 0.5;
- *negatives*: the backgrounds alone (nothing to find: any answer is wrong), and the user's negative exemplars
  (look-alikes to avoid) pasted into them.

The policy as served runs on both; Platt's logistic regression fits ``P(correct)`` on the answers' features:
``log d_p`` (the score), and, for a set with negative exemplars, ``log d_p - log min_j d_n,j`` (how much closer
the box is to the prototype than to the nearest look-alike: a log likelihood ratio under isotropic noise). The
regression chooses the weight of each feature, so how much the negatives count is learned from the pasted
look-alikes rather than set by hand.

The fit itself and its measures (Platt's regression, ECE, reliability bins, AUROC) are pure math in
``models.core.platt``; this module makes the features, runs the policy on the samples
(``models.data.calibration_samples``: backgrounds, pastes) and fits on its answers. Template matching (NCC) is
``models.core.templates``; the known-kinds check, ``models.verifier``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from models.core.boxes import paired_iou
from models.core.platt import PlattFit, auroc, expected_calibration_error, fit_platt
from models.core.templates import Templates, box_ncc_sets, make_templates, match_crops, mean_ncc, source_template
from models.data.calibration_samples import PROBE_SCALE, Samples, make_samples, synthetic_backgrounds, transformed_crops
from models.data.probes import paste_probes
from models.data.types import LabeledImages
from models.inference import Localizer, normalize
from models.nets.agent import Agent
from models.verifier import KindCheck, KindVerifier

FEATURES = ("log_score", "log_ratio")
"""The features a fit may use, in this order: ``log d_p`` and ``log d_p - log min_j d_n,j``."""
NCC_FEATURES = ("log_score", "ncc", "ncc_negatives")
"""The features an NCC fit may use (``ncc_features``): ``log d_p``, the mean NCC of the box with the exemplars,
with the negatives. The fits made here use the NCCs alone (``NCC_FIT``); a stored fit names its own."""
NCC_FIT = ("ncc", "ncc_negatives")
"""Without ``log d_p``: pasted crops score farther from the prototype than real objects do (cMNIST validation:
median log d_p 5.3 pasted, 4.35 real 4s, 5.17 other digits), so a fit that uses the score learns a threshold
other objects pass (precision of found 0.63 vs 0.78 without it, recall 0.99 vs 0.95, on 100 validation 4s and
108 other digits)."""
EPS = 1e-6
DEFAULT_THRESHOLD = 0.5

# --- features of an answer


def features(scores: Tensor, negative_distances: Tensor | None = None) -> Tensor:
    """Answer scores ``[n]`` (and the min distance of each answer's box to the negatives ``[n]``) -> ``[n, k]``."""
    log_d = scores.double().clamp(min=EPS).log()
    if negative_distances is None:
        return log_d[:, None]
    return torch.stack([log_d, log_d - negative_distances.double().clamp(min=EPS).log()], dim=1)


# --- template features (``models.core.templates``)

NCC_FOR_GRAY = True
"""The NCC fits by default for bundles of grayscale input only: measured on cMNIST they raise the precision of
``found`` (0.53 -> 0.68; 0.55 -> 0.76 with negatives); on photos they help one class of four and mislead on
three (BENCHMARKS.md, "Not found"), where the score's fit stays."""


def ncc_features(names: list[str], scores: Tensor | None, ncc: Tensor, ncc_negatives: Tensor | None = None
                 ) -> Tensor:
    """The columns ``names`` (of ``NCC_FEATURES``) -> ``[n, len(names)]``: ``log_score`` (``log d_p`` of
    ``scores [n]``), ``ncc`` (mean NCC with the exemplars ``[n]``), ``ncc_negatives`` (with the negatives)."""
    cols = {"ncc": ncc, "ncc_negatives": ncc_negatives,
            "log_score": None if scores is None else scores.double().clamp(min=EPS).log()}
    missing = [k for k in names if cols[k] is None]
    if missing:
        raise ValueError(f"features {missing} are needed and were not given")
    return torch.stack([cols[k].double() for k in names], dim=1)  # type: ignore[union-attr]


@dataclass
class Calibration:
    """A policy's calibration: the Platt fit on the score alone (always) and, for a set with negative
    exemplars, one on the score and the negatives' log ratio; with ``templates`` (calibrations made since
    issue 13's NCC features: format version 2), also a fit on the score and the box's NCC with the exemplars
    (``ncc``) and, with negative templates, one that adds the NCC with the negatives (``ncc_negatives``); the
    threshold on the probability that makes an answer ``found``. Stored as JSON (``to_dict``); a version-1 dict
    (no NCC) loads and answers as it did."""

    score: PlattFit
    negatives: PlattFit | None = None
    threshold: float = DEFAULT_THRESHOLD
    stats: dict[str, Any] = field(default_factory=dict)
    """How it was made: sample counts, ECE and Brier score on the fit samples, the hit rate on positives."""
    ncc: PlattFit | None = None
    ncc_negatives: PlattFit | None = None
    templates: Templates | None = None
    kind: KindCheck | None = None
    """A set of a kind the bundle's verifier knows (``models.verifier``, format version 3): where that verifier is
    at hand, its probability that the box is the set's kind is the confidence, in place of the fits'."""

    def kind_applies(self, verifier: KindVerifier | None) -> bool:
        """Whether ``verifier`` is the one this calibration's ``kind`` check was made with (and there is one)."""
        return self.kind is not None and self.kind.made_with(verifier) and self.templates is not None

    def kind_confidence(self, verifier: KindVerifier | None, images01: Tensor, boxes: Tensor) -> Tensor | None:
        """Boxes ``[n, K, 4]`` (input pixels of ``images01 [n, C, S, S]``) -> the kind check's ``P`` ``[n, K]``
        (float64), or ``None`` where it does not apply (``kind_applies``)."""
        with torch.no_grad():
            if not self.kind_applies(verifier):
                return None
            return self.kind.probability(verifier.embed_boxes(images01, boxes))  # type: ignore[union-attr]

    def confidence(self, scores: Tensor, negative_distances: Tensor | None = None, *, ncc: Tensor | None = None,
                   ncc_negatives: Tensor | None = None) -> Tensor:
        """Answer scores ``[n]`` -> calibrated ``P(correct)`` ``[n]``. The richest fit the inputs allow: with
        ``ncc`` (and a fit for it), the NCC fit -- with ``ncc_negatives`` too, the one with the negatives';
        else with ``negative_distances`` (and a fit for them), the negatives' log-ratio fit; else the score's."""
        if ncc is not None and self.ncc is not None:
            fit = self.ncc_negatives if ncc_negatives is not None and self.ncc_negatives is not None else self.ncc
            return fit.probability(ncc_features(fit.features, scores, ncc, ncc_negatives))
        if negative_distances is not None and self.negatives is not None:
            return self.negatives.probability(features(scores, negative_distances))
        return self.score.probability(features(scores))

    def box_confidence(self, images01: Tensor, boxes: Tensor, scores: Tensor,
                       negative_distances: Tensor | None = None, verifier: KindVerifier | None = None) -> Tensor:
        """Boxes ``[n, K, 4]`` (pixels of ``images01 [n, C, S, S]``, the bundle's input) with their scores
        ``[n, K]`` -> ``P(correct)`` ``[n, K]`` (float64): the kind check's where ``verifier`` is its own
        (``kind_confidence``), else the NCC features read from the images when the calibration has templates
        (``confidence``)."""
        with torch.no_grad():
            kind = self.kind_confidence(verifier, images01, boxes)
            if kind is not None:
                return kind
            if self.templates is None or self.ncc is None:
                nd = None if negative_distances is None else negative_distances.flatten()
                return self.confidence(scores.flatten(), nd).view(scores.shape)
            pos, neg = self.templates.ncc(images01, boxes)
            return self.confidence(scores.flatten(), ncc=pos.flatten(),
                                   ncc_negatives=None if neg is None else neg.flatten()).view(scores.shape)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"version": 1, "score": asdict(self.score),
                             "negatives": None if self.negatives is None else asdict(self.negatives),
                             "threshold": self.threshold, "stats": self.stats}
        if self.ncc is not None or self.templates is not None:
            d.update(version=2, ncc=None if self.ncc is None else asdict(self.ncc),
                     ncc_negatives=None if self.ncc_negatives is None else asdict(self.ncc_negatives),
                     templates=None if self.templates is None else self.templates.to_dict())
        if self.kind is not None:
            d.update(version=3, kind=self.kind.to_dict())
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        def fit(key: str) -> PlattFit | None:
            return PlattFit(**d[key]) if d.get(key) else None

        return cls(PlattFit(**d["score"]), fit("negatives"), float(d.get("threshold", 0.5)),
                   dict(d.get("stats") or {}), fit("ncc"), fit("ncc_negatives"),
                   Templates.from_dict(d["templates"]) if d.get("templates") else None,
                   KindCheck.from_dict(d["kind"]) if d.get("kind") else None)


def fit_calibration(pos: Tensor, pos_hit: Tensor, neg: Tensor, *, pos_neg: Tensor | None = None,
                    neg_neg: Tensor | None = None, threshold: float = DEFAULT_THRESHOLD,
                    pos_ncc: Tensor | None = None, neg_ncc: Tensor | None = None,
                    pos_ncc_neg: Tensor | None = None, neg_ncc_neg: Tensor | None = None,
                    templates: Templates | None = None) -> Calibration:
    """Answers on positives (scores ``pos [n]``, ``pos_hit [n]``: IoU >= 0.5) and on negatives (scores
    ``neg [m]``, all wrong) -> a ``Calibration``. With the min distances of the answers' boxes to the negative
    exemplars (``pos_neg``, ``neg_neg``), also the fit that uses them; with the answers' mean NCC with the
    exemplars (``pos_ncc``, ``neg_ncc``: leave-one-out on positives made from an exemplar) the NCC fit, and
    with their NCC with the negatives (``pos_ncc_neg``, ``neg_ncc_neg``) the NCC fit with negatives. ``stats``
    describe the richest fit."""
    y = torch.cat([pos_hit.bool(), torch.zeros(len(neg), dtype=torch.bool)])
    s = torch.cat([pos, neg])
    fit = fit_platt(features(s), y, ["log_score"])
    neg_fit = None
    if pos_neg is not None and neg_neg is not None:
        neg_fit = fit_platt(features(s, torch.cat([pos_neg, neg_neg])), y, list(FEATURES))
    cal = Calibration(fit, neg_fit, threshold, templates=templates)
    p = cal.confidence(s, None if neg_fit is None else torch.cat([pos_neg, neg_neg]))  # type: ignore[list-item]
    if pos_ncc is not None and neg_ncc is not None:  # its negatives may be more (``Samples.shapes``)
        y = torch.cat([pos_hit.bool(), torch.zeros(len(neg_ncc), dtype=torch.bool)])
        ncc = torch.cat([pos_ncc, neg_ncc])
        cal.ncc = fit_platt(ncc_features(list(NCC_FIT[:1]), None, ncc), y, list(NCC_FIT[:1]))
        ncc_n = None
        if pos_ncc_neg is not None and neg_ncc_neg is not None:
            ncc_n = torch.cat([pos_ncc_neg, neg_ncc_neg])
            cal.ncc_negatives = fit_platt(ncc_features(list(NCC_FIT), None, ncc, ncc_n), y, list(NCC_FIT))
        p = cal.confidence(torch.ones(len(y)), ncc=ncc, ncc_negatives=ncc_n)
    hit_rate = round(float(pos_hit.float().mean()), 4) if len(pos) else None
    cal.stats = {"positives": len(pos), "negatives": len(neg), "positive_hit_rate": hit_rate,
                 "ece": round(expected_calibration_error(p, y), 4),
                 "brier": round(float(((p - y.double()) ** 2).mean()), 4)}
    return cal


def box_distances(localizer: Localizer, images01: Tensor, boxes: Tensor, embeddings: Tensor,
                  chunk: int = 128) -> Tensor:
    """Distances of each image's boxes ``boxes [n, K, 4]`` (input pixels) to each of ``embeddings [J, D]``
    -> ``[n, K, J]``, under ``localizer``'s head (the backbone run once per image)."""
    with torch.no_grad():
        out = []
        emb = embeddings.to(localizer.device).float()
        for i in range(0, len(images01), chunk):
            feats = localizer.embedder.features(normalize(images01[i:i + chunk].to(localizer.device), localizer.spec))
            e = localizer.embedder.embed(feats, boxes[i:i + chunk].to(localizer.device).float())  # [b, K, D]
            out.append(torch.cdist(e, emb[None].expand(len(e), -1, -1)).cpu())
        return torch.cat(out) if out else torch.zeros(0, boxes.shape[1], len(embeddings))


def answers(localizer: Localizer, agent: Agent, prototype: Tensor, images01: Tensor, *, nearest: bool,
            chunk: int = 128) -> tuple[Tensor, Tensor]:
    """The policy's greedy answers as localize serves them (no ``samples``) -> (boxes ``[n, 4]``, scores ``[n]``)."""
    with torch.no_grad():
        boxes, scores = [], []
        for i in range(0, len(images01), chunk):
            ro = localizer.run(images01[i:i + chunk], prototype, agent, nearest=nearest)
            boxes.append(ro.boxes[-1].cpu())
            scores.append(ro.distances[-1].cpu())
        return torch.cat(boxes), torch.cat(scores)


def _sources(known: Tensor | None, images01: Tensor, true_boxes: Tensor, templates: Tensor) -> Tensor:
    """Each sample's source template: as pasted (``known``, where >= 0), else found (``source_template``)."""
    found = source_template(images01, true_boxes, templates)
    if known is None:
        return found
    return torch.where(known >= 0, known, found)


def template_features(samples: Samples, pos_boxes: Tensor, neg_boxes: Tensor, templates: Templates
                      ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """The NCC features of the answers' boxes on the fit samples (``pos_boxes [n, 4]`` on the positives,
    ``neg_boxes [m, 4]`` on the negatives) -> (positives' mean NCC with the exemplars, negatives' one, and the
    same with the negative templates, or None).

    Leave-one-out: a positive made from exemplar ``i`` (pasted, or a labeled example whose box is its crop) is
    compared with the other exemplars only, and a negative made from look-alike ``j`` with the other
    look-alikes: compared with itself it would match almost perfectly, which no real image does. The source of a
    pasted sample is known (``paste_probes``' ``sources``); that of a labeled example is found
    (``source_template``: the template matching its box best, its crop). At answer time,
    every template counts (``Templates.ncc``)."""
    t, nt = templates.exemplars, templates.negatives
    pos_img, neg_img = samples.positives.images, samples.negatives
    src = _sources(samples.positives.sources, pos_img, samples.positives.boxes, t)
    sets = [t] if nt is None or not len(nt) else [t, nt]  # each box read once for both sets
    pos_read = box_ncc_sets(pos_img, pos_boxes[:, None], sets, jitter=templates.jitter)
    neg_read = box_ncc_sets(neg_img, neg_boxes[:, None], sets, jitter=templates.jitter)
    pos_ncc, neg_ncc = mean_ncc(pos_read[0][:, 0], src), mean_ncc(neg_read[0][:, 0])
    if nt is None or not len(nt):
        return pos_ncc, neg_ncc, None, None
    nboxes = samples.negative_boxes if samples.negative_boxes is not None else torch.full((len(neg_img), 4), torch.nan)
    nsrc = _sources(samples.negative_sources, neg_img, nboxes, nt)
    return pos_ncc, neg_ncc, mean_ncc(pos_read[1][:, 0]), mean_ncc(neg_read[1][:, 0], nsrc)


def calibrate(localizer: Localizer, agent: Agent, prototype: Tensor, samples: Samples, *, nearest: bool,
              negative_embeddings: Tensor | None = None, threshold: float = DEFAULT_THRESHOLD,
              templates: Templates | None = None) -> Calibration:
    """Run the served policy on ``samples`` and fit its calibration (with ``negative_embeddings [J, D]``, also
    the fit on the negatives' log ratio; with ``templates`` of at least 2 exemplars, the NCC fits)."""
    pb, ps = answers(localizer, agent, prototype, samples.positives.images, nearest=nearest)
    nb, ns = answers(localizer, agent, prototype, samples.negatives, nearest=nearest)
    hit = paired_iou(pb, samples.positives.boxes) >= 0.5
    pos_neg = neg_neg = None
    if negative_embeddings is not None and len(negative_embeddings):
        emb = negative_embeddings
        pos_neg = box_distances(localizer, samples.positives.images, pb[:, None], emb)[:, 0].min(-1).values
        neg_neg = box_distances(localizer, samples.negatives, nb[:, None], emb)[:, 0].min(-1).values
    ncc: tuple[Tensor | None, ...] = (None,) * 4
    if templates is not None and len(templates.exemplars) >= 2:  # leave-one-out needs another exemplar
        if templates.negatives is not None and len(templates.negatives) < 2:
            templates = replace(templates, negatives=None)
        ncc = template_features(samples, pb, nb, templates)
        all_ns = ns
        if samples.shapes is not None and len(samples.shapes):
            shb, shs = answers(localizer, agent, prototype, samples.shapes, nearest=nearest)
            none = LabeledImages(samples.positives.images[:0], samples.positives.boxes[:0])
            sh = template_features(Samples(none, samples.shapes), pb[:0], shb, templates)
            ncc = (ncc[0], torch.cat([ncc[1], sh[1]]), ncc[2],  # type: ignore[list-item]
                   None if ncc[3] is None else torch.cat([ncc[3], sh[3]]))  # type: ignore[list-item]
            all_ns = torch.cat([ns, shs])
        # How well each feature tells right answers from answers on *other objects* (scrambled exemplars,
        # look-alikes, other shapes; empty backgrounds the score rejects anyway) on the set's own samples: recorded
        # in ``stats``. Not a reliable chooser (BENCHMARKS.md, "Not found": on cMNIST it prefers the score, which
        # real look-alikes fool; on photos of mammals the NCC, which misleads there), so the caller decides.
        objects = samples.negative_objects
        if objects is None:
            objects = torch.ones(len(ns), dtype=torch.bool)
        hard = torch.cat([objects, torch.ones(len(all_ns) - len(ns), dtype=torch.bool)])
        y = torch.cat([hit, torch.zeros(int(hard.sum()), dtype=torch.bool)])
        choice = {"auroc_score": round(auroc(-torch.cat([ps, all_ns[hard]]).double(), y), 4),
                  "auroc_ncc": round(auroc(torch.cat([ncc[0], ncc[1][hard]]).double(), y), 4)}  # type: ignore[index]
    else:
        templates, choice = None, {}
    cal = fit_calibration(ps, hit, ns, pos_neg=pos_neg, neg_neg=neg_neg, threshold=threshold, pos_ncc=ncc[0],
                          neg_ncc=ncc[1], pos_ncc_neg=ncc[2], neg_ncc_neg=ncc[3], templates=templates)
    cal.stats.update(choice)
    if not math.isfinite(cal.score.bias):
        raise ValueError("calibration did not converge")
    return cal


def calibrate_policy(localizer: Localizer, prototype: Tensor, crops: list[Tensor], *, nearest: bool,
                     agent_state: dict[str, Tensor] | None = None, n: int = 128, seed: int = 0,
                     labeled: LabeledImages | None = None, backgrounds01: Tensor | None = None,
                     positives: LabeledImages | None = None, negative_crops: list[Tensor] | None = None,
                     negative_embeddings: Tensor | None = None, threshold: float = DEFAULT_THRESHOLD,
                     ncc: bool | None = None, negative_templates: Tensor | None = None,
                     verifier: KindVerifier | None = None) -> Calibration:
    """The calibration of one policy (``agent_state``; ``None``: the bundle's) of a set, from what the set has.

    Backgrounds: ``n`` synthesized ones (``synthetic_backgrounds``), plus ``backgrounds01`` where the caller has
    real images without the object (an adaptation job's images with its answers erased, the set's labeled
    examples with their boxes erased). Positives: ``n`` crops pasted into them, the ``labeled`` examples, and
    ``positives`` made elsewhere (a job's probes). With ``ncc`` (``None``: for grayscale bundles only,
    ``NCC_FOR_GRAY``) and at least 2 crops, also the NCC fits and
    the templates they need (``Templates``: the crops, and the ``negative_crops`` -- or, where the crops are
    gone, ``negative_templates [J, C, s, s]`` kept from an earlier calibration, ``stored_negative_templates``).
    With ``verifier`` (the bundle's, ``models.verifier``) and the NCC fits, also the set's kind check where the set
    is of a kind it knows (``KindVerifier.check``: the crops and the ``negative_crops``).
    Seeded: the same inputs give the same calibration (the NCC parts draw no random numbers: the other fits
    are those made without them)."""
    gen = torch.Generator().manual_seed(seed)
    spec = localizer.spec
    bgs = synthetic_backgrounds(crops, spec, n, gen)
    if backgrounds01 is not None and len(backgrounds01):
        bgs = torch.cat([bgs, backgrounds01.float()])
    samples = make_samples(crops, bgs, n, object_side=spec.exemplar_size, generator=gen,
                           negative_crops=negative_crops, labeled=labeled)
    if positives is not None and len(positives):
        known = samples.positives.sources
        samples.positives = LabeledImages(  # a job's probes: their sources are found (another list of crops)
            torch.cat([samples.positives.images, positives.images]),
            torch.cat([samples.positives.boxes, positives.boxes]),
            sources=None if known is None else torch.cat([known, torch.full((len(positives),), -1, dtype=torch.long)]))
    templates = None
    if ncc is None:
        ncc = NCC_FOR_GRAY and spec.channels == 1
    if ncc:
        neg_t = make_templates(negative_crops) if negative_crops else negative_templates
        templates = Templates(make_templates(crops), neg_t, spec.size, spec.channels, tuple(spec.fill),
                              crops=(kept := match_crops(crops))[0], crop_sizes=kept[1])
        shapes = transformed_crops(crops, templates.exemplars)
        if shapes:  # their own generator: the samples of the other fits are those made without NCC
            samples.shapes = paste_probes(shapes, bgs, n // 2, object_side=spec.exemplar_size, scale=PROBE_SCALE,
                                          generator=torch.Generator().manual_seed(seed + 1)).images
    agent = localizer.agent(agent_state)
    cal = calibrate(localizer, agent, prototype, samples, nearest=nearest, negative_embeddings=negative_embeddings,
                    threshold=threshold, templates=templates)
    if verifier is not None and cal.templates is not None:
        cal.kind = verifier.check(crops, negative_crops)
        if cal.kind is not None:
            cal.stats.update(kind=cal.kind.kind, known=cal.kind.known)
    return cal


def stored_kind(calibration: dict[str, Any] | None) -> KindCheck | None:
    """The kind check kept in a stored calibration dict (None: none), for a refresh: it depends on the set's crops
    and negative exemplars only, not on the policy."""
    d = (calibration or {}).get("kind")
    return KindCheck.from_dict(d) if d else None


def stored_negative_templates(calibration: dict[str, Any] | None) -> Tensor | None:
    """The negative exemplars' templates kept in a stored calibration dict (None: none kept), for a refresh
    that no longer has the negative crops (an adaptation job's)."""
    t = (calibration or {}).get("templates")
    return Templates.from_dict(t).negatives if t else None


def score_boxes(localizer: Localizer, images01: Tensor, boxes: Tensor, prototype: Tensor, negatives: Tensor | None,
                cal: Calibration) -> tuple[Tensor, Tensor, Tensor]:
    """Boxes ``[n, K, 4]`` (input pixels) of images ``images01 [n, C, S, S]`` -> (distance to the prototype
    ``[n, K]``, min distance to the negative exemplars ``negatives [J, D]`` ``[n, K]`` (inf without), calibrated
    confidence ``[n, K]`` by the richest fit of ``cal`` (``Calibration.box_confidence``: the NCC fits where it
    has templates, else the negatives' log-ratio fit, else the score's)."""
    with torch.no_grad():
        has_neg = negatives is not None and len(negatives) > 0
        emb = torch.cat([prototype[None].float(), negatives.float()]) if has_neg else prototype[None].float()  # type: ignore[union-attr]
        d = box_distances(localizer, images01, boxes, emb)
        d_p = d[..., 0]
        d_n = d[..., 1:].min(-1).values if has_neg else torch.full_like(d_p, torch.inf)
        conf = cal.box_confidence(images01, boxes, d_p, d_n if has_neg and cal.negatives is not None else None)
        return d_p, d_n, conf.float()

