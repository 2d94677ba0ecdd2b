"""``models.repair.guarded_setup`` by value, without repair's training: what a job adapts and is guarded with, given
the repair it makes (a spy in place of ``repair_reward`` returns a kept repair made by hand, or a refused one), so that
every draw, seed, erasure and hand-over the docstring states is pinned in seconds.

What repair's training and the guard's decisions do is ``tests/models/test_repair.py``, ``test_probes_guard.py`` and
``test_rewards.py``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from models import repair as repair_module
from models.bundle import Start, load_bundle
from models.data.types import LabeledImages, exemplar_crops
from models.evaluate import ranking
from models.experiments.datasets import GlyphKind
from models.guard import Guard, GuardConfig, synthetic_probes
from models.inference import Localizer
from models.repair import MIN_TRAIN_PROBES, Repair, RepairConfig, guarded_setup
from models.train.embedding import Interrupted

BUNDLE = Path(__file__).resolve().parents[2] / "bundles" / "mnist-digit4.pt"


@pytest.fixture(scope="module")
def bundle():
    return load_bundle(BUNDLE, "cpu")


@pytest.fixture(scope="module")
def job(bundle):
    """A kind the bundle never saw: 5 exemplar crops, 24 unlabeled images, 3 labeled examples, the prototype."""
    kind = GlyphKind("K", "patch")
    crops = exemplar_crops(kind.draw(bundle, "exemplars", 5, 0))
    images = kind.draw(bundle, "unlabeled", 24, 0, after=5).images
    labeled = kind.draw(bundle, "val", 3, 1)  # whole images with their true boxes
    return crops, images, LabeledImages(labeled.images, labeled.boxes), Localizer(bundle, "cpu").prototype(crops)


def gen(seed: int, k: int) -> torch.Generator:
    """``guarded_setup``'s k-th draw of a job seeded ``seed``."""
    return torch.Generator().manual_seed(seed * 7919 + k)


def kept_repair(bundle, crops) -> Repair:  # type: ignore[no-untyped-def]
    """A kept repair, by hand: the bundle's head moved a little (a ranking of its own), its prototype under it."""
    g = torch.Generator().manual_seed(5)
    head = {k: v + 0.2 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
            for k, v in bundle.embedder.head.state_dict().items()}
    rb = bundle.with_head(head, refine=True)
    return Repair(True, rb, Localizer(rb, "cpu").prototype(crops), {"kept": True, "after": {"ordacc": 80.0}})


class Spy:
    """``repair_reward``'s place: records its arguments, returns ``out``."""

    def __init__(self, out: Repair):
        self.out, self.calls = out, []

    def __call__(self, bundle, crops, train, val, cfg, *, should_stop=None):  # type: ignore[no-untyped-def]
        self.calls.append({"bundle": bundle, "crops": crops, "train": train, "val": val, "cfg": cfg,
                           "should_stop": should_stop})
        return self.out


@pytest.fixture
def choices(monkeypatch):  # type: ignore[no-untyped-def]
    """The arguments of every ``choose_reward`` call (it still chooses)."""
    seen: list[dict] = []
    real = repair_module.choose_reward

    def choose(b, scorers, probes, **kw):  # type: ignore[no-untyped-def]
        seen.append({"bundle": b, "scorers": scorers, "probes": probes, **kw})
        return real(b, scorers, probes, **kw)

    monkeypatch.setattr(repair_module, "choose_reward", choose)
    return seen


def same(a: LabeledImages, b: LabeledImages) -> bool:
    return torch.equal(a.images, b.images) and torch.equal(a.boxes, b.boxes)


def erase_boxes_of(rb, images, prototype=None, scorer=None):  # type: ignore[no-untyped-def]
    return ranking(rb, LabeledImages(images, torch.zeros(len(images), 4)), prototype, scorer=scorer)


def test_repair_is_made_on_two_draws_of_its_own_with_the_jobs_seed_and_the_guard_then_uses_its_reward(
        bundle, job, monkeypatch):
    crops, images, _, proto = job
    rep = kept_repair(bundle, crops)
    spy = Spy(rep)
    monkeypatch.setattr(repair_module, "repair_reward", spy)
    stop = lambda: False  # noqa: E731
    cfg = RepairConfig(epochs=7, lr=0.5, batch_size=9, min_gain=1.5, seed=99)
    g = guarded_setup(bundle, proto, crops, images, None, synthetic=20, generator_seed=4, repair=cfg,
                      should_stop=stop, probe_style="soft")
    (c,) = spy.calls
    assert c["bundle"] is bundle and c["crops"] is crops and c["should_stop"] is stop
    assert c["cfg"] == replace(cfg, seed=4)  # the job's seed; the rest of the recipe as given
    assert same(c["train"], synthetic_probes(bundle, proto, crops, images, None, 20, gen(4, 1), style="soft"))
    assert same(c["val"], synthetic_probes(bundle, proto, crops, images, None, 10, gen(4, 2), style="soft"))
    # the job adapts with the repaired bundle and prototype; the guard scores with them, its probes a third draw
    # erased where the repaired reward's ranking finds the object
    assert g.bundle is rep.bundle and g.prototype is rep.prototype and g.repair is rep and g.reward == "repaired head"
    erase = erase_boxes_of(rep.bundle, images, rep.prototype)
    want = synthetic_probes(bundle, proto, crops, images, None, 20, gen(4, 3), erase, style="soft")
    assert same(g.guard.probes, want)
    assert not same(want, synthetic_probes(bundle, proto, crops, images, None, 20, gen(4, 3), style="soft"))
    assert g.guard.bundle is rep.bundle and torch.equal(g.guard.prototype, rep.prototype)
    assert g.guard.counts == {"labeled": 0, "synthetic": 20}
    assert g.start is None and g.guard.loc.companion is None  # no start given: served alone
    assert g.choice is None and g.scorer is None


def test_the_guard_judges_the_start_with_the_bundles_own_head_and_its_draw_is_seeded(bundle, job, monkeypatch):
    """The guard's base is the starting policy as served before the job (the bundle's head, the set's prototype);
    its split of probes is the job's fourth draw."""
    crops, images, _, proto = job
    rep = kept_repair(bundle, crops)
    monkeypatch.setattr(repair_module, "repair_reward", Spy(rep))
    kw = dict(synthetic=16, generator_seed=2, repair=RepairConfig())
    g = guarded_setup(bundle, proto, crops, images, None, **kw)
    plain = guarded_setup(bundle, proto, crops, images, None, synthetic=16, generator_seed=2)
    assert plain.repair is None and plain.reward == "bundle head"
    # the start's score is the bundle head's on the guard's probes
    ref = Guard(bundle, proto, g.guard.probes, gen(2, 4), counts=dict(g.guard.counts))
    ref.start(None)
    assert g.guard.base == ref.base
    assert torch.equal(g.guard.select, ref.select) and torch.equal(g.guard.held, ref.held)
    other = Guard(bundle, proto, g.guard.probes, gen(2, 5), counts=dict(g.guard.counts))
    assert not torch.equal(other.select, ref.select)  # (another draw splits otherwise)
    cfg = GuardConfig(select_fraction=0.25)
    narrow = guarded_setup(bundle, proto, crops, images, None, **kw, guard_cfg=cfg)
    assert narrow.guard.cfg is cfg and len(narrow.guard.select) == 4


def test_a_start_is_paired_only_where_the_repair_is_kept(bundle, job, monkeypatch):
    crops, images, _, proto = job
    start = Start(proto)
    rep = kept_repair(bundle, crops)
    monkeypatch.setattr(repair_module, "repair_reward", Spy(rep))
    kept = guarded_setup(bundle, proto, crops, images, None, synthetic=16, generator_seed=1, repair=RepairConfig(),
                         start=start)
    c = kept.guard.loc.companion
    assert kept.start is start and c is not None and torch.equal(c.prototype, proto)
    assert kept.guard.loc.bundle is rep.bundle
    refused = Repair(False, bundle, proto, {"kept": False})
    monkeypatch.setattr(repair_module, "repair_reward", Spy(refused))
    alone = guarded_setup(bundle, proto, crops, images, None, synthetic=16, generator_seed=1, repair=RepairConfig(),
                          start=start)
    assert alone.start is None and alone.guard.loc.companion is None and alone.reward == "bundle head"
    assert alone.repair is refused and alone.bundle is bundle and alone.prototype is proto
    assert alone.guard.bundle is bundle
    # a refused repair erases nothing: the guard's probes are the plain third draw
    assert same(alone.guard.probes, synthetic_probes(bundle, proto, crops, images, None, 16, gen(1, 3)))


def test_repair_needs_enough_probes_and_a_given_repair_is_used_as_it_is(bundle, job, monkeypatch):
    crops, images, _, proto = job
    spy = Spy(kept_repair(bundle, crops))
    monkeypatch.setattr(repair_module, "repair_reward", spy)
    few = guarded_setup(bundle, proto, crops, images, None, synthetic=MIN_TRAIN_PROBES - 1, generator_seed=0,
                        repair=RepairConfig())
    assert few.repair is None and spy.calls == [] and few.bundle is bundle
    enough = guarded_setup(bundle, proto, crops, images, None, synthetic=MIN_TRAIN_PROBES, generator_seed=0,
                           repair=RepairConfig())
    assert enough.repair is spy.out and len(spy.calls) == 1
    assert len(spy.calls[0]["val"]) == MIN_TRAIN_PROBES // 2
    given = kept_repair(bundle, crops)
    reused = guarded_setup(bundle, proto, crops, images, None, synthetic=MIN_TRAIN_PROBES, generator_seed=0,
                           repair=RepairConfig(), repaired=given)
    assert reused.repair is given and len(spy.calls) == 1  # not made again
    assert same(reused.guard.probes, enough.guard.probes)
    no_repair = guarded_setup(bundle, proto, crops, images, None, synthetic=32, generator_seed=0, repaired=given)
    assert no_repair.repair is None and no_repair.bundle is bundle  # only asked for with ``repair``


def test_a_canceled_job_stops_repair_before_it_trains(bundle, job):
    crops, images, _, proto = job
    with pytest.raises(Interrupted):
        guarded_setup(bundle, proto, crops, images, None, synthetic=16, generator_seed=0,
                      repair=RepairConfig(epochs=1), should_stop=lambda: True)


def test_the_guards_probes_are_the_labeled_examples_first_then_the_synthetic_draw(bundle, job):
    crops, images, labeled, proto = job
    both = guarded_setup(bundle, proto, crops, images, None, synthetic=6, generator_seed=3, labeled=labeled)
    synth = synthetic_probes(bundle, proto, crops, images, None, 6, gen(3, 3))
    assert same(both.guard.probes, LabeledImages(torch.cat([labeled.images, synth.images]),
                                                 torch.cat([labeled.boxes, synth.boxes])))
    assert both.guard.counts == {"labeled": 3, "synthetic": 6} and both.guard.labeled.tolist() == [0, 1, 2]
    only = guarded_setup(bundle, proto, crops, images, None, synthetic=0, generator_seed=3, labeled=labeled)
    assert same(only.guard.probes, labeled) and only.guard.counts == {"labeled": 3, "synthetic": 0}
    empty = LabeledImages(labeled.images[:0], labeled.boxes[:0])
    none = guarded_setup(bundle, proto, crops, images, None, synthetic=6, generator_seed=3, labeled=empty)
    assert same(none.guard.probes, synth) and none.guard.counts == {"labeled": 0, "synthetic": 6}
    agent = {k: v * 0.5 if v.is_floating_point() else v for k, v in bundle.agent_state.items()}
    moved = guarded_setup(bundle, proto, crops, images, agent, synthetic=6, generator_seed=3)
    assert same(moved.guard.probes, synthetic_probes(bundle, proto, crops, images, agent, 6, gen(3, 3)))
    assert not same(moved.guard.probes, synth)  # erased where the starting policy answers: its own answers


def test_the_reward_choice_decides_on_repairs_draw_and_erases_where_the_chosen_candidate_finds_the_object(
        bundle, job, monkeypatch, choices):
    crops, images, _, proto = job
    rep = kept_repair(bundle, crops)
    spy = Spy(rep)
    monkeypatch.setattr(repair_module, "repair_reward", spy)
    g = guarded_setup(bundle, proto, crops, images, None, synthetic=16, generator_seed=6, repair=RepairConfig(),
                      choice=True, choice_margin=-10.0)
    (c,) = choices
    assert c["bundle"] is rep.bundle and c["margin"] == -10.0 and c["seed"] == 6
    assert c["probes"] is spy.calls[0]["val"]  # the probes repair decided on
    assert torch.equal(c["scorers"]["embedding"].prototype, rep.prototype)  # the kept head's
    chosen = g.choice.chosen
    assert chosen != "embedding" and g.scorer is g.choice.scorer
    erase = erase_boxes_of(rep.bundle, images, None, g.choice.scorer)
    assert same(g.guard.probes, synthetic_probes(bundle, proto, crops, images, None, 16, gen(6, 3), erase))
    assert g.guard.faithfulness == repair_module.scorer_faithfulness(
        rep.bundle, g.choice.scorer, LabeledImages(g.guard.probes.images, g.guard.probes.boxes, g.guard.feats))
    # without repair: the same draw is made for the choice; a choice of the embedding keeps the kept erasure
    choices.clear()
    plain = guarded_setup(bundle, proto, crops, images, None, synthetic=16, generator_seed=6, choice=True,
                          choice_margin=10.0)
    assert plain.choice.chosen == "embedding" and plain.scorer is None
    assert same(choices[0]["probes"], synthetic_probes(bundle, proto, crops, images, None, 8, gen(6, 2)))
    assert choices[0]["bundle"] is bundle and choices[0]["margin"] == 10.0
    assert same(plain.guard.probes, synthetic_probes(bundle, proto, crops, images, None, 16, gen(6, 3)))
    kept_embedding = guarded_setup(bundle, proto, crops, images, None, synthetic=16, generator_seed=6,
                                   repair=RepairConfig(), choice=True, choice_margin=10.0)
    assert kept_embedding.choice.chosen == "embedding"
    assert same(kept_embedding.guard.probes, synthetic_probes(
        bundle, proto, crops, images, None, 16, gen(6, 3), erase_boxes_of(rep.bundle, images, rep.prototype)))
    assert kept_embedding.guard.faithfulness != g.guard.faithfulness  # the repaired embedding's, not a candidate's
    tiny = guarded_setup(bundle, proto, crops, images, None, synthetic=1, generator_seed=6, choice=True,
                         labeled=job[2])
    assert tiny.choice is None  # fewer than two probes to decide on: no choice
    assert len(tiny.guard.probes) == 4 and tiny.guard.counts == {"labeled": 3, "synthetic": 1}


def test_the_choice_is_made_from_two_probes_on_the_jobs_probe_style(bundle, job, choices):
    crops, images, _, proto = job
    for synthetic in (2, 4):
        g = guarded_setup(bundle, proto, crops, images, None, synthetic=synthetic, generator_seed=1, choice=True,
                          probe_style="soft")
        assert g.choice is not None and g.choice.probes == 2
        want = synthetic_probes(bundle, proto, crops, images, None, 2, gen(1, 2), style="soft")
        assert same(choices[-1]["probes"], want)


def test_a_chosen_ncc_reward_is_judged_on_the_probes_images(bundle, job, monkeypatch):
    """The NCC candidate reads the probes' pixels: the guard's faithfulness is the chosen candidate's on them."""
    crops, images, _, proto = job
    real = repair_module.candidate_scorers
    monkeypatch.setattr(repair_module, "candidate_scorers",
                        lambda b, p, c: real(b, p, c, ("embedding", "ncc")))  # here the NCC beats the embedding
    g = guarded_setup(bundle, proto, crops, images, None, synthetic=16, generator_seed=6, choice=True,
                      choice_margin=-10.0)
    assert g.choice.chosen == "ncc"
    assert g.guard.faithfulness == repair_module.scorer_faithfulness(
        bundle, g.choice.scorer, LabeledImages(g.guard.probes.images, g.guard.probes.boxes))


def test_every_draw_starts_from_the_starting_policy(bundle, job, monkeypatch, choices):
    """A job that starts from a checkpoint: repair's draws, the choice's and the guard's are erased where that policy
    answers, and the guard's base is that policy's score."""
    crops, images, _, proto = job
    agent = {k: v * 0.5 if v.is_floating_point() else v for k, v in bundle.agent_state.items()}
    spy = Spy(Repair(False, bundle, proto, {"kept": False}))
    monkeypatch.setattr(repair_module, "repair_reward", spy)
    g = guarded_setup(bundle, proto, crops, images, agent, synthetic=16, generator_seed=2, repair=RepairConfig())
    (c,) = spy.calls
    assert same(c["train"], synthetic_probes(bundle, proto, crops, images, agent, 16, gen(2, 1)))
    assert same(c["val"], synthetic_probes(bundle, proto, crops, images, agent, 8, gen(2, 2)))
    assert not same(c["val"], synthetic_probes(bundle, proto, crops, images, None, 8, gen(2, 2)))
    ref = Guard(bundle, proto, g.guard.probes, gen(2, 4), counts=dict(g.guard.counts))
    ref.start(agent)
    assert g.guard.base == ref.base
    ref.start(None)
    assert g.guard.base != ref.base  # (the bundle's policy scores otherwise here)
    guarded_setup(bundle, proto, crops, images, agent, synthetic=16, generator_seed=2, choice=True)
    assert same(choices[0]["probes"], synthetic_probes(bundle, proto, crops, images, agent, 8, gen(2, 2)))
