"""Platt scaling and its measures, pure math on tensors (``models.calibration`` fits and serves them).

``fit_platt``: a logistic regression of right / wrong on an answer's features, by Newton's method with Platt's
smoothed targets; ``PlattFit``: the stored fit (JSON-friendly lists); ``reliability_bins`` and
``expected_calibration_error``: how well confidences match accuracies; ``auroc``: how well a score ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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
    names = names or [f"x{k}" for k in range(x.shape[1])]
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


def auroc(score: Tensor, y: Tensor) -> float:
    """Area under the ROC curve of ``score [n]`` (higher: more likely ``y``) -> in [0, 1] (0.5: no better than
    chance, also without both classes). Ties count half."""
    pos, neg = score[y.bool()], score[~y.bool()]
    if not len(pos) or not len(neg):
        return 0.5
    return float((pos[:, None] > neg[None]).double().mean() + 0.5 * (pos[:, None] == neg[None]).double().mean())
