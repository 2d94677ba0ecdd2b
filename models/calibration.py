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

The first half is pure math on tensors (fit, apply, ECE, reliability bins); the second makes the samples
(backgrounds, pastes, the policy's answers).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from models.config import InputSpec
from models.core.boxes import paired_iou
from models.data.probes import paste_probes
from models.data.types import LabeledImages
from models.inference import Localizer, normalize
from models.nets.agent import Agent

FEATURES = ("log_score", "log_ratio")
"""The features a fit may use, in this order: ``log d_p`` and ``log d_p - log min_j d_n,j``."""
EPS = 1e-6
DEFAULT_THRESHOLD = 0.5
PROBE_SCALE = (0.85, 1.15)
"""Pasted crops' long side, as a factor of the bundle's ``exemplar_size``: near the scale the agent sees objects
(``models.guard``'s probes range wider, 0.6-1.2, to compare policies; here the answers' scores should look like
those of real objects, and small pastes score far worse than real objects do on cMNIST)."""

# --- pure math


def features(scores: Tensor, negative_distances: Tensor | None = None) -> Tensor:
    """Answer scores ``[n]`` (and the min distance of each answer's box to the negatives ``[n]``) -> ``[n, k]``."""
    log_d = scores.double().clamp(min=EPS).log()
    if negative_distances is None:
        return log_d[:, None]
    return torch.stack([log_d, log_d - negative_distances.double().clamp(min=EPS).log()], dim=1)


@dataclass
class PlattFit:
    """``P = sigmoid(bias + sum_k weights[k] * (x_k - mean[k]) / std[k])``."""

    features: list[str]
    mean: list[float]
    std: list[float]
    weights: list[float]
    bias: float

    def probability(self, x: Tensor) -> Tensor:
        """``[n, k]`` features -> ``[n]`` probabilities (float64)."""
        if x.dim() != 2 or x.shape[1] != len(self.weights):
            raise ValueError(f"expected features [n, {len(self.weights)}], got {list(x.shape)}")
        z = (x.double() - torch.tensor(self.mean, dtype=torch.float64)) / torch.tensor(self.std, dtype=torch.float64)
        return torch.sigmoid(z @ torch.tensor(self.weights, dtype=torch.float64) + self.bias)


def fit_platt(x: Tensor, y: Tensor, names: list[str] | None = None, *, l2: float = 1e-3, iterations: int = 50
              ) -> PlattFit:
    """Logistic regression of ``y [n]`` (bool) on ``x [n, k]`` by Newton's method, with Platt's smoothed targets
    (``(N+ + 1) / (N+ + 2)`` and ``1 / (N- + 2)``: a few samples never give a probability of exactly 0 or 1) and
    a small ridge ``l2`` on the weights (separable samples still give a finite fit). Features are standardized
    first. Deterministic."""
    if x.dim() != 2 or y.dim() != 1 or len(x) != len(y):
        raise ValueError(f"expected x [n, k] and y [n]; got {list(x.shape)} and {list(y.shape)}")
    if len(y) < 2:
        raise ValueError("a calibration needs at least 2 samples")
    x, yb = x.double(), y.bool()
    n_pos, n_neg = int(yb.sum()), int((~yb).sum())
    t = torch.where(yb, (n_pos + 1.0) / (n_pos + 2.0), 1.0 / (n_neg + 2.0)).double()
    mean, std = x.mean(0), x.std(0, unbiased=False).clamp(min=1e-9)
    z = torch.cat([torch.ones(len(x), 1, dtype=torch.float64), (x - mean) / std], dim=1)  # [n, k + 1]
    w = torch.zeros(z.shape[1], dtype=torch.float64)
    ridge = torch.full((z.shape[1],), l2 * len(x), dtype=torch.float64)
    ridge[0] = 0.0  # the bias is not shrunk
    for _ in range(iterations):
        p = torch.sigmoid(z @ w)
        grad = z.T @ (p - t) + ridge * w
        hess = (z * (p * (1 - p))[:, None]).T @ z + torch.diag(ridge) + 1e-9 * torch.eye(len(w), dtype=torch.float64)
        step = torch.linalg.solve(hess, grad)
        w = w - step
        if float(step.abs().max()) < 1e-10:
            break
    names = names or list(FEATURES[: x.shape[1]])
    return PlattFit(list(names), mean.tolist(), std.tolist(), w[1:].tolist(), float(w[0]))


def reliability_bins(p: Tensor, y: Tensor, bins: int = 10) -> list[dict[str, float]]:
    """Equal-width bins of the confidences ``p [n]`` -> per non-empty bin ``{lo, hi, n, confidence, accuracy}``
    (the mean confidence and the share of correct answers ``y`` in it): the reliability curve."""
    p, y = p.double(), y.double()
    idx = (p * bins).long().clamp(0, bins - 1)
    out = []
    for b in range(bins):
        m = idx == b
        if m.any():
            out.append({"lo": b / bins, "hi": (b + 1) / bins, "n": int(m.sum()),
                        "confidence": float(p[m].mean()), "accuracy": float(y[m].mean())})
    return out


def expected_calibration_error(p: Tensor, y: Tensor, bins: int = 10) -> float:
    """ECE: the mean over answers of |mean confidence - accuracy| of their bin (equal-width ``bins``)."""
    if len(p) == 0:
        return float("nan")
    return sum(b["n"] * abs(b["confidence"] - b["accuracy"]) for b in reliability_bins(p, y, bins)) / len(p)


@dataclass
class Calibration:
    """A policy's calibration: the Platt fit on the score alone (always) and, for a set with negative
    exemplars, one on the score and the negatives' log ratio; the threshold on the probability that
    makes an answer ``found``. Stored as JSON (``to_dict``)."""

    score: PlattFit
    negatives: PlattFit | None = None
    threshold: float = DEFAULT_THRESHOLD
    stats: dict[str, Any] = field(default_factory=dict)
    """How it was made: sample counts, ECE and Brier score on the fit samples, the hit rate on positives."""

    def confidence(self, scores: Tensor, negative_distances: Tensor | None = None) -> Tensor:
        """Answer scores ``[n]`` -> calibrated ``P(correct)`` ``[n]``; with ``negative_distances`` (and a fit
        for them), the negatives' fit."""
        if negative_distances is not None and self.negatives is not None:
            return self.negatives.probability(features(scores, negative_distances))
        return self.score.probability(features(scores))

    def to_dict(self) -> dict[str, Any]:
        return {"version": 1, "score": asdict(self.score),
                "negatives": None if self.negatives is None else asdict(self.negatives),
                "threshold": self.threshold, "stats": self.stats}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        neg = d.get("negatives")
        return cls(PlattFit(**d["score"]), PlattFit(**neg) if neg else None, float(d.get("threshold", 0.5)),
                   dict(d.get("stats") or {}))


def fit_calibration(pos: Tensor, pos_hit: Tensor, neg: Tensor, *, pos_neg: Tensor | None = None,
                    neg_neg: Tensor | None = None, threshold: float = DEFAULT_THRESHOLD) -> Calibration:
    """Answers on positives (scores ``pos [n]``, ``pos_hit [n]``: IoU >= 0.5) and on negatives (scores
    ``neg [m]``, all wrong) -> a ``Calibration``. With the min distances of the answers' boxes to the negative
    exemplars (``pos_neg``, ``neg_neg``), also the fit that uses them."""
    y = torch.cat([pos_hit.bool(), torch.zeros(len(neg), dtype=torch.bool)])
    s = torch.cat([pos, neg])
    fit = fit_platt(features(s), y, ["log_score"])
    neg_fit = None
    if pos_neg is not None and neg_neg is not None:
        neg_fit = fit_platt(features(s, torch.cat([pos_neg, neg_neg])), y, list(FEATURES))
    cal = Calibration(fit, neg_fit, threshold)
    p = cal.confidence(s, None if neg_fit is None else torch.cat([pos_neg, neg_neg]))  # type: ignore[list-item]
    hit_rate = round(float(pos_hit.float().mean()), 4) if len(pos) else None
    cal.stats = {"positives": len(pos), "negatives": len(neg), "positive_hit_rate": hit_rate,
                 "ece": round(expected_calibration_error(p, y), 4),
                 "brier": round(float(((p - y.double()) ** 2).mean()), 4)}
    return cal


# --- samples


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


def make_samples(crops: list[Tensor], backgrounds01: Tensor, n: int, *, object_side: float,
                 generator: torch.Generator, negative_crops: list[Tensor] | None = None,
                 labeled: LabeledImages | None = None) -> Samples:
    """``n`` positives (``crops`` pasted into ``backgrounds01``, plus the ``labeled`` examples) and ``n``
    negatives: the backgrounds as they are, scrambled exemplars pasted (``scrambled_crops``), and with
    ``negative_crops`` the user's look-alikes pasted (a third each; without look-alikes, half and half)."""
    pos = paste_probes(crops, backgrounds01, n, object_side=object_side, scale=PROBE_SCALE, generator=generator)
    if labeled is not None and len(labeled):
        pos = LabeledImages(torch.cat([labeled.images, pos.images]), torch.cat([labeled.boxes, pos.boxes]))
    n_look = n // 3 if negative_crops else 0
    n_scr = (n - n_look) // 2
    plain = backgrounds01[torch.randint(len(backgrounds01), (n - n_look - n_scr,), generator=generator)]
    parts = [plain]
    for these, k in ((scrambled_crops(crops, generator), n_scr), (negative_crops, n_look)):
        if k and these:
            parts.append(paste_probes(these, backgrounds01, k, object_side=object_side, scale=PROBE_SCALE,
                                      generator=generator).images)
    return Samples(pos, torch.cat(parts))


@torch.no_grad()
def box_distances(localizer: Localizer, images01: Tensor, boxes: Tensor, embeddings: Tensor,
                  chunk: int = 128) -> Tensor:
    """Distances of each image's boxes ``boxes [n, K, 4]`` (input pixels) to each of ``embeddings [J, D]``
    -> ``[n, K, J]``, under ``localizer``'s head (the backbone run once per image)."""
    out = []
    emb = embeddings.to(localizer.device).float()
    for i in range(0, len(images01), chunk):
        feats = localizer.embedder.features(normalize(images01[i:i + chunk].to(localizer.device), localizer.spec))
        e = localizer.embedder.embed(feats, boxes[i:i + chunk].to(localizer.device).float())  # [b, K, D]
        out.append(torch.cdist(e, emb[None].expand(len(e), -1, -1)).cpu())
    return torch.cat(out) if out else torch.zeros(0, boxes.shape[1], len(embeddings))


@torch.no_grad()
def answers(localizer: Localizer, agent: Agent, prototype: Tensor, images01: Tensor, *, nearest: bool,
            chunk: int = 128) -> tuple[Tensor, Tensor]:
    """The policy's greedy answers as localize serves them (no ``samples``) -> (boxes ``[n, 4]``, scores ``[n]``)."""
    boxes, scores = [], []
    for i in range(0, len(images01), chunk):
        ro = localizer.run(images01[i:i + chunk], prototype, agent, nearest=nearest)
        boxes.append(ro.boxes[-1].cpu())
        scores.append(ro.distances[-1].cpu())
    return torch.cat(boxes), torch.cat(scores)


def calibrate(localizer: Localizer, agent: Agent, prototype: Tensor, samples: Samples, *, nearest: bool,
              negative_embeddings: Tensor | None = None, threshold: float = DEFAULT_THRESHOLD) -> Calibration:
    """Run the served policy on ``samples`` and fit its calibration (with ``negative_embeddings [J, D]``, also
    the fit on the negatives' log ratio)."""
    pb, ps = answers(localizer, agent, prototype, samples.positives.images, nearest=nearest)
    nb, ns = answers(localizer, agent, prototype, samples.negatives, nearest=nearest)
    hit = paired_iou(pb, samples.positives.boxes) >= 0.5
    pos_neg = neg_neg = None
    if negative_embeddings is not None and len(negative_embeddings):
        emb = negative_embeddings
        pos_neg = box_distances(localizer, samples.positives.images, pb[:, None], emb)[:, 0].min(-1).values
        neg_neg = box_distances(localizer, samples.negatives, nb[:, None], emb)[:, 0].min(-1).values
    cal = fit_calibration(ps, hit, ns, pos_neg=pos_neg, neg_neg=neg_neg, threshold=threshold)
    if not math.isfinite(cal.score.bias):
        raise ValueError("calibration did not converge")
    return cal


def calibrate_policy(localizer: Localizer, prototype: Tensor, crops: list[Tensor], *, nearest: bool,
                     agent_state: dict[str, Tensor] | None = None, n: int = 128, seed: int = 0,
                     labeled: LabeledImages | None = None, backgrounds01: Tensor | None = None,
                     positives: LabeledImages | None = None, negative_crops: list[Tensor] | None = None,
                     negative_embeddings: Tensor | None = None, threshold: float = DEFAULT_THRESHOLD) -> Calibration:
    """The calibration of one policy (``agent_state``; ``None``: the bundle's) of a set, from what the set has.

    Backgrounds: ``n`` synthesized ones (``synthetic_backgrounds``), plus ``backgrounds01`` where the caller has
    real images without the object (an adaptation job's images with its answers erased, the set's labeled
    examples with their boxes erased). Positives: ``n`` crops pasted into them, the ``labeled`` examples, and
    ``positives`` made elsewhere (a job's probes). Seeded: the same inputs give the same calibration."""
    gen = torch.Generator().manual_seed(seed)
    spec = localizer.spec
    bgs = synthetic_backgrounds(crops, spec, n, gen)
    if backgrounds01 is not None and len(backgrounds01):
        bgs = torch.cat([bgs, backgrounds01.float()])
    samples = make_samples(crops, bgs, n, object_side=spec.exemplar_size, generator=gen,
                           negative_crops=negative_crops, labeled=labeled)
    if positives is not None and len(positives):
        samples.positives = LabeledImages(torch.cat([samples.positives.images, positives.images]),
                                          torch.cat([samples.positives.boxes, positives.boxes]))
    agent = localizer.agent(agent_state)
    return calibrate(localizer, agent, prototype, samples, nearest=nearest, negative_embeddings=negative_embeddings,
                     threshold=threshold)


@torch.no_grad()
def score_boxes(localizer: Localizer, images01: Tensor, boxes: Tensor, prototype: Tensor, negatives: Tensor,
                cal: Calibration) -> tuple[Tensor, Tensor, Tensor]:
    """Boxes ``[n, K, 4]`` (input pixels) of images ``images01 [n, C, S, S]`` -> (distance to the prototype
    ``[n, K]``, min distance to the negative exemplars ``negatives [J, D]`` ``[n, K]``, calibrated confidence
    ``[n, K]`` by the negatives' fit of ``cal``; its score fit if it has none)."""
    d = box_distances(localizer, images01, boxes, torch.cat([prototype[None].float(), negatives.float()]))
    d_p, d_n = d[..., 0], d[..., 1:].min(-1).values
    conf = cal.confidence(d_p.flatten(), d_n.flatten() if cal.negatives is not None else None).view_as(d_p)
    return d_p, d_n, conf.float()


def rerank(localizer: Localizer, images01: Tensor, paths: Tensor, prototype: Tensor, negatives: Tensor,
           cal: Calibration) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Among the boxes each episode visited (``paths [n, T+1, 4]``, input pixels; the first, the whole image,
    is left out), the one the calibration with negatives finds most likely right -> (its index in the path
    ``[n]``, its distance to the prototype ``[n]``, to the nearest negative ``[n]``, its confidence ``[n]``)."""
    d_p, d_n, conf = score_boxes(localizer, images01, paths[:, 1:], prototype, negatives, cal)
    k = conf.argmax(dim=1)
    rows = torch.arange(len(k))
    return k + 1, d_p[rows, k], d_n[rows, k], conf[rows, k]
