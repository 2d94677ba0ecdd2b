"""``models.core.platt`` and ``models.calibration``: Platt fit, ECE and reliability bins on known distributions;
samples; a real fit."""

import math

import pytest
import torch

from models.bundle import new_bundle
from models.calibration import (
    Calibration,
    calibrate_policy,
    features,
    fit_calibration,
)
from models.core.platt import expected_calibration_error, fit_platt, reliability_bins
from models.data.calibration_samples import make_samples, scrambled_crops, synthetic_backgrounds
from models.data.types import LabeledImages
from models.inference import Localizer
from models.presets import mnist_config


def _random_localizer() -> Localizer:
    """A localizer of an untrained cMNIST-sized bundle, made after seeding torch's global generator (what the tests
    draw without a generator of their own follows from it)."""
    torch.manual_seed(0)
    return Localizer(new_bundle("t", mnist_config(), seed=0), "cpu")


def _crops(k: int, first: int = 0) -> list[torch.Tensor]:
    """``k`` random 28 x 28 gray crops, crop ``i`` drawn from seed ``first + i``."""
    return [torch.rand(1, 28, 28, generator=torch.Generator().manual_seed(i)) for i in range(first, first + k)]


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

    loc = _random_localizer()
    crops = _crops(2)
    proto = loc.prototype(crops)
    neg = loc.embed_crops([torch.rand(1, 28, 28)]).cpu()
    a = calibrate_policy(loc, proto, crops, nearest=False, n=16, seed=3, negative_embeddings=neg)
    b = calibrate_policy(loc, proto, crops, nearest=False, n=16, seed=3, negative_embeddings=neg)
    assert a.to_dict() == b.to_dict() and a.negatives is not None
    c = a.confidence(torch.tensor([1.0, 1e4]))
    assert bool(((c >= 0) & (c <= 1)).all())


# --- NCC features (issue 13)


def test_box_ncc_is_one_for_the_crop_minus_one_inverted_and_vectorized_over_boxes():
    from models.core.templates import box_ncc, make_templates

    g = torch.Generator().manual_seed(0)
    crop = torch.rand(1, 16, 16, generator=g)
    img = torch.zeros(2, 1, 48, 48)
    img[0, :, 8:24, 10:26] = crop
    img[1, :, 20:36, 4:20] = 1 - crop  # inverted
    t = make_templates([crop, torch.rand(1, 16, 16, generator=g)])
    boxes = torch.tensor([[[10.0, 8, 26, 24], [0, 0, 48, 48]], [[4.0, 20, 20, 36], [30, 30, 46, 46]]])
    ncc = box_ncc(img, boxes, t, jitter=0.0)
    assert ncc.shape == (2, 2, 2)
    assert float(ncc[0, 0, 0]) == pytest.approx(1.0, abs=1e-2)
    assert float(ncc[1, 0, 0]) == pytest.approx(-1.0, abs=1e-2)
    assert float(ncc[1, 1, 0]) == 0.0  # a flat (empty) box correlates with nothing
    one = box_ncc(img[1:], boxes[1:, :1], t, jitter=0.0)  # each box alone: the same as in the batch
    assert torch.allclose(one[0, 0], ncc[1, 0])
    off = torch.tensor([[[11.0, 9, 27, 25]]])  # a pixel off: the jittered reads still find it
    assert float(box_ncc(img[:1], off, t)[0, 0, 0]) >= float(box_ncc(img[:1], off, t, jitter=0.0)[0, 0, 0])


def _jittered_loop(boxes: torch.Tensor, jitter: float) -> torch.Tensor:
    """The reads as first written, one box variant at a time: the reference of the vectorized ``jittered``."""
    x1, y1, x2, y2 = boxes.unbind(-1)
    w, h = x2 - x1, y2 - y1
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    out = []
    for dx in (-1, 0, 1):
        for dy in (-1, 0, 1):
            for k in (1 - jitter, 1.0, 1 + jitter):
                ncx, ncy = cx + dx * jitter * w, cy + dy * jitter * h
                out.append(torch.stack([ncx - k * w / 2, ncy - k * h / 2, ncx + k * w / 2, ncy + k * h / 2], -1))
    return torch.stack(out, dim=-2)


@pytest.mark.parametrize("jitter", [0.1, 0.25])
def test_jittered_reads_are_the_loops_bit_for_bit(jitter: float):
    from models.core.templates import jittered

    g = torch.Generator().manual_seed(3)
    xy = torch.rand(5, 3, 2, generator=g) * 60
    boxes = torch.cat([xy, xy + 1 + torch.rand(5, 3, 2, generator=g) * 30], -1)  # [5, 3, 4]
    for b in (boxes, boxes.double(), boxes[0, 0]):
        got = jittered(b, jitter)
        assert got.shape == (*b.shape[:-1], 27, 4) and got.dtype == b.dtype
        assert torch.equal(got, _jittered_loop(b, jitter))
    assert torch.equal(jittered(boxes, 0.0), boxes[..., None, :])  # no jitter: the box alone
    mid = jittered(boxes, jitter)[..., 13, :]  # no shift, scale 1: the box itself
    assert torch.allclose(mid, boxes)


def test_leave_one_out_never_compares_a_pasted_positive_with_its_own_exemplar():
    from models.calibration import template_features
    from models.core.templates import Templates, box_ncc, make_templates, mean_ncc, source_template
    from models.data.calibration_samples import Samples
    from models.data.probes import paste_probes

    g = torch.Generator().manual_seed(1)
    crops = [torch.nn.functional.interpolate(torch.rand(1, 1, 4, 4, generator=g), size=(20, 20), mode="bilinear")[0]
             for _ in range(3)]  # smooth: a pasted, resampled copy still matches its source
    t = make_templates(crops)
    pos = paste_probes(crops, torch.zeros(30, 1, 64, 64), 30, object_side=20, scale=(1.0, 1.0), generator=g)
    src = pos.sources  # paste_probes tells each probe's crop
    own = box_ncc(pos.images, pos.boxes[:, None], t, jitter=0.0)[:, 0]
    assert float(own[torch.arange(30), src].min()) > 0.4  # compared with itself it would match well
    found = source_template(pos.images, pos.boxes, t)  # a labeled example's source: the best match, if >= 0.5
    assert torch.equal(found[found >= 0], src[found >= 0])
    tm = Templates(t, None, 64, 1, (0.0,))
    p, _, _, _ = template_features(Samples(pos, torch.zeros(2, 1, 64, 64)), pos.boxes, torch.zeros(2, 4), tm)
    full = box_ncc(pos.images, pos.boxes[:, None], t)[:, 0]
    assert torch.allclose(p, mean_ncc(full, src)) and bool((p < full.max(-1).values).all())
    assert torch.allclose(mean_ncc(torch.tensor([[1.0, 0.2, 0.4]]), torch.tensor([0])), torch.tensor([0.3]).double())


def test_old_calibration_dicts_load_and_answer_the_same():
    from models.core.platt import PlattFit

    v1 = {"version": 1, "score": {"features": ["log_score"], "mean": [5.0], "std": [1.0], "weights": [-2.0],
                                  "bias": 0.3},
          "negatives": {"features": ["log_score", "log_ratio"], "mean": [5.0, 0.0], "std": [1.0, 1.0],
                        "weights": [-2.0, -1.0], "bias": 0.1}, "threshold": 0.6, "stats": {"ece": 0.1}}
    cal = Calibration.from_dict(v1)
    s, dn = torch.tensor([10.0, 100.0, 1000.0]), torch.tensor([50.0, 50.0, 50.0])
    z = (s.double().log() - 5.0) * -2.0 + 0.3
    assert torch.allclose(cal.confidence(s), torch.sigmoid(z))
    zn = (s.double().log() - 5.0) * -2.0 - (s.double().log() - dn.double().log()) + 0.1
    assert torch.allclose(cal.confidence(s, dn), torch.sigmoid(zn))
    assert cal.ncc is None and cal.templates is None and cal.to_dict() == v1  # stored back unchanged
    assert torch.allclose(cal.box_confidence(torch.zeros(3, 1, 8, 8), torch.zeros(3, 1, 4), s[:, None])[:, 0],
                          torch.sigmoid(z))
    _ = PlattFit


def test_templates_round_trip_through_json():
    import json

    from models.core.platt import PlattFit
    from models.core.templates import Templates, make_templates

    g = torch.Generator().manual_seed(2)
    t = Templates(make_templates([torch.rand(3, 20, 30, generator=g) for _ in range(2)]),
                  make_templates([torch.rand(3, 10, 10, generator=g)]), 84, 3, (0.5, 0.5, 0.5))
    cal = Calibration(PlattFit(["log_score"], [0.0], [1.0], [-1.0], 0.0), templates=t,
                      ncc=PlattFit(["ncc"], [0.0], [1.0], [3.0], 0.0))
    back = Calibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert back.to_dict()["version"] == 2 and back.templates is not None and back.templates.negatives is not None
    assert torch.equal(back.templates.exemplars, t.exemplars) and torch.equal(back.templates.negatives, t.negatives)
    x = torch.tensor([0.1, 0.9])
    assert torch.allclose(back.confidence(torch.ones(2), ncc=x), torch.sigmoid(3.0 * x.double()))


def test_with_ncc_a_set_of_fours_is_not_found_on_most_other_digits():
    """The learning check: the shipped digit-4 bundle, 5 crops of 4s. The distance fit says found on nearly
    every 7 and 9; the NCC fit on few 7s, and -- with 5 crops of 9s as negative exemplars -- on few 9s, while
    it still finds most 4s (validation images)."""
    from pathlib import Path

    from models.bundle import load_bundle
    from models.calibration import answers, calibrate_policy
    from models.data.types import exemplar_crops
    from models.experiments.cmnist import cmnist

    path = Path(__file__).resolve().parents[2] / "bundles" / "mnist-digit4.pt"
    if not path.exists():
        pytest.skip("bundle not shipped")
    loc = Localizer(load_bundle(path), "cpu")
    crops = exemplar_crops(cmnist(4, "train", 5, "patch", 1000))
    proto = loc.prototype(crops)
    nines = exemplar_crops(cmnist(9, "train", 5, "patch", 2000))
    agent = loc.agent()
    found = {}
    for negs in (None, nines):
        cal = calibrate_policy(loc, proto, crops, nearest=loc.default_nearest, n=64, seed=0, negative_crops=negs)
        assert cal.templates is not None and cal.ncc is not None
        for d in (4, 7, 9):
            imgs = cmnist(d, "val", 40, "patch", 3).images
            b, s = answers(loc, agent, proto, imgs, nearest=loc.default_nearest)
            found[negs is not None, d, "ncc"] = float((cal.box_confidence(imgs, b[:, None], s[:, None])[:, 0]
                                                       >= 0.5).float().mean())
            found[negs is not None, d, "distance"] = float((cal.confidence(s) >= 0.5).float().mean())
    assert found[False, 7, "distance"] > 0.8 and found[False, 9, "distance"] > 0.8, found
    assert found[False, 7, "ncc"] < 0.3 and found[True, 9, "ncc"] < 0.5, found
    assert found[False, 4, "ncc"] > 0.8 and found[True, 4, "ncc"] > 0.8, found


# --- what a calibration stores, and what a refresh reads back (mutation testing, 2026-12-02)


def _full_calibration():
    """A calibration with every part: the score's fit, the negatives', the NCC fits, templates with negatives and
    a kind check."""
    from models.core.platt import PlattFit
    from models.core.templates import Templates, make_templates
    from models.verifier import KindCheck

    g = torch.Generator().manual_seed(5)
    t = Templates(make_templates([torch.rand(1, 28, 28, generator=g) for _ in range(3)]),
                  make_templates([torch.rand(1, 28, 28, generator=g) for _ in range(2)]), 84, 1, (0.0,))
    kind = KindCheck([1.0, 0.0], [[0.0, 1.0], [0.6, 0.8]], "4", 0.97, "sha-of-the-verifier")
    return Calibration(PlattFit(["log_score"], [5.0], [1.0], [-2.0], 0.3),
                       PlattFit(["log_score", "log_ratio"], [5.0, 0.0], [1.0, 1.0], [-2.0, -1.0], 0.1), 0.35,
                       {"ece": 0.05}, PlattFit(["ncc"], [0.5], [0.2], [4.0], -0.2),
                       PlattFit(["ncc", "ncc_negatives"], [0.5, 0.4], [0.2, 0.2], [4.0, -3.0], 0.1), t, kind)


def test_every_part_of_a_calibration_round_trips_through_json_and_answers_the_same():
    import json

    cal = _full_calibration()
    d = cal.to_dict()
    assert d["version"] == 3 and d["threshold"] == 0.35 and d["kind"]["kind"] == "4"
    assert d["ncc_negatives"]["features"] == ["ncc", "ncc_negatives"] and d["templates"] is not None
    back = Calibration.from_dict(json.loads(json.dumps(d)))
    assert back.to_dict() == d and back.kind == cal.kind and back.threshold == 0.35
    x, xn = torch.tensor([0.2, 0.9]), torch.tensor([0.8, 0.1])
    z = 4.0 * (x.double() - 0.5) / 0.2 - 3.0 * (xn.double() - 0.4) / 0.2 + 0.1
    assert torch.allclose(back.confidence(torch.ones(2), ncc=x, ncc_negatives=xn), torch.sigmoid(z))
    # the NCC alone where the negatives' NCC is not given, though a fit for it is stored
    assert torch.allclose(back.confidence(torch.ones(2), ncc=x), torch.sigmoid(4.0 * (x.double() - 0.5) / 0.2 - 0.2))
    assert torch.equal(back.templates.negatives, cal.templates.negatives)
    # an NCC fit without templates (version 2 all the same), and a dict without a threshold: the default 0.5
    only_ncc = Calibration(cal.score, ncc=cal.ncc).to_dict()
    assert only_ncc["version"] == 2 and only_ncc["templates"] is None and only_ncc["ncc_negatives"] is None
    del d["threshold"]
    assert Calibration.from_dict(d).threshold == 0.5


def test_a_refresh_reads_the_kind_check_and_the_negative_templates_of_a_stored_calibration():
    from models.calibration import stored_kind, stored_negative_templates

    cal = _full_calibration()
    d = cal.to_dict()
    assert stored_kind(d) == cal.kind and torch.equal(stored_negative_templates(d), cal.templates.negatives)
    for nothing in (None, {}, Calibration(cal.score).to_dict()):
        assert stored_kind(nothing) is None and stored_negative_templates(nothing) is None


def test_the_kind_check_applies_only_with_the_verifier_it_was_made_with():
    from dataclasses import replace as copy_with
    from types import SimpleNamespace

    cal = _full_calibration()
    assert cal.kind_applies(SimpleNamespace(sha256="sha-of-the-verifier"))
    assert not cal.kind_applies(SimpleNamespace(sha256="another file")) and not cal.kind_applies(None)
    assert not copy_with(cal, templates=None).kind_applies(SimpleNamespace(sha256="sha-of-the-verifier"))


def test_a_stored_ncc_fit_that_uses_the_score_reads_it_and_a_missing_feature_is_named():
    from models.calibration import ncc_features
    from models.core.platt import PlattFit

    s, x = torch.tensor([10.0, 100.0]), torch.tensor([0.3, 0.6])
    cal = Calibration(PlattFit(["log_score"], [0.0], [1.0], [-1.0], 0.0),
                      ncc=PlattFit(["log_score", "ncc"], [0.0, 0.0], [1.0, 1.0], [-1.0, 2.0], 0.0))
    want = torch.sigmoid(-s.double().log() + 2.0 * x.double())
    assert torch.allclose(cal.confidence(s, ncc=x), want)
    assert torch.allclose(ncc_features(["log_score"], s, x)[:, 0], s.double().log())
    with pytest.raises(ValueError, match=r"\['ncc_negatives'\] are needed"):
        ncc_features(["ncc", "ncc_negatives"], s, x)


def test_the_fit_reports_its_samples_and_the_measures_of_its_richest_fit():
    from models.core.platt import expected_calibration_error

    g = torch.Generator().manual_seed(3)
    pos, neg = torch.rand(30, generator=g) * 50 + 10, torch.rand(20, generator=g) * 200 + 40
    hit = torch.arange(30) % 3 == 0  # a third of the answers on positives right
    cal = fit_calibration(pos, hit, neg)
    y = torch.cat([hit, torch.zeros(20, dtype=torch.bool)])
    p = cal.confidence(torch.cat([pos, neg]))
    assert cal.stats["positives"] == 30 and cal.stats["negatives"] == 20
    assert cal.stats["positive_hit_rate"] == 0.3333
    assert cal.stats["ece"] == round(expected_calibration_error(p, y), 4)
    assert cal.stats["brier"] == round(float(((p - y.double()) ** 2).mean()), 4)
    # with NCC features (more negatives: other shapes), the measures are the NCC fit's
    pn = hit.double() * 0.5 + torch.rand(30, generator=g).double() * 0.3
    nn_ = torch.rand(25, generator=g).double() * 0.4
    pnn, nnn = torch.rand(30, generator=g).double() * 0.3, torch.rand(25, generator=g).double() * 0.3 + 0.4
    cal = fit_calibration(pos, hit, neg, pos_ncc=pn, neg_ncc=nn_, pos_ncc_neg=pnn, neg_ncc_neg=nnn)
    y = torch.cat([hit, torch.zeros(25, dtype=torch.bool)])
    p = cal.confidence(torch.ones(55), ncc=torch.cat([pn, nn_]), ncc_negatives=torch.cat([pnn, nnn]))
    assert cal.ncc_negatives is not None and cal.ncc_negatives.features == ["ncc", "ncc_negatives"]
    assert cal.stats["ece"] == round(expected_calibration_error(p, y), 4)
    assert cal.stats["brier"] == round(float(((p - y.double()) ** 2).mean()), 4)
    assert cal.score.features == ["log_score"]


def test_calibrate_policy_fits_on_everything_it_is_given():
    """The counts in ``stats``: ``n`` pasted positives plus the labeled examples and the given positives; ``n``
    negatives, drawn from the synthesized backgrounds and the given ones; the threshold passed through; the NCC
    fits for a grayscale bundle; a verifier's kind check recorded."""
    from types import SimpleNamespace

    from models.verifier import KindCheck

    loc = _random_localizer()
    crops = _crops(3)
    proto = loc.prototype(crops)
    s = loc.spec.size
    imgs = torch.rand(4, 1, s, s, generator=torch.Generator().manual_seed(9))
    boxes = torch.tensor([[10.0, 10.0, 40.0, 40.0]]).repeat(4, 1)
    check = KindCheck([1.0], [[0.0]], "4", 0.95, "sha")
    verifier = SimpleNamespace(check=lambda c, negatives: check if len(c) == 3 and negatives is None else None)
    cal = calibrate_policy(loc, proto, crops, nearest=False, n=8, seed=1, labeled=LabeledImages(imgs[:2], boxes[:2]),
                           positives=LabeledImages(imgs, boxes), backgrounds01=imgs[:3], threshold=0.3,
                           verifier=verifier)
    assert cal.stats["positives"] == 8 + 2 + 4 and cal.stats["negatives"] == 8
    assert cal.threshold == 0.3 and cal.templates is not None and cal.ncc is not None
    assert cal.kind == check and cal.stats["kind"] == "4" and cal.stats["known"] == 0.95
    assert cal.templates.size == s and cal.templates.channels == 1
    plain = calibrate_policy(loc, proto, crops, nearest=False, n=8, seed=1, ncc=False, verifier=verifier)
    assert plain.templates is None and plain.kind is None and plain.stats["positives"] == 8
    other_backgrounds = calibrate_policy(loc, proto, crops, nearest=False, n=8, seed=1, ncc=False,
                                         backgrounds01=torch.ones(3, 1, s, s))
    assert other_backgrounds.to_dict() != plain.to_dict()


def test_the_ncc_fits_need_two_exemplars_and_two_negatives_for_leave_one_out():
    """Leave-one-out compares a sample with the *other* templates: one exemplar gives no NCC fit, one negative
    exemplar no NCC fit with negatives; two of each give both. The AUROCs of both features on the set's own samples
    are recorded beside them."""

    loc = _random_localizer()
    crops = _crops(4)
    proto = loc.prototype(crops[:2])

    def cal(exemplars, negatives):
        return calibrate_policy(loc, proto, exemplars, nearest=False, n=8, seed=0, negative_crops=negatives)

    one = cal(crops[:1], None)
    assert one.ncc is None and one.templates is None and "auroc_ncc" not in one.stats
    two = cal(crops[:2], crops[2:3])
    assert two.ncc is not None and two.ncc_negatives is None and two.templates.negatives is None
    assert all(0 <= two.stats[k] <= 1 and round(two.stats[k], 4) == two.stats[k] for k in ("auroc_score", "auroc_ncc"))
    both = cal(crops[:2], crops[2:4])
    assert both.ncc_negatives is not None and len(both.templates.negatives) == 2


def test_a_jobs_probes_join_the_positives_with_their_sources_to_be_found(monkeypatch):
    """The pasted positives keep the exemplar each was pasted from (leave-one-out compares it with the others); a
    job's probes, made from another list of crops, are marked ``-1``: their source is found by matching."""
    import models.calibration as mc

    seen = {}
    real = mc.calibrate

    def spy(localizer, agent, prototype, samples, **kw):
        seen["samples"] = samples
        return real(localizer, agent, prototype, samples, **kw)

    monkeypatch.setattr(mc, "calibrate", spy)
    loc = _random_localizer()
    crops = _crops(3)
    s = loc.spec.size
    probes = LabeledImages(torch.rand(5, 1, s, s), torch.tensor([[10.0, 10.0, 40.0, 40.0]]).repeat(5, 1))
    mc.calibrate_policy(loc, loc.prototype(crops), crops, nearest=False, n=8, seed=0, positives=probes)
    pos = seen["samples"].positives
    assert len(pos) == 13 and torch.equal(pos.images[8:], probes.images) and torch.equal(pos.boxes[8:], probes.boxes)
    assert pos.sources.dtype == torch.long and (pos.sources[8:] == -1).all()
    assert ((pos.sources[:8] >= 0) & (pos.sources[:8] < 3)).all()


def test_calibrate_policy_runs_the_policy_it_is_given_as_it_is_served():
    """The agent of ``agent_state`` (not the bundle's), with ``nearest`` as given; a refresh's stored negative
    templates stand in for negative crops it no longer has; the templates keep the crops' sizes."""
    from models.core.templates import make_templates

    loc = _random_localizer()
    crops = _crops(3)
    proto = loc.prototype(crops)
    torch.manual_seed(7)
    other = {k: v + 0.5 * torch.randn_like(v) for k, v in loc.bundle.agent_state.items()}

    def cal(**kw):
        return calibrate_policy(loc, proto, crops, n=8, seed=0, **{"nearest": False, **kw}).to_dict()

    base = cal()
    assert cal(agent_state=other) != base and cal(nearest=True) != base
    neg_t = make_templates(_crops(2, first=20))
    stored = calibrate_policy(loc, proto, crops, nearest=False, n=8, seed=0, negative_templates=neg_t)
    assert torch.equal(stored.templates.negatives, neg_t) and stored.ncc_negatives is not None
    assert stored.templates.crop_sizes is not None and len(stored.templates.crop_sizes) == 3


def test_with_negatives_the_stats_are_those_of_the_negatives_fit():
    from models.core.platt import expected_calibration_error

    g = torch.Generator().manual_seed(4)
    d = torch.rand(60, generator=g) * 20 + 40
    pos_neg, neg_neg = torch.rand(30, generator=g) * 50 + 100, torch.rand(30, generator=g) * 5 + 5
    hit = torch.ones(30, dtype=torch.bool)
    cal = fit_calibration(d[:30], hit, d[30:], pos_neg=pos_neg, neg_neg=neg_neg)
    assert cal.negatives is not None and cal.negatives.features == ["log_score", "log_ratio"]
    y = torch.cat([hit, torch.zeros(30, dtype=torch.bool)])
    p = cal.confidence(d, torch.cat([pos_neg, neg_neg]))
    assert cal.stats["ece"] == round(expected_calibration_error(p, y), 4) and cal.stats["ece"] != round(
        expected_calibration_error(cal.confidence(d), y), 4)


def test_score_boxes_gives_each_boxs_distances_and_the_confidence_of_the_richest_fit():
    """``score_boxes`` by value against its parts: the distance to the prototype, the nearest negative's (inf
    without negatives), and ``Calibration.box_confidence`` given the negatives' distances only when the calibration
    has their fit; float32 out."""
    from models.calibration import box_distances, score_boxes
    from models.core.platt import PlattFit

    loc = _random_localizer()
    g = torch.Generator().manual_seed(8)
    images = torch.rand(3, 1, 84, 84, generator=g)
    boxes = torch.tensor([[[4.0, 4.0, 40.0, 40.0], [30.0, 20.0, 80.0, 70.0]]]).repeat(3, 1, 1)
    boxes[1] += 2.0
    proto = loc.prototype(_crops(3))
    negatives = torch.stack([loc.prototype(_crops(1, first=10 + i)) for i in range(3)])  # [3, D]
    d = box_distances(loc, images, boxes, torch.cat([proto[None], negatives]))  # [3, 2, 4]
    near_neg = d[..., 1:].min(-1).values
    assert not torch.equal(near_neg, d[..., 1]) and not torch.equal(near_neg, d[..., 3])  # the min of three
    score = PlattFit(["log_score"], [-1.6], [0.05], [-2.0], 0.3)  # these distances: 0.18-0.23, none saturated
    with_neg = Calibration(score, PlattFit(["log_score", "log_ratio"], [-1.6, 0.1], [0.05, 0.05], [-2.0, 3.0], 0.1))
    full = _full_calibration()  # templates: the NCC fits
    for cal in (Calibration(score), with_neg, full):
        d_p, d_n, conf = score_boxes(loc, images, boxes, proto, negatives, cal)
        assert torch.allclose(d_p, d[..., 0]) and torch.allclose(d_n, near_neg)
        given = near_neg if cal.negatives is not None else None
        assert conf.dtype == torch.float32
        assert torch.allclose(conf, cal.box_confidence(images, boxes, d[..., 0], given).float())
        for none in (None, negatives[:0]):
            d_p, d_n, conf = score_boxes(loc, images, boxes, proto, none, cal)
            assert torch.allclose(d_p, d[..., 0]) and bool(torch.isinf(d_n).all()) and d_n.shape == (3, 2)
            assert torch.allclose(conf, cal.box_confidence(images, boxes, d[..., 0], None).float())
    one = score_boxes(loc, images, boxes, proto, negatives[:1], with_neg)  # a single negative is one
    assert torch.allclose(one[1], d[..., 1]) and torch.allclose(
        one[2], with_neg.box_confidence(images, boxes, d[..., 0], d[..., 1]).float())
    assert not torch.allclose(with_neg.box_confidence(images, boxes, d[..., 0], near_neg),
                              with_neg.box_confidence(images, boxes, d[..., 0], None))  # the negatives count


def test_calibrate_fits_the_served_answers_by_value():
    """``calibrate`` against its parts: the policy's answers as localize serves them (``nearest`` as given, for the
    positives and the negatives alike), a hit at IoU >= 0.5 with the pasted box, the nearest of several negative
    exemplars' distances, then ``fit_calibration``; ``answers`` is the localizer's last box and its distance, chunk
    by chunk."""
    from models.calibration import answers, box_distances, calibrate
    from models.core.boxes import paired_iou

    loc = _random_localizer()
    crops = _crops(3)
    proto = loc.prototype(crops)
    gen = torch.Generator().manual_seed(2)
    samples = make_samples(crops, synthetic_backgrounds(crops, loc.spec, 12, gen), 12,
                           object_side=loc.spec.exemplar_size, generator=gen)
    agent = loc.agent(None)
    negs = torch.stack([loc.prototype(_crops(1, first=10 + i)) for i in range(3)])  # [3, D]
    made = {}
    for nearest in (True, False):
        ro = loc.run(samples.negatives, proto, agent, nearest=nearest)
        nb, ns = answers(loc, agent, proto, samples.negatives, nearest=nearest, chunk=5)
        # chunk by chunk: the same boxes, the distances to float rounding (a batch of 5 may be summed in another order
        # than one of 12: on some CPUs the last bits differ)
        assert torch.equal(nb, ro.boxes[-1].cpu()) and torch.allclose(ns, ro.distances[-1].cpu(), rtol=0, atol=1e-6)
        nb, ns = answers(loc, agent, proto, samples.negatives, nearest=nearest)  # one chunk, as calibrate reads them
        assert torch.equal(nb, ro.boxes[-1].cpu()) and torch.equal(ns, ro.distances[-1].cpu())
        pb, ps = answers(loc, agent, proto, samples.positives.images, nearest=nearest)
        hit = paired_iou(pb, samples.positives.boxes) >= 0.5
        pos_neg = box_distances(loc, samples.positives.images, pb[:, None], negs)[:, 0].min(-1).values
        neg_neg = box_distances(loc, samples.negatives, nb[:, None], negs)[:, 0].min(-1).values
        want = fit_calibration(ps, hit, ns, pos_neg=pos_neg, neg_neg=neg_neg, threshold=0.4)
        made[nearest] = calibrate(loc, agent, proto, samples, nearest=nearest, negative_embeddings=negs,
                                  threshold=0.4).to_dict()
        assert made[nearest] == want.to_dict()
        assert made[nearest]["negatives"] is not None  # the negatives' fit made
    assert made[True] != made[False]
    alone = calibrate(loc, agent, proto, samples, nearest=False).to_dict()
    assert alone["negatives"] is None and alone["score"] == made[False]["score"]
    # an episode of one step: its last box is not its first (an untrained agent's longer episodes end standing still)
    cfg = mnist_config()
    cfg.env.steps = 1
    short = Localizer(new_bundle("t1", cfg, seed=0), "cpu")
    ro = short.run(samples.negatives, proto, short.agent(None))
    nb, ns = answers(short, short.agent(None), proto, samples.negatives, nearest=False, chunk=5)
    assert torch.equal(nb, ro.boxes[-1].cpu()) and not torch.equal(nb, ro.boxes[0].cpu())
    assert torch.allclose(ns, ro.distances[-1].cpu(), rtol=0, atol=1e-6)
    assert not torch.allclose(ns, ro.distances[0].cpu(), rtol=0, atol=1e-6)


def test_rgb_bundles_get_no_ncc_fit_unless_asked_and_the_kind_check_sees_the_negatives():
    """``ncc=None``: the NCC fits for grayscale bundles only (``NCC_FOR_GRAY``: pixels mislead on photos); an RGB
    bundle gets them when asked. The verifier's kind check is given the set's crops and its negative crops."""
    from types import SimpleNamespace

    from models.presets import photo_config
    from models.verifier import KindCheck

    torch.manual_seed(0)
    rgb = Localizer(new_bundle("rgb", photo_config(), seed=0), "cpu")
    size = rgb.spec.exemplar_size
    crops = [torch.rand(3, size, size, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    proto = rgb.prototype(crops)
    plain = calibrate_policy(rgb, proto, crops, nearest=True, n=4, seed=0)
    assert plain.ncc is None and plain.templates is None
    asked = calibrate_policy(rgb, proto, crops, nearest=True, n=4, seed=0, ncc=True)
    assert asked.ncc is not None and asked.templates is not None and asked.templates.channels == 3

    loc = _random_localizer()
    gray = _crops(3)
    negatives = _crops(2, first=30)
    seen = []
    check = KindCheck([1.0], [[0.0]], "4", 0.95, "sha")
    verifier = SimpleNamespace(check=lambda c, n: seen.append((c, n)) or check)
    cal = calibrate_policy(loc, loc.prototype(gray), gray, nearest=False, n=8, seed=0, negative_crops=negatives,
                           verifier=verifier)
    assert cal.kind == check and len(seen) == 1 and seen[0][0] is gray and seen[0][1] is negatives


def test_box_confidence_is_the_kind_checks_with_its_verifier_else_the_ncc_fits_else_the_scores():
    """``box_confidence`` by value: with the verifier the set's kind check was made with, that check's probability
    of the verifier's embeddings of the very boxes of the very images; with another verifier (or none), the NCC fits
    on the templates' reads; a calibration without an NCC fit (or without templates), the score's or the negatives'
    fit."""
    from dataclasses import replace as copy_with
    from types import SimpleNamespace

    cal = _full_calibration()
    g = torch.Generator().manual_seed(6)
    images = torch.rand(2, 1, 84, 84, generator=g)
    boxes = torch.tensor([[[4.0, 4.0, 40.0, 40.0], [30.0, 20.0, 80.0, 70.0], [0.0, 0.0, 84.0, 84.0]]]).repeat(2, 1, 1)
    boxes[1] += torch.tensor([2.0, 1.0, 2.0, 1.0])
    scores = torch.tensor([[40.0, 60.0, 80.0], [45.0, 65.0, 85.0]])

    def embed_boxes(imgs, bxs):  # a unit vector per box that depends on the image and the box
        angle = imgs.mean(dim=(1, 2, 3))[:, None] * 3 + bxs[..., 0] / 50 + bxs[..., 3] / 90
        return torch.stack([angle.cos(), angle.sin()], -1)

    made_with = SimpleNamespace(sha256="sha-of-the-verifier", embed_boxes=embed_boxes)
    got = cal.box_confidence(images, boxes, scores, verifier=made_with)
    want = cal.kind.probability(embed_boxes(images, boxes))
    assert got.shape == (2, 3) and torch.equal(got, want)
    assert cal.kind_confidence(made_with, images, boxes).equal(want)
    assert cal.kind_confidence(SimpleNamespace(sha256="another"), images, boxes) is None
    pos, neg = cal.templates.ncc(images, boxes)
    ncc = cal.confidence(scores.flatten(), ncc=pos.flatten(), ncc_negatives=neg.flatten()).view(2, 3)
    for other in (None, SimpleNamespace(sha256="another", embed_boxes=embed_boxes)):
        assert torch.equal(cal.box_confidence(images, boxes, scores, verifier=other), ncc)
    assert not torch.allclose(ncc, want)
    nd = torch.full((2, 3), 70.0)
    for plain in (copy_with(cal, ncc=None), copy_with(cal, templates=None)):
        assert torch.equal(plain.box_confidence(images, boxes, scores, nd),
                           plain.confidence(scores.flatten(), nd.flatten()).view(2, 3))
        assert torch.equal(plain.box_confidence(images, boxes, scores), plain.confidence(scores.flatten()).view(2, 3))
