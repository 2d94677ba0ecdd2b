"""Reward repair: the head learns on probes, the backbone does not move, and the change is kept only when held-out
probes confirm it (the checkpoint file that carries a repaired head: ``test_bundle_format.py``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from models.bundle import Reward, Start, load_bundle
from models.core.boxes import paired_iou
from models.data.types import exemplar_crops
from models.experiments.datasets import GlyphKind
from models.guard import synthetic_probes
from models.inference import Localizer
from models.repair import RepairConfig, faithfulness, guarded_setup, refines, repair_reward

BUNDLE = Path(__file__).resolve().parents[2] / "bundles" / "mnist-digit4.pt"


@pytest.fixture(scope="module")
def bundle():
    return load_bundle(BUNDLE, "cpu")


@pytest.fixture(scope="module")
def glyph_job(bundle):
    """A kind of object the digit bundle never saw: 5 exemplars of the glyph 'K', 48 unlabeled images, and
    200 test images with their true boxes (for the check only: repair never sees them)."""
    kind = GlyphKind("K", "patch")
    ex = kind.draw(bundle, "exemplars", 5, 0)
    unl = kind.draw(bundle, "unlabeled", 48, 0, after=5)
    test = kind.draw(bundle, "test", 60, 0)
    return exemplar_crops(ex), unl, test


def _probes(bundle, crops, unl, n, seed):
    proto = Localizer(bundle, "cpu").prototype(crops)
    return synthetic_probes(bundle, proto, crops, unl.images, None, n, torch.Generator().manual_seed(seed))


def test_repair_trains_the_head_only_and_orders_boxes_of_a_new_kind_better(bundle, glyph_job):
    crops, unl, test = glyph_job
    encoder = {k: v.clone() for k, v in bundle.embedder.encoder.state_dict().items()}
    head = {k: v.clone() for k, v in bundle.embedder.head.state_dict().items()}
    rep = repair_reward(bundle, crops, _probes(bundle, crops, unl, 96, 1), _probes(bundle, crops, unl, 48, 2),
                        RepairConfig(epochs=12, seed=0))
    assert rep.kept, rep.record
    assert rep.record["after"]["ordacc"] > rep.record["before"]["ordacc"] + 5
    assert rep.bundle is not bundle
    assert rep.bundle.refine and not bundle.refine  # a grayscale bundle's kept repair refines its answers
    for k, v in rep.bundle.embedder.encoder.state_dict().items():  # the backbone never moves
        assert torch.equal(v, encoder[k]), k
    assert any(not torch.equal(v, head[k]) for k, v in rep.head.items())  # the head did
    for k, v in bundle.embedder.head.state_dict().items():  # and the input bundle is left as it was
        assert torch.equal(v, head[k]), k
    assert torch.allclose(rep.prototype, Localizer(rep.bundle, "cpu").prototype(crops))
    # On the test images (true boxes, never seen by repair) the repaired distance orders boxes better too.
    before = faithfulness(bundle, Localizer(bundle, "cpu").prototype(crops), test)
    after = faithfulness(rep.bundle, rep.prototype, test)
    assert after["ordacc"] > before["ordacc"] + 5 and after["spearman"] < before["spearman"]


def test_only_grayscale_bundles_refine_after_a_kept_repair(bundle):
    photo = load_bundle(BUNDLE.parent / "photo-mammals.pt", "cpu")
    assert refines(bundle) and not refines(photo)  # photos: refined probes flattered worse checkpoints (REFINE_RGB)


def test_repair_not_confirmed_on_held_out_probes_keeps_the_bundle_as_it_is(bundle, glyph_job):
    crops, unl, _ = glyph_job
    rep = repair_reward(bundle, crops, _probes(bundle, crops, unl, 32, 1), _probes(bundle, crops, unl, 16, 2),
                        RepairConfig(epochs=2, min_gain=1000.0))
    assert not rep.kept and rep.head is None and rep.bundle is bundle
    assert torch.allclose(rep.prototype, Localizer(bundle, "cpu").prototype(crops))


def test_guarded_setup_is_repeatable_so_a_resumed_job_rebuilds_the_same_reward(bundle, glyph_job):
    crops, unl, _ = glyph_job
    proto = Localizer(bundle, "cpu").prototype(crops)
    runs = [guarded_setup(bundle, proto, crops, unl.images[:24], None, synthetic=24, generator_seed=3,
                          repair=RepairConfig(epochs=3, min_gain=-100.0)) for _ in range(2)]
    a, b = runs
    assert a.reward == b.reward == "repaired head"
    assert torch.equal(a.guard.probes.images, b.guard.probes.images)
    assert torch.equal(a.guard.probes.boxes, b.guard.probes.boxes)
    assert all(torch.equal(v, b.repair.head[k]) for k, v in a.repair.head.items())
    assert a.guard.base == b.guard.base and a.record["repair"]["after"] == b.record["repair"]["after"]
    # the guard reports the faithfulness of the reward the job adapts on, the repaired one
    assert a.guard.faithfulness == faithfulness(a.bundle, a.prototype, a.guard.probes)


def test_a_start_to_pair_with_is_kept_only_with_the_repair_and_the_guard_then_scores_paired(bundle, glyph_job):
    """``guarded_setup(start=...)``: where the repair is kept, ``Guarded.start`` is that start and the guard scores
    each checkpoint as localize serves it paired (``Localizer.with_reward``); without a kept repair, no start."""
    crops, unl, _ = glyph_job
    proto = Localizer(bundle, "cpu").prototype(crops)
    start = Start(proto)
    kw = dict(synthetic=24, generator_seed=3)
    kept = guarded_setup(bundle, proto, crops, unl.images[:24], None, **kw, start=start,
                         repair=RepairConfig(epochs=3, min_gain=-100.0))
    assert kept.reward == "repaired head" and kept.start is start
    served = Localizer(bundle, "cpu").with_reward(Reward(kept.repair.head, kept.prototype, kept.bundle.refine, start))
    c = kept.guard.loc.companion
    assert c is not None and c.agree and torch.equal(c.prototype, proto)
    agent = served.agent(bundle.agent_state)
    want = served.run_features(kept.guard.feats, kept.prototype, agent).boxes[-1]
    got = kept.guard.loc.run_features(kept.guard.feats, kept.prototype, kept.guard.loc.agent(bundle.agent_state))
    assert torch.equal(got.boxes[-1], want)
    alone = guarded_setup(bundle, proto, crops, unl.images[:24], None, **kw, repair=RepairConfig(epochs=3,
                                                                                                  min_gain=-100.0))
    assert alone.start is None and alone.guard.loc.companion is None
    refused = guarded_setup(bundle, proto, crops, unl.images[:24], None, **kw, start=start,
                            repair=RepairConfig(epochs=3, min_gain=100.0))  # never kept
    assert refused.reward == "bundle head" and refused.start is None and refused.guard.loc.companion is None


def test_too_few_probes_for_repair_are_refused_and_a_job_then_keeps_the_bundle_head(bundle, glyph_job):
    crops, unl, _ = glyph_job
    few = _probes(bundle, crops, unl, 8, 1)
    with pytest.raises(ValueError, match="at least 16 training probes"):
        repair_reward(bundle, crops, few, few)
    proto = Localizer(bundle, "cpu").prototype(crops)
    setup = guarded_setup(bundle, proto, crops, unl.images[:8], None, synthetic=8, generator_seed=0,
                          repair=RepairConfig(epochs=2))
    assert setup.repair is None and setup.reward == "bundle head" and setup.bundle is bundle
    at_least = guarded_setup(bundle, proto, crops, unl.images[:16], None, synthetic=16, generator_seed=0,
                             repair=RepairConfig(epochs=1))  # exactly MIN_TRAIN_PROBES: repair is tried
    assert at_least.repair is not None and at_least.repair.record["epochs"] == 1


def test_with_a_consensus_start_the_guard_scores_each_checkpoint_with_the_ones_before_it_voting(bundle, glyph_job):
    """A format-5 start (``Start.consensus``): the guard scores checkpoint k as its file will serve it, in the
    consensus of the start, the checkpoints observed before k and k itself (``Localizer.with_reward``)."""
    crops, unl, _ = glyph_job
    proto = Localizer(bundle, "cpu").prototype(crops)
    start = Start(proto, consensus=())
    setup = guarded_setup(bundle, proto, crops, unl.images[:24], None, synthetic=24, generator_seed=3, start=start,
                          repair=RepairConfig(epochs=3, min_gain=-100.0))
    assert setup.reward == "repaired head" and setup.guard.loc.companion.members == ()
    g = torch.Generator().manual_seed(0)
    states = [{k: v + 0.3 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
               for k, v in bundle.agent_state.items()} for _ in range(3)]
    base = Localizer(bundle, "cpu")
    for i, state in enumerate(states):
        rec = setup.guard.observe(25 * (i + 1), state)
        served = base.with_reward(Reward(setup.repair.head, setup.prototype, setup.bundle.refine,
                                         replace(start, consensus=tuple(states[:i]))))
        assert len(setup.guard.loc.companion.members) == i
        boxes = served.run_features(setup.guard.feats, setup.prototype, served.agent(state)).boxes[-1]
        hits = paired_iou(boxes, setup.guard.probes.boxes) >= 0.5
        assert rec["select"]["corloc"] == round(float(hits[setup.guard.select].float().mean() * 100), 2)
        assert rec["held"]["corloc"] == round(float(hits[setup.guard.held].float().mean() * 100), 2)


@pytest.mark.parametrize(("channels", "style", "paired"), [(1, "rect", False), (3, "soft", True)])
def test_the_photos_settings_choose_by_the_bundles_input(channels, style, paired):
    """``QLOC_PROBE_STYLE=photos`` and ``QLOC_PAIR_START=photos`` (the latter's default): soft-edged probes and a
    paired start for RGB bundles only; any other value is the same for every bundle."""
    from types import SimpleNamespace

    from models.repair import pairs_start, probe_style

    b = SimpleNamespace(config=SimpleNamespace(input=SimpleNamespace(channels=channels)))
    assert probe_style("photos", b) == style and pairs_start("photos", b) is paired
    assert probe_style("rect", b) == "rect" and probe_style("soft", b) == "soft"
    assert pairs_start("always", b) is True and pairs_start("never", b) is False


@pytest.mark.parametrize(("n_train", "batch_size", "batches"), [(40, 32, 1), (16, 32, 1), (20, 8, 2)])
def test_repair_trains_on_full_batches_of_at_most_its_batch_size(bundle, glyph_job, n_train, batch_size, batches):
    """One batch of ``min(batch_size, probes)`` per full batch, the remainder dropped (the shuffled-group anchor needs
    two groups in a batch): ``should_stop`` is asked before every batch."""
    crops, unl, _ = glyph_job
    asked = []
    repair_reward(bundle, crops, _probes(bundle, crops, unl, n_train, 1), _probes(bundle, crops, unl, 8, 2),
                  RepairConfig(epochs=2, batch_size=batch_size), should_stop=lambda: asked.append(1) and False)
    assert len(asked) == 2 * batches


def test_repair_decides_on_two_validation_probes_and_refuses_one(bundle, glyph_job):
    crops, unl, _ = glyph_job
    train, val = _probes(bundle, crops, unl, 16, 1), _probes(bundle, crops, unl, 2, 2)
    assert repair_reward(bundle, crops, train, val, RepairConfig(epochs=1)).record["val_probes"] == 2
    with pytest.raises(ValueError, match="and 2 validation probes, got 16 and 1"):
        repair_reward(bundle, crops, train, _probes(bundle, crops, unl, 1, 2))


def test_repair_scores_before_and_after_on_its_seed(bundle, glyph_job):
    crops, unl, _ = glyph_job
    train, val = _probes(bundle, crops, unl, 16, 1), _probes(bundle, crops, unl, 24, 2)
    proto = Localizer(bundle, "cpu").prototype(crops)
    seeds = {s: faithfulness(bundle, proto, val, s) for s in (0, 3)}
    assert seeds[0] != seeds[3]  # the seed draws the box pairs OrdAcc is measured on
    rep = repair_reward(bundle, crops, train, val, RepairConfig(epochs=1, min_gain=-1000.0, seed=3))
    assert rep.kept and rep.record["before"] == seeds[3]
    assert rep.record["after"] == faithfulness(rep.bundle, rep.prototype, val, 3) != seeds[3]


@pytest.mark.parametrize(("batch_size", "group_size"), [(16, 5), (7, 3)])
def test_repair_trains_the_head_with_its_config_and_the_shuffled_exemplar_anchor(bundle, glyph_job, monkeypatch,
                                                                                 batch_size, group_size):
    """What repair asks of stage 1's trainer: the ordinal triplet around shuffled groups of the *exemplars'* crops
    (the client's objects, not the probes' own boxes), no reconstruction, the head alone, its epochs, learning rate
    and seed, evaluated about six times, groups of 5 or half a batch (two groups in each); and a learning rate of 0
    leaves the head as it was."""
    import models.repair as repair_mod

    crops, unl, _ = glyph_job
    seen = []
    real = repair_mod.train_embedding

    def spy(trained, train, val, cfg, **kw):
        seen.append((trained, cfg))
        return real(trained, train, val, cfg, **kw)

    monkeypatch.setattr(repair_mod, "train_embedding", spy)
    head = {k: v.clone() for k, v in bundle.embedder.head.state_dict().items()}
    repair_reward(bundle, crops, _probes(bundle, crops, unl, 16, 1), _probes(bundle, crops, unl, 8, 2),
                  RepairConfig(epochs=12, lr=0.0, batch_size=batch_size, seed=5))
    ((trained, cfg),) = seen
    assert trained is not bundle  # a copy is trained
    assert (cfg.epochs, cfg.batch_size, cfg.drop_last, cfg.lr, cfg.seed) == (12, batch_size, True, 0.0, 5)
    assert (cfg.anchor, cfg.group_size, cfg.recon_weight, cfg.head_only, cfg.eval_every) == (
        "shuffle_exemplar", group_size, 0.0, True, 2)
    for k, v in trained.embedder.head.state_dict().items():  # 12 epochs at a learning rate of 0
        assert torch.equal(v, head[k]), k
