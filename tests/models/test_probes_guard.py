"""Probe synthesis against exact boxes, and the guard's decisions on scored checkpoints."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import pytest
import torch

from models.bundle import new_bundle
from models.data.probes import _elliptical, _feathered, erase_boxes, fill_boxes, paste_probes
from models.data.types import LabeledImages
from models.evaluate import ranking_metrics, training_candidates
from models.features import features_of
from models.guard import Guard, GuardConfig
from models.presets import mnist_config


def test_pasted_probes_hold_the_crop_exactly_inside_their_box():
    gen = torch.Generator().manual_seed(0)
    images = torch.zeros(3, 1, 40, 40)
    crop = torch.ones(1, 10, 5)  # tall and thin: the aspect is kept
    probes = paste_probes([crop], images, 20, object_side=10, generator=gen, scale=(1.0, 1.6), feather=0)
    for img, box in zip(probes.images, probes.boxes, strict=True):
        x1, y1, x2, y2 = (int(v) for v in box)
        assert 0 <= x1 < x2 <= 40 and 0 <= y1 < y2 <= 40
        h, w = y2 - y1, x2 - x1
        assert 10 <= h <= 16 and abs(w - h / 2) <= 1  # long side 10 x [1, 1.6], aspect 2:1
        inside = torch.zeros(40, 40, dtype=torch.bool)
        inside[y1:y2, x1:x2] = True
        assert torch.all(img[0][inside] == 1) and torch.all(img[0][~inside] == 0)  # ink exactly in the box
    assert len({tuple(b.tolist()) for b in probes.boxes}) > 10  # places and scales vary


def test_soft_edges_ramp_up_over_the_feather_and_keep_the_box():
    alpha = _feathered(10, 10, 2)[0]
    assert alpha[5, 5] == 1 and 0 < alpha[0, 5] < alpha[1, 5] <= 1 and alpha[0, 0] <= alpha[0, 5]
    images = torch.zeros(1, 1, 30, 30)
    probes = paste_probes([torch.ones(1, 10, 10)], images, 4, object_side=10, scale=(1.0, 1.0), feather=2,
                          generator=torch.Generator().manual_seed(1))
    for img, box in zip(probes.images, probes.boxes, strict=True):
        x1, y1, x2, y2 = (int(v) for v in box)
        assert img[0, y1:y2, x1:x2].min() > 0 and img[0, (y1 + y2) // 2, (x1 + x2) // 2] == 1
        assert img.sum() < 100  # the border is blended, not pasted at full strength


def test_erase_boxes_fills_each_box_from_another_image():
    images = torch.stack([torch.full((1, 20, 20), float(i)) for i in range(4)])
    boxes = torch.tensor([[2.0, 3.0, 8.0, 9.0]]).expand(4, 4)
    out = erase_boxes(images, boxes, torch.Generator().manual_seed(0))
    for i in range(4):
        region = out[i, 0, 3:9, 2:8]
        assert region.unique().numel() == 1 and float(region[0, 0]) != i  # another image's pixels
        rest = out[i, 0].clone()
        rest[3:9, 2:8] = i
        assert torch.all(rest == i)  # outside the box: untouched
    assert torch.equal(images[:, 0, 0, 0], torch.arange(4.0))  # the input is not changed


def test_elliptical_probes_paste_the_inscribed_ellipse_and_keep_the_box():
    alpha = _elliptical(20, 30, 2)[0]
    assert alpha[10, 15] == 1 and alpha[0, 0] == 0 and alpha[19, 29] == 0  # centre pasted, corners not
    assert alpha[10, 0] < 0.5 and alpha[0, 15] < 0.5 and 0 < alpha[10, 2] < 1  # the ramp inside the edge
    images = torch.zeros(6, 1, 40, 40)
    probes = paste_probes([torch.ones(1, 16, 16)], images, 6, object_side=16, scale=(1.0, 1.0), shape="ellipse",
                          generator=torch.Generator().manual_seed(3))
    rect = paste_probes([torch.ones(1, 16, 16)], images, 6, object_side=16, scale=(1.0, 1.0),
                        generator=torch.Generator().manual_seed(3))
    assert torch.equal(probes.boxes, rect.boxes)  # the same places: the box is the crop's rectangle either way
    for img, box in zip(probes.images, probes.boxes, strict=True):
        x1, y1, x2, y2 = (int(v) for v in box)
        assert x2 - x1 == 16 and y2 - y1 == 16
        assert img[0, y1, x1] == 0 and img[0, y2 - 1, x2 - 1] == 0  # no straight seam at the box's corners
        assert img[0, (y1 + y2) // 2, (x1 + x2) // 2] == 1
        assert img.sum() < 0.85 * 16 * 16  # the ellipse (pi / 4 of the box) and its ramp
        outside = img[0].clone()
        outside[y1:y2, x1:x2] = 0
        assert outside.abs().sum() == 0  # nothing pasted outside the box
    with pytest.raises(ValueError, match="shape"):
        paste_probes([torch.ones(1, 4, 4)], images, 1, object_side=4, shape="star",
                     generator=torch.Generator().manual_seed(0))


def test_fill_boxes_covers_the_object_with_its_surroundings_and_nothing_else():
    # a left-to-right ramp background with a bright square object in each image
    ramp = torch.linspace(0, 0.5, 48)[None, None, None, :].expand(2, 3, 48, 48).clone()
    images = ramp.clone()
    images[0, :, 10:20, 12:24] = 1.0
    images[1, :, 30:44, 4:14] = 1.0
    boxes = torch.tensor([[12.0, 10.0, 24.0, 20.0], [4.0, 30.0, 14.0, 44.0]])
    out = fill_boxes(images, boxes)
    assert torch.isfinite(out).all()
    assert float((out[0, :, 10:20, 12:24] - ramp[0, :, 10:20, 12:24]).abs().max()) < 0.12  # the object is gone
    assert float((out[1, :, 30:44, 4:14] - ramp[1, :, 30:44, 4:14]).abs().max()) < 0.12
    assert float(out[0, :, 10:20, 12:24].max()) < 0.5  # no trace of the bright object
    far = torch.ones(48, 48, dtype=torch.bool)
    far[5:25, 8:28] = False  # the first box grown by its ramp, and a margin
    assert torch.equal(out[0, :, far], images[0, :, far])  # untouched away from the box
    assert torch.equal(images[0, :, 10:20, 12:24], torch.ones(3, 10, 12))  # the input is not changed
    assert fill_boxes(images[:0], boxes[:0]).shape == (0, 3, 48, 48)


def test_probe_style_soft_for_photo_bundles_and_refused_when_unknown():
    from models.guard import synthetic_probes
    from models.repair import probe_style

    gray, rgb = (SimpleNamespace(config=SimpleNamespace(input=SimpleNamespace(channels=c))) for c in (1, 3))
    assert probe_style("photos", rgb) == "soft" and probe_style("photos", gray) == "rect"
    assert probe_style("rect", rgb) == "rect" and probe_style("soft", gray) == "soft"
    bundle = new_bundle("t", mnist_config(), seed=0)
    with pytest.raises(ValueError, match="probe style"):
        synthetic_probes(bundle, torch.zeros(1), [torch.ones(1, 8, 8)], torch.zeros(2, 1, 84, 84), None, 2,
                         torch.Generator().manual_seed(0), style="seamless")


class _Scripted(Guard):
    """A guard whose policies' hits are given (no network): ``hits[name]`` is a bool tensor over the probes."""

    def __init__(self, hits: dict, n: int, cfg: GuardConfig | None = None, spearman: float = -0.9,
                 channels: int = 1, labeled: int = 0):
        self.hits, self.cfg = hits, cfg or GuardConfig()
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
        k = n // 2
        self.select, self.held = perm[:k].sort().values, perm[k:].sort().values
        self.labeled = torch.arange(labeled)
        self.bundle = SimpleNamespace(config=SimpleNamespace(input=SimpleNamespace(channels=channels)))
        self.faithfulness = {"ordacc": 90.0, "spearman": spearman}
        self.counts = {"labeled": labeled, "synthetic": n - labeled} if labeled else {"synthetic": n}
        self.base, self.checkpoints, self._base_hits, self._best, self._falling = None, [], None, None, 0
        self._voters, self._scored_by, self.loc = None, {}, None

    def _hits(self, agent_state):
        h = self.hits[agent_state]
        return h, h.float()


def _hits(n: int, rate: float, seed: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed)) < rate


def test_the_guard_activates_only_a_clear_gain_and_says_why():
    n = 200
    base, better, same = _hits(n, 0.5, 1), _hits(n, 0.9, 2), _hits(n, 0.5, 1)
    g = _Scripted({"start": base, "better": better, "same": same}, n)
    g.start("start")
    g.observe(10, "same")
    g.observe(20, "better")
    d = g.decide("auto")
    assert d["verdict"] == "improved" and d["activate"] == 20 and d["validation"]["best"]["iteration"] == 20
    assert d["validation"]["probes"] == {"synthetic": n, "select": 100, "held": 100, "synthetic_confirms": True,
                                            "labeled_rule": "beyond_noise"}
    assert g.decide("false")["activate"] is None and g.decide("true")["activate"] == 20

    g = _Scripted({"start": base, "same": same}, n)
    g.start("start")
    g.observe(10, "same")
    d = g.decide("auto")
    assert d["verdict"] == "no better" and d["activate"] is None
    assert g.decide("true")["activate"] == 10  # forced: the final checkpoint, whatever the probes say


def test_on_a_photo_bundle_pasted_probes_alone_do_not_activate():
    """RGB bundles: pasted probes said "better" where real photos got far worse (BENCHMARKS.md, real photographs),
    so ``auto`` needs the set's labeled examples (the first probes) to agree."""
    n = 200
    base, better = _hits(n, 0.5, 1), _hits(n, 0.9, 2)
    g = _Scripted({"start": base, "better": better}, n, channels=3)
    g.start("start")
    g.observe(20, "better")
    d = g.decide("auto")
    assert d["verdict"] == "improved" and d["activate"] is None and "no labeled examples" in d["message"]
    assert d["validation"]["probes"]["synthetic_confirms"] is False
    assert g.decide("true")["activate"] == 20  # the user may still force it
    forced = _Scripted({"start": base, "better": better}, n, GuardConfig(synthetic_confirms=True), channels=3)
    forced.start("start")
    forced.observe(20, "better")
    assert forced.decide("auto")["activate"] == 20
    # served by consensus (a format-5 start, ``pair_with``) too: pasted probes still do not activate on their own
    voted = _Scripted({"start": base, "better": better}, n, channels=3)
    voted.start("start")
    voted.observe(20, "better")
    voted._voters = []  # what ``pair_with`` sets for a companion with members (no network here to rebuild)
    assert voted.decide("auto")["activate"] is None

    agree = better.clone()
    agree[:8] = True  # the 8 labeled examples: all right after, fewer before
    start = base.clone()
    start[:8] = torch.arange(8) < 4
    g = _Scripted({"start": start, "better": agree}, n, channels=3, labeled=8)
    g.start("start")
    rec = g.observe(20, "better")
    assert rec["labeled"]["corloc"] == 100.0 and g.base["labeled"]["corloc"] == 50.0
    assert g.decide("auto")["activate"] == 20

    slight = better.clone()
    slight[:8] = start[:8]
    slight[4] = True  # one more of the 8 labeled examples right, none lost: within their noise
    g = _Scripted({"start": start, "better": slight}, n, channels=3, labeled=8)
    g.start("start")
    rec = g.observe(20, "better")
    assert rec["labeled_gain"] == 12.5 and rec["labeled_gain"] < rec["labeled_noise"]
    d = g.decide("auto")
    assert d["activate"] is None and "by more than their noise" in d["message"]
    assert d["validation"]["probes"]["labeled_rule"] == "beyond_noise"
    assert g.decide("auto", labeled_rule="agree")["activate"] == 20  # the rule before took it
    with pytest.raises(ValueError, match="labeled_rule"):
        g.decide("auto", labeled_rule="loose")

    disagree = better.clone()
    disagree[:8] = False  # better on the pasted probes, worse on the client's real boxes
    g = _Scripted({"start": start, "better": disagree}, n, channels=3, labeled=8)
    g.start("start")
    g.observe(20, "better")
    d = g.decide("auto")
    assert d["verdict"] == "improved" and d["activate"] is None and "do not confirm it" in d["message"]


@pytest.mark.parametrize(("n", "gained", "lost", "activated"),
                         [(5, 2, 0, False), (5, 3, 0, True), (5, 3, 1, False), (20, 3, 0, False), (20, 4, 0, True),
                          (20, 6, 1, True), (20, 5, 2, False)])
def test_labeled_examples_confirm_a_photo_checkpoint_only_beyond_their_noise(n, gained, lost, activated):
    """The labeled rule of RGB bundles: twice the standard error of the paired difference, as on the probes.
    Five labeled examples need 3 more right and none lost; twenty need 4 more, or 6 more for one lost."""
    m = 200
    start, better = _hits(m, 0.5, 1), _hits(m, 0.9, 2)
    start[:n], better[:n] = True, True  # the labeled examples come first: right before and after ...
    start[lost:lost + gained] = False  # ... but ``gained`` of them only after,
    better[:lost] = False  # and ``lost`` only before
    g = _Scripted({"start": start, "better": better}, m, channels=3, labeled=n)
    g.start("start")
    rec = g.observe(20, "better")
    assert round(rec["labeled_gain"] * n / 100) == gained - lost
    assert (g.decide("auto")["activate"] == 20) is activated
    assert g.decide("auto", labeled_rule="agree")["activate"] == 20  # every case here gains: the old rule took it


def test_a_policy_that_gets_worse_is_refused_and_stops_the_job_early():
    n = 200
    base = _hits(n, 0.8, 1)
    worse = {f"w{i}": _hits(n, 0.3, 10 + i) for i in range(3)}
    g = _Scripted({"start": base, **worse}, n, GuardConfig(patience=2))
    g.start("start")
    g.observe(10, "start")  # the first checkpoint equals the start: the best so far
    assert not g.should_stop
    g.observe(20, "w0")
    assert not g.should_stop
    g.observe(30, "w1")
    assert g.should_stop  # two checkpoints in a row below the best by more than the noise
    d = g.decide("auto")
    assert d["verdict"] == "worse" and d["activate"] is None and d["validation"]["stopped_early"]


def test_an_unfaithful_reward_is_reported_when_nothing_improved():
    n = 100
    base = _hits(n, 0.5, 1)
    g = _Scripted({"start": base, "same": base}, n, spearman=-0.05)
    g.start("start")
    g.observe(5, "same")
    d = g.decide("auto")
    assert d["verdict"] == "reward unreliable" and d["activate"] is None and "Spearman" in d["message"]


def test_the_guard_scores_the_served_answer_on_a_real_bundle():
    """End to end on a tiny random bundle: the start and a checkpoint are scored on every probe, split once."""
    bundle = new_bundle("tiny", mnist_config(), seed=0)
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(6, 1, 84, 84, generator=gen) * 0.2
    probes = paste_probes([torch.ones(1, 20, 14)], images, 24, object_side=28, generator=gen)
    g = Guard(bundle, torch.zeros(bundle.prototype_dim), probes, gen, counts={"synthetic": 24})
    base = g.start(None)
    assert base["select"]["n"] + base["held"]["n"] == 24 and 0 <= base["select"]["corloc"] <= 100
    rec = g.observe(1, bundle.agent_state)  # the same policy: no gain, no noise
    assert rec["gain"] == 0 and rec["select"] == base["select"]
    assert set(g.faithfulness) == {"ordacc", "spearman"}
    assert g.decide("auto")["activate"] is None


def test_pick_confirmed_takes_the_best_checkpoint_the_held_out_half_confirms():
    """``pick="best"`` takes the best checkpoint on the selection half or nothing; ``pick="confirmed"`` (the
    default) falls back on the best of those both halves call better, never on one only the selection half
    favours."""
    n = 200
    base = _hits(n, 0.5, 1)
    g = _Scripted({}, n)
    lucky = base.clone()
    lucky[g.select] = True  # all right on the selection half, the start's answers on the held-out half
    steady = base | _hits(n, 0.7, 3)  # better on both halves, less so on the selection half
    g.hits.update({"start": base, "lucky": lucky, "steady": steady})
    g.start("start")
    g.observe(10, "steady")
    g.observe(20, "lucky")
    assert g.best["iteration"] == 20 and g.best["held_gain"] == 0.0
    d = g.decide("auto", pick="best")
    assert d["verdict"] == "no better" and d["activate"] is None
    d = g.decide("auto")
    assert d["verdict"] == "improved" and d["activate"] == 10 and d["validation"]["best"]["iteration"] == 10
    assert GuardConfig().pick == "confirmed"

    g = _Scripted({"start": base, "lucky": lucky}, n, GuardConfig(pick="confirmed"))
    g.start("start")
    g.observe(20, "lucky")
    assert g.decide("auto")["activate"] is None  # nothing confirmed: nothing taken
    with pytest.raises(ValueError, match="pick"):
        g.decide("auto", pick="any")


# --- the guard's arithmetic and rules, by hand (written against the surviving mutants of models/guard.py)


def test_gains_noises_and_summaries_by_hand():
    """Each half scored on its own probes; the noise is twice the standard error of the paired difference against
    the start (n - 1 in the variance), in points, at least one probe's worth; CorLoc to 2 decimals, IoU to 4."""
    base = torch.tensor([1, 1, 0, 0, 1, 0, 1, 0, 1, 1, 0, 0], dtype=torch.bool)
    ckpt = torch.tensor([1, 1, 1, 1, 0, 1, 1, 1, 1, 0, 0, 1], dtype=torch.bool)
    g = _Scripted({"start": base, "c": ckpt, "same": base}, 12)
    g.select, g.held = torch.arange(6), torch.arange(6, 12)
    start = g.start("start")
    assert start["select"] == {"corloc": 50.0, "mean_iou": 0.5, "n": 6}
    rec = g.observe(7, "c")
    assert rec["select"] == {"corloc": 83.33, "mean_iou": 0.8333, "n": 6}  # 5 of 6
    assert rec["gain"] == 33.33
    # paired differences [0, 0, 1, 1, -1, 1]: sd (n - 1) = sqrt(2/3), se = sd / sqrt(6) = 1/3
    assert rec["noise"] == 66.67
    assert rec["held"] == {"corloc": 66.67, "mean_iou": 0.6667, "n": 6} and rec["held_gain"] == 16.67
    # held-out differences [0, 1, 0, -1, 0, 1]: its own noise, not the selection half's
    assert rec["held_noise"] == round(2 * statistics.stdev([0, 1, 0, -1, 0, 1]) / math.sqrt(6) * 100, 2) == 61.46
    assert g.observe(8, "same")["noise"] == 16.67  # no difference: one probe's worth (1 / 6)
    g.select = torch.tensor([0, 2])  # differences [0, 1]: se 0.5, twice that 1.0
    assert g._noise(ckpt) == 100.0
    g.select = torch.tensor([2])  # one probe: a standard error of 1 (no spread to measure), floor 1 / 1
    assert g._noise(ckpt) == 200.0


def _rec(it: int, corloc: float, gain: float, noise: float, held_gain: float, held_noise: float, iou: float = 0.5,
         **labeled: float) -> dict:
    rec = {"iteration": it, "select": {"corloc": corloc, "mean_iou": iou}, "held": {"corloc": 50.0 + held_gain},
           "gain": gain, "noise": noise, "held_gain": held_gain, "held_noise": held_noise, **labeled}
    if "labeled_gain" in labeled:
        rec["labeled"] = {"corloc": 50.0 + labeled["labeled_gain"]}
    return rec


def _decide(checkpoints: list[dict], *args, spearman: float = -0.9, channels: int = 1, labeled: int = 0,
            **kwargs) -> dict:
    """``decide`` on checkpoint records given as they are (the best: highest selection CorLoc, then IoU)."""
    g = _Scripted({}, 10, spearman=spearman, channels=channels, labeled=labeled)
    g.base = {"select": {"corloc": 50.0}, "held": {"corloc": 50.0}, "labeled": {"corloc": 50.0}}
    g.checkpoints = checkpoints
    if checkpoints:
        i = max(range(len(checkpoints)), key=lambda j: (checkpoints[j]["select"]["corloc"],
                                                        checkpoints[j]["select"]["mean_iou"]))
        g._best = (checkpoints[i]["select"]["corloc"], checkpoints[i]["select"]["mean_iou"], i)
    return g.decide(*args, **kwargs)


def test_a_gain_must_exceed_its_noise_on_both_halves():
    assert _decide([_rec(5, 70.0, 20.0, 10.0, 8.0, 5.0)])["activate"] == 5  # mode defaults to auto
    assert _decide([_rec(5, 70.0, 10.0, 10.0, 8.0, 5.0)])["verdict"] == "no better"  # equal to the noise: no
    assert _decide([_rec(5, 70.0, 20.0, 10.0, 5.0, 5.0)])["verdict"] == "no better"
    d = _decide([_rec(5, 70.0, 20.0, 10.0, 8.0, 5.0)], "auto", pick="best")  # the best is confirmed: taken
    assert d["verdict"] == "improved" and d["activate"] == 5 and "not activated" not in d["message"]
    assert d["message"].startswith("probe CorLoc 50.0 -> 70.0 at iteration 5 (noise 10.0)")


def test_confirmed_takes_the_best_of_several_that_pass_by_corloc_then_iou():
    passing = [_rec(1, 60.0, 10.0, 5.0, 6.0, 5.0), _rec(2, 65.0, 15.0, 5.0, 6.0, 5.0, iou=0.4),
               _rec(3, 65.0, 15.0, 5.0, 6.0, 5.0, iou=0.6), _rec(4, 64.0, 14.0, 5.0, 6.0, 5.0)]
    lucky = _rec(9, 90.0, 40.0, 5.0, 0.0, 5.0)  # the best on the selection half, not confirmed
    assert _decide([*passing, lucky], "auto", pick="best")["activate"] is None
    d = _decide([*passing, lucky])
    assert d["activate"] == 3 and d["validation"]["best"]["iteration"] == 3


def test_the_verdicts_boundaries_and_what_each_mode_activates():
    flat = _rec(5, 50.0, 0.0, 10.0, 0.0, 5.0)
    assert _decide([flat], spearman=-0.3)["verdict"] == "no better"  # faithfulness 0.3 = the bar: reliable
    d = _decide([flat], spearman=-0.29)
    assert d["verdict"] == "reward unreliable" and d["message"].endswith(
        "objects, and no checkpoint beat the starting policy")
    assert _decide([_rec(5, 40.0, -10.0, 10.0, 0.0, 5.0)])["verdict"] == "no better"  # down by the noise only
    d = _decide([_rec(5, 40.0, -10.5, 10.0, 0.0, 5.0)])
    assert d["verdict"] == "worse" and d["message"].endswith("; the starting policy is better")
    d = _decide([flat])
    assert d["message"] == "no checkpoint beat the starting policy on the probes by more than their noise"
    assert _decide([], "true")["activate"] is None and _decide([], "auto")["verdict"] == "no better"
    assert _decide([flat, _rec(6, 45.0, -5.0, 10.0, 0.0, 5.0)], "true")["activate"] == 6  # the last, forced
    with pytest.raises(ValueError, match="activate must be one of"):
        _decide([flat], "always")
    g = _Scripted({"start": _hits(10, 0.5, 1)}, 10)
    g.start("start")
    v = g.decide()["validation"]
    assert v["faithfulness"] is g.faithfulness and v["base"] is g.base and v["checkpoints"] is g.checkpoints


def test_labeled_examples_rules_at_their_boundaries():
    def rec(labeled_gain: float, labeled_noise: float = 20.0) -> dict:
        return _rec(5, 70.0, 20.0, 10.0, 8.0, 5.0, labeled_gain=labeled_gain, labeled_noise=labeled_noise)

    assert _decide([rec(25.0)], channels=3, labeled=1)["activate"] == 5  # one labeled example is enough to count
    d = _decide([rec(20.0)], channels=3, labeled=1)  # equal to its noise: not beyond it
    assert d["activate"] is None and d["message"].startswith("probe CorLoc 50.0 -> 70.0")
    assert "; not activated: pasted probes alone do not predict real photos for this bundle, and the set's labeled " \
           "examples do not confirm it by more than their noise (20.0) (CorLoc 50.0 -> " in d["message"]
    assert d["message"].endswith("more labeled examples make a smaller gain count); activate a checkpoint yourself "
                                 "to use it")
    assert _decide([rec(0.0)], channels=3, labeled=1, labeled_rule="agree")["activate"] == 5  # as many right
    d = _decide([rec(-0.5)], channels=3, labeled=1, labeled_rule="agree")
    assert d["activate"] is None and "do not confirm it (CorLoc" in d["message"]
    d = _decide([rec(25.0)], channels=3)  # no labeled examples
    assert d["message"].endswith("the set has no labeled examples to confirm it on (create the set from whole "
                                 "images with `boxes`); activate a checkpoint yourself to use it")


def test_the_best_so_far_keeps_the_first_of_equals_and_falling_counts_only_beyond_the_noise():
    base = torch.tensor([1, 1, 0, 0], dtype=torch.bool)
    up = torch.tensor([1, 1, 1, 0], dtype=torch.bool)
    g = _Scripted({"start": base, "up": up, "base": base, "down": torch.zeros(4, dtype=torch.bool)}, 4,
                  GuardConfig(patience=1))
    g.select, g.held = torch.arange(4), torch.arange(4)
    g.start("start")
    g.observe(1, "up")
    g.observe(2, "up")
    assert g.best["iteration"] == 1  # equal to the best: the earlier stays
    rec = g.observe(3, "base")  # 50 against the best's 75: down by exactly its noise (25, one probe's worth)
    assert rec["noise"] == 25.0 and not g.should_stop
    g.observe(4, "down")
    assert g.should_stop  # below by more than the noise
    g2 = _Scripted(g.hits, 4, GuardConfig(patience=2))
    g2.select, g2.held = torch.arange(4), torch.arange(4)
    g2.start("start")
    for it, name in enumerate(["up", "down", "base", "down", "up", "down"]):  # never two falls in a row
        g2.observe(it, name)
        assert not g2.should_stop, it
    g2.observe(9, "down")
    assert g2.should_stop


@pytest.fixture(scope="module")
def tiny_guard_parts():
    bundle = new_bundle("tiny", mnist_config(), seed=0)
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(6, 1, 84, 84, generator=gen) * 0.2
    probes = paste_probes([torch.ones(1, 20, 14)], images, 10, object_side=28, generator=gen)
    return bundle, probes


def test_the_probes_split_once_by_the_jobs_generator_into_halves_of_the_configured_size(tiny_guard_parts):
    bundle, probes = tiny_guard_parts
    proto = torch.zeros(bundle.prototype_dim)
    for fraction, k in ((0.5, 5), (0.95, 9), (0.01, 1), (0.3, 3)):
        g = Guard(bundle, proto, probes, torch.Generator().manual_seed(7), GuardConfig(select_fraction=fraction),
                  counts={"synthetic": 10})
        perm = torch.randperm(10, generator=torch.Generator().manual_seed(7))
        assert g.select.tolist() == sorted(perm[:k].tolist()) and g.held.tolist() == sorted(perm[k:].tolist())
    two = LabeledImages(probes.images[:2], probes.boxes[:2])
    g = Guard(bundle, proto, two, torch.Generator().manual_seed(0))
    assert len(g.select) == len(g.held) == 1 and len(g.labeled) == 0
    with pytest.raises(ValueError, match="at least 2 probes, got 1"):
        Guard(bundle, proto, LabeledImages(probes.images[:1], probes.boxes[:1]), torch.Generator())
    assert Guard(bundle, proto, probes, torch.Generator(), counts={"labeled": 3}).labeled.tolist() == [0, 1, 2]
    assert len(Guard(bundle, proto, probes, torch.Generator(), counts={"labeled": 50}).labeled) == 10
    with pytest.raises(RuntimeError, match=r"^call start\(\) with the starting policy first$"):
        g.observe(1, bundle.agent_state)


def test_faithfulness_is_the_rewards_ranking_on_the_probes_and_follows_a_repaired_reward(tiny_guard_parts):
    bundle, probes = tiny_guard_parts
    proto = torch.randn(bundle.prototype_dim, generator=torch.Generator().manual_seed(1))

    def ranked(b):  # type: ignore[no-untyped-def]
        data = LabeledImages(probes.images, probes.boxes, features_of(b, probes.images))
        r = ranking_metrics(b, data, proto, seed=0, candidates=training_candidates(b))
        return {"ordacc": round(r["ordacc"], 2), "spearman": round(r["spearman"], 4)}

    g = Guard(bundle, proto, probes, torch.Generator().manual_seed(0))
    assert g.faithfulness == ranked(bundle)
    base = g.start(None)
    other = new_bundle("tiny", mnist_config(), seed=1)
    other.embedder.encoder.load_state_dict(bundle.embedder.encoder.state_dict())  # a new head, the same backbone
    g.use_reward(other, proto)
    assert g.bundle is other and g.prototype is proto and g.loc.bundle is other
    assert g.faithfulness == ranked(other) != ranked(bundle)
    assert g.base is base  # the start keeps the score it had
    fresh = Guard(other, proto, probes, torch.Generator().manual_seed(0))
    fresh.start(None)
    agent = other.agent_state
    assert g.observe(1, agent)["select"] == fresh.observe(1, agent)["select"]  # scored with the new head


def test_synthetic_probes_erase_where_the_start_answers_and_paste_a_crop_at_its_box():
    """By value, on flat images (image ``i`` all ``i / 10``) and white crops: each probe is one image with its erase
    box covered by another image's pixels (``rect``) or a flat fill from around it (``soft``), and a crop pasted at
    the box it reports (whole for ``rect``, its inscribed ellipse for ``soft``), its long side ``PROBE_SCALE`` times
    the bundle's exemplar size. Without ``erase`` the boxes covered are the starting policy's answers
    (``agent_state``: ``None``, the bundle's)."""
    from models.guard import PROBE_SCALE, synthetic_probes
    from models.inference import Localizer

    bundle = new_bundle("t", mnist_config(), seed=0)
    images = torch.arange(1, 5).float().div(10).view(4, 1, 1, 1).expand(4, 1, 84, 84).clone()
    crops = [torch.ones(1, 20, 20), torch.ones(1, 10, 20)]
    erase = torch.tensor([[0.0, 0.0, 84.0, 30.0]]).expand(4, 4).clone()  # the top strip of every image
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    side = bundle.config.input.exemplar_size
    loc = Localizer(bundle, "cpu")
    proto = loc.prototype(crops)
    for style in ("rect", "soft"):
        p = synthetic_probes(bundle, proto, crops, images, None, 16, gen(), erase, style=style)
        assert p.images.shape == (16, 1, 84, 84) and p.boxes.shape == (16, 4)
        for im, box in zip(p.images[:, 0], p.boxes, strict=True):
            x1, y1, x2, y2 = (int(v) for v in box)
            long = max(x2 - x1, y2 - y1)
            assert PROBE_SCALE[0] * side - 1 <= long <= PROBE_SCALE[1] * side + 1, (long, side)
            assert float(im[(y1 + y2) // 2, (x1 + x2) // 2]) == pytest.approx(1.0, abs=1e-3)  # the crop
            corner = float(im[y1 + 2, x1 + 2])  # inside the pasted rectangle; outside its inscribed ellipse
            assert corner == pytest.approx(1.0, abs=1e-3) if style == "rect" else corner < 0.6
            mask = torch.ones(84, 84, dtype=torch.bool)
            mask[max(0, y1 - 3):y2 + 3, max(0, x1 - 3):x2 + 3] = False  # away from the paste and its feather
            below, strip = im[30:][mask[30:]], im[:30][mask[:30]]
            own = float(below[0])
            assert torch.allclose(below, torch.tensor(own), atol=1e-3) and round(own * 10) in (1, 2, 3, 4)
            if len(strip) and style == "rect":  # the strip: another image's pixels
                assert torch.allclose(strip, strip[0], atol=1e-3) and abs(float(strip[0]) - own) > 0.05
            elif len(strip):  # a fill from around it: the image's own flat value
                assert torch.allclose(strip, torch.tensor(own), atol=1e-2)
    starts = loc.run(images, proto, loc.agent(None)).boxes[-1].cpu()
    plain = synthetic_probes(bundle, proto, crops, images, None, 16, gen())
    given = synthetic_probes(bundle, proto, crops, images, None, 16, gen(), starts)
    assert torch.equal(plain.images, given.images) and torch.equal(plain.boxes, given.boxes)


def test_a_paired_or_consensus_checkpoint_is_scored_as_localize_serves_it(tiny_guard_parts):
    """``pair_with``: each checkpoint observed from then on is scored by a localizer with the companion (the job's
    start as served: the two heads' agreement), and with ``members`` (format 5) by the consensus of the start, the
    checkpoints observed before it and itself; ``None`` scores it alone again. Each record is the served localizer's
    answers on the probes, by value, and ``served`` hands back that localizer."""
    from models.companion import Companion
    from models.core.boxes import paired_iou
    from models.inference import Localizer

    bundle, probes = tiny_guard_parts
    proto = torch.randn(bundle.prototype_dim, generator=torch.Generator().manual_seed(1))
    states = [new_bundle("tiny", mnist_config(), seed=s).agent_state for s in (1, 2, 3)]
    feats = features_of(bundle, probes.images)

    g = Guard(bundle, proto, probes, torch.Generator().manual_seed(0))

    def scored(loc: Localizer, state: dict) -> dict:  # on the selection half, as the record
        boxes = loc.run_features(feats, proto, loc.agent(state)).boxes[-1].cpu()
        iou = paired_iou(boxes, probes.boxes)[g.select]
        return {"corloc": round(float((iou >= 0.5).float().mean() * 100), 2), "mean_iou": round(float(iou.mean()), 4)}

    g.start(None)
    alone = Localizer(bundle, "cpu")
    start = Companion(alone, alone.agent(None), proto, agree=True)
    g.pair_with(start)
    assert g._voters is None  # no members: the agreement rule, no votes kept
    rec = g.observe(1, states[0])
    paired = Localizer(bundle, "cpu", companion=start)
    want = scored(paired, states[0])
    assert {k: rec["select"][k] for k in want} == want != scored(alone, states[0])
    assert g.served(1).companion is start and g.served(1).bundle is bundle

    g.pair_with(None)
    rec = g.observe(2, states[0])
    assert {k: rec["select"][k] for k in want} == scored(alone, states[0]) and g.served(2).companion is None

    voting = Companion(alone, alone.agent(None), proto, members=())
    g.pair_with(voting)
    assert g._voters == []
    first = g.observe(3, states[1])
    assert g.served(3).companion.members == ()  # the start and the checkpoint itself
    second = g.observe(4, states[2])
    members = g.served(4).companion.members  # the checkpoint observed before it votes too
    assert len(members) == 1 and all(torch.equal(a, b) for a, b in zip(
        members[0].state_dict().values(), alone.agent(states[1]).state_dict().values(), strict=True))
    for r, state, before in ((first, states[1], ()), (second, states[2], (alone.agent(states[1]),))):
        want = scored(Localizer(bundle, "cpu", companion=Companion(alone, alone.agent(None), proto, members=before)),
                      state)
        assert {k: r["select"][k] for k in want} == want
    assert scored(Localizer(bundle, "cpu", companion=Companion(alone, alone.agent(None), proto, members=())),
                  states[2]) != {k: second["select"][k] for k in want}  # the vote of checkpoint 3 counted


def test_a_probe_answered_at_an_iou_of_exactly_one_half_is_a_hit(tiny_guard_parts):
    """CorLoc's bar is IoU >= 0.5, as every benchmark counts it: a probe whose box is the answer widened to twice its
    width (IoU exactly 0.5) counts as found, in the record's CorLoc too."""
    from models.core.boxes import paired_iou
    from models.inference import Localizer

    bundle, probes = tiny_guard_parts
    proto = torch.randn(bundle.prototype_dim, generator=torch.Generator().manual_seed(1))
    loc = Localizer(bundle, "cpu")
    answers = loc.run_features(features_of(bundle, probes.images), proto, loc.agent(None)).boxes[-1].cpu()
    doubled = answers.clone()
    doubled[:, 2] = answers[:, 0] + 2 * (answers[:, 2] - answers[:, 0])
    assert (paired_iou(answers, doubled) == 0.5).all()  # exactly, in float32

    g = Guard(bundle, proto, LabeledImages(probes.images, doubled), torch.Generator().manual_seed(0))
    hits, iou = g._hits(None)
    assert hits.all() and (iou == 0.5).all()
    assert g.start(None)["select"]["corloc"] == 100.0
