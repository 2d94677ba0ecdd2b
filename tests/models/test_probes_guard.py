"""Probe synthesis against exact boxes, and the guard's decisions on scored checkpoints."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from models.bundle import new_bundle
from models.data.probes import _feathered, erase_boxes, paste_probes
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
