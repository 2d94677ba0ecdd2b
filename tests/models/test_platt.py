"""``models.core.platt`` to the number: the fit's targets, ridge and convergence, its checks, the reliability bins,
ECE and AUROC on hand-computed cases (written against the module's surviving mutants, TESTING.md)."""

import math

import pytest
import torch

from models.core.platt import PlattFit, auroc, expected_calibration_error, fit_platt, reliability_bins


def _targets(y: torch.Tensor) -> torch.Tensor:
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    return torch.where(y, (n_pos + 1.0) / (n_pos + 2.0), 1.0 / (n_neg + 2.0)).double()


def _gradient(fit: PlattFit, x: torch.Tensor, y: torch.Tensor, l2: float) -> torch.Tensor:
    """The penalized log loss's gradient at ``fit`` (zero at the optimum), bias first, the bias not penalized."""
    mean, std = torch.tensor(fit.mean, dtype=torch.float64), torch.tensor(fit.std, dtype=torch.float64)
    z = torch.cat([torch.ones(len(x), 1, dtype=torch.float64), (x.double() - mean) / std], dim=1)
    w = torch.tensor([fit.bias, *fit.weights], dtype=torch.float64)
    ridge = torch.tensor([0.0] + [l2 * len(x)] * len(fit.weights), dtype=torch.float64)
    return z.T @ (torch.sigmoid(z @ w) - _targets(y)) + ridge * w


def test_a_constant_feature_gives_the_mean_of_platts_smoothed_targets():
    x = torch.full((4, 1), 2.0)
    y = torch.tensor([True, True, True, False])
    fit = fit_platt(x, y, ["x"])
    # 3 positives -> 4 / 5, 1 negative -> 1 / 3: the probability is their mean, whatever x
    assert fit.probability(x)[0].item() == pytest.approx((3 * 0.8 + 1 / 3) / 4, abs=1e-7)
    assert fit.weights == pytest.approx([0.0], abs=1e-12) and fit.features == ["x"]


def test_the_fit_is_the_penalized_optimum_with_an_unshrunk_bias_and_population_statistics():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(60, 2, generator=g, dtype=torch.float64) * torch.tensor([3.0, 0.5]) + torch.tensor([5.0, -1.0])
    y = torch.rand(60, generator=g, dtype=torch.float64) < torch.sigmoid(x[:, 0] - 5.0 - 2.0 * (x[:, 1] + 1.0))
    fit = fit_platt(x, y, ["a", "b"], l2=0.05)
    assert fit.mean == pytest.approx(x.mean(0).tolist(), abs=1e-12)
    assert fit.std == pytest.approx(x.std(0, unbiased=False).tolist(), abs=1e-12)
    assert _gradient(fit, x, y, 0.05).abs().max() < 1e-8
    assert abs(fit.bias) > 0.1  # a bias shrunk to 0 would not be the optimum above


def test_newtons_method_converges_in_a_few_steps():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(200, 1, generator=g, dtype=torch.float64)
    y = torch.rand(200, generator=g, dtype=torch.float64) < torch.sigmoid(0.3 - 1.5 * x[:, 0])
    fit = fit_platt(x, y, ["x"], l2=1e-3, iterations=6)  # quadratic convergence: a wrong Hessian would not be there
    assert _gradient(fit, x, y, 1e-3).abs().max() < 1e-9


def test_the_fit_checks_its_inputs():
    with pytest.raises(ValueError, match=r"expected x \[n, k\] and y \[n\]; got \[4\] and \[4\]"):
        fit_platt(torch.zeros(4), torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"got \[4, 1\] and \[4, 1\]"):
        fit_platt(torch.zeros(4, 1), torch.zeros(4, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"got \[4, 1\] and \[3\]"):
        fit_platt(torch.zeros(4, 1), torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="a calibration needs at least 2 samples"):
        fit_platt(torch.zeros(1, 1), torch.ones(1, dtype=torch.bool))
    two = fit_platt(torch.tensor([[0.0], [1.0]]), torch.tensor([False, True]))  # 2 samples are enough
    assert two.features == ["x0"] and two.weights[0] > 0


def test_a_fit_applies_in_float64_and_checks_its_features():
    fit = PlattFit(["x"], [100000001.0], [1.0000000001], [1e-9], 0.0)  # float32 would round mean and std
    x = torch.tensor([[100000001.0 + 1e9]], dtype=torch.float64)
    expected = 1 / (1 + math.exp(-(1e9 / 1.0000000001) * 1e-9))
    assert fit.probability(x).dtype == torch.float64
    assert fit.probability(x).item() == pytest.approx(expected, rel=1e-13)
    assert fit.probability(torch.tensor([[100000001.0]], dtype=torch.float64)).item() == 0.5
    with pytest.raises(ValueError, match=r"expected features \[n, 1\], got \[3\]"):
        fit.probability(torch.zeros(3))
    with pytest.raises(ValueError, match=r"expected features \[n, 1\], got \[3, 2\]"):
        fit.probability(torch.zeros(3, 2))


def test_reliability_bins_and_ece_by_hand():
    p = torch.tensor([0.0, 0.05, 0.15, 0.95, 1.0])
    y = torch.tensor([0, 1, 1, 0, 1])
    bins = reliability_bins(p, y)  # 10 equal bins by default; 1.0 falls in the last one
    assert [(b["lo"], b["hi"], b["n"]) for b in bins] == [(0.0, 0.1, 2), (0.1, 0.2, 1), (0.9, 1.0, 2)]
    assert [b["confidence"] for b in bins] == pytest.approx([0.025, 0.15, 0.975])
    assert [b["accuracy"] for b in bins] == [0.5, 1.0, 0.5]
    assert set(bins[0]) == {"lo", "hi", "n", "confidence", "accuracy"}
    assert [(b["lo"], b["hi"]) for b in reliability_bins(p, y, bins=4)] == [(0.0, 0.25), (0.75, 1.0)]
    ece = (2 * abs(0.025 - 0.5) + 1 * abs(0.15 - 1.0) + 2 * abs(0.975 - 0.5)) / 5
    assert expected_calibration_error(p, y) == pytest.approx(ece)
    assert expected_calibration_error(torch.tensor([0.3]), torch.tensor([1])) == pytest.approx(0.7)
    near = torch.tensor([0.17, 0.19]), torch.tensor([1, 0])  # one bin of ten, two of eleven
    assert expected_calibration_error(*near) == pytest.approx(abs(0.18 - 0.5))
    assert expected_calibration_error(*near, bins=11) == pytest.approx((0.83 + 0.19) / 2)
    assert math.isnan(expected_calibration_error(torch.tensor([]), torch.tensor([])))


def test_auroc_by_hand():
    score = torch.tensor([0.9, 0.8, 0.3, 0.3, 0.1])
    y = torch.tensor([1, 0, 1, 0, 0])
    # positives 0.9, 0.3 against negatives 0.8, 0.3, 0.1: 1 + 1 + 1 + 0 + 0.5 (the tie) + 1 of 6 pairs
    assert auroc(score, y) == pytest.approx(4.5 / 6)
    assert auroc(-score, y) == pytest.approx(1.5 / 6)
    assert auroc(score, torch.ones(5)) == 0.5 and auroc(score, torch.zeros(5)) == 0.5  # one class: chance
