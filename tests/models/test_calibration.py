"""``models.calibration``: Platt fit, ECE and reliability bins on known distributions; samples; a real fit."""

import math

import pytest
import torch

from models.bundle import new_bundle
from models.calibration import (
    Calibration,
    expected_calibration_error,
    features,
    fit_calibration,
    fit_platt,
    make_samples,
    reliability_bins,
    scrambled_crops,
    synthetic_backgrounds,
)
from models.presets import mnist_config


def test_platt_recovers_a_known_logistic_model():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, 1, generator=g, dtype=torch.float64)
    y = torch.rand(20000, generator=g, dtype=torch.float64) < torch.sigmoid(0.5 - 2.0 * x[:, 0])
    fit = fit_platt(x, y, ["x"], l2=0.0)
    # weights are on standardized features: undo it
    w = fit.weights[0] / fit.std[0]
    b = fit.bias - fit.weights[0] * fit.mean[0] / fit.std[0]
    assert w == pytest.approx(-2.0, abs=0.1) and b == pytest.approx(0.5, abs=0.1)
    p = fit.probability(x)
    assert expected_calibration_error(p, y) < 0.02


def test_separable_samples_give_a_finite_fit_and_smoothed_probabilities():
    x = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    y = torch.tensor([True, True, False, False])
    fit = fit_platt(x, y)
    p = fit.probability(x)
    assert all(math.isfinite(v) for v in fit.weights) and float(p.min()) > 0 and float(p.max()) < 1
    assert p[0] > 0.5 > p[3]


def test_ece_and_bins_on_hand_made_values():
    p = torch.tensor([0.05, 0.05, 0.95, 0.95, 0.55, 0.55])
    y = torch.tensor([False, False, True, True, True, False])
    bins = reliability_bins(p, y, bins=10)
    assert [(b["n"], b["accuracy"]) for b in bins] == [(2, 0.0), (2, 0.5), (2, 1.0)]
    assert expected_calibration_error(p, y) == pytest.approx((2 * 0.05 + 2 * 0.05 + 2 * 0.05) / 6)
    assert expected_calibration_error(torch.tensor([1.0, 0.0]), torch.tensor([False, True])) == pytest.approx(1.0)


def test_fit_calibration_orders_scores_and_round_trips():
    g = torch.Generator().manual_seed(1)
    pos = torch.rand(200, generator=g) * 50 + 10   # near: right
    neg = torch.rand(200, generator=g) * 200 + 100  # far: wrong
    hit = torch.ones(200, dtype=torch.bool)
    cal = fit_calibration(pos, hit, neg, threshold=0.7)
    c = cal.confidence(torch.tensor([5.0, 60.0, 400.0]))
    assert c[0] > c[1] > c[2] and c[0] > 0.9 and c[2] < 0.1
    back = Calibration.from_dict(cal.to_dict())
    assert back.threshold == 0.7 and torch.allclose(back.confidence(pos), cal.confidence(pos))
    assert cal.stats["positives"] == 200 and cal.stats["ece"] < 0.1


def test_negatives_fit_uses_the_ratio():
    """Positives and look-alikes at the same distance to the prototype: only the negatives' distance tells them
    apart, and the fit with negatives does."""
    g = torch.Generator().manual_seed(2)
    d = torch.rand(400, generator=g) * 20 + 40
    near_neg = torch.rand(200, generator=g) * 5 + 5     # look-alikes: close to a negative exemplar
    far_neg = torch.rand(200, generator=g) * 50 + 100   # true objects: far from every negative
    cal = fit_calibration(d[:200], torch.ones(200, dtype=torch.bool), d[200:], pos_neg=far_neg, neg_neg=near_neg)
    with_neg = cal.confidence(d, torch.cat([far_neg, near_neg]))
    without = cal.confidence(d)
    assert float(with_neg[:200].mean()) > 0.9 > 0.1 > float(with_neg[200:].mean())
    assert abs(float(without[:200].mean()) - float(without[200:].mean())) < 0.2
    assert features(d, near_neg.repeat(2)).shape == (400, 2)


def test_samples_have_the_pasted_boxes_and_no_object_in_negatives():
    spec = mnist_config().input
    g = torch.Generator().manual_seed(0)
    crops = [torch.rand(1, 28, 28, generator=g) for _ in range(3)]
    bgs = synthetic_backgrounds(crops, spec, 16, g)
    assert bgs.shape == (16, 1, spec.size, spec.size) and float(bgs.min()) >= 0 and float(bgs.max()) <= 1
    scr = scrambled_crops(crops, g)
    assert len(scr) == 12  # 4 per crop, each its cells shuffled (never in place)
    for k, sc in enumerate(scr):
        c = crops[k // 4][:, :sc.shape[1], :sc.shape[2]]
        assert not torch.equal(sc, c) and torch.equal(sc.flatten().sort().values, c.flatten().sort().values)
    smp = make_samples(crops, bgs, 10, object_side=spec.exemplar_size, generator=g, negative_crops=crops[:1])
    assert len(smp.positives) == 10 and smp.negatives.shape[0] == 10
    b = smp.positives.boxes
    assert bool(((b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1]) & (b >= 0).all(1) & (b <= spec.size).all(1)).all())


def test_calibrate_policy_on_a_random_bundle_is_valid_and_seeded():
    from models.calibration import calibrate_policy
    from models.inference import Localizer

    torch.manual_seed(0)
    loc = Localizer(new_bundle("t", mnist_config(), seed=0), "cpu")
    crops = [torch.rand(1, 28, 28, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    proto = loc.prototype(crops)
    neg = loc.embed_crops([torch.rand(1, 28, 28)]).cpu()
    a = calibrate_policy(loc, proto, crops, nearest=False, n=16, seed=3, negative_embeddings=neg)
    b = calibrate_policy(loc, proto, crops, nearest=False, n=16, seed=3, negative_embeddings=neg)
    assert a.to_dict() == b.to_dict() and a.negatives is not None
    c = a.confidence(torch.tensor([1.0, 1e4]))
    assert bool(((c >= 0) & (c <= 1)).all())
