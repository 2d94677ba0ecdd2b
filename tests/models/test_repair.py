"""Reward repair: the head learns on probes, the backbone does not move, the change is kept only when held-out
probes confirm it, and a checkpoint carries the repaired head and prototype (format 2) while format 1 still loads."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from models.bundle import (
    PolicyMismatch,
    Reward,
    Start,
    checkpoint_from_bytes,
    head_from_bytes,
    head_to_bytes,
    load_bundle,
    policy_from_bytes,
    policy_to_bytes,
)
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


def test_a_checkpoint_carries_its_repaired_head_and_prototype_and_old_ones_still_load(bundle):
    agent = bundle.agent_state
    old = policy_to_bytes(agent, bundle_name=bundle.name, bundle_sha256=bundle.sha256,
                          prototype_dim=bundle.prototype_dim)
    assert torch.load(io.BytesIO(old), weights_only=True)["format_version"] == 1  # unchanged without a reward
    state, meta, reward = checkpoint_from_bytes(old, bundle)
    assert reward is None and meta == {} and all(torch.equal(v, agent[k]) for k, v in state.items())

    head = {k: v + 1 for k, v in bundle.embedder.head.state_dict().items()}
    proto = torch.arange(bundle.prototype_dim, dtype=torch.float32)
    new = policy_to_bytes(agent, bundle_name=bundle.name, bundle_sha256=bundle.sha256,
                          prototype_dim=bundle.prototype_dim, reward=Reward(head, proto))
    state, _, reward = checkpoint_from_bytes(new, bundle)
    assert torch.equal(reward.prototype, proto) and all(torch.equal(v, head[k]) for k, v in reward.head.items())
    assert policy_from_bytes(new, bundle)[0].keys() == agent.keys()  # the agent-only reader still works

    served = bundle.with_head(reward.head)
    assert served.embedder.encoder is bundle.embedder.encoder  # shared, not copied
    assert all(torch.equal(v, head[k]) for k, v in served.embedder.head.state_dict().items())
    assert not torch.equal(next(iter(bundle.embedder.head.state_dict().values())), next(iter(head.values())))

    obj = torch.load(io.BytesIO(new), weights_only=True)
    assert obj["format_version"] == 2 and "refine" not in obj["reward"]  # a format-2 reward serves unrefined
    assert reward.refine is False and served.refine is False and bundle.refine is False

    refined = policy_to_bytes(agent, bundle_name=bundle.name, bundle_sha256=bundle.sha256,
                              prototype_dim=bundle.prototype_dim, reward=Reward(head, proto, refine=True))
    obj3 = torch.load(io.BytesIO(refined), weights_only=True)
    assert obj3["format_version"] == 3 and obj3["reward"]["refine"] is True
    _, _, reward3 = checkpoint_from_bytes(refined, bundle)
    assert reward3.refine is True and bundle.with_head(reward3.head, reward3.refine).refine is True

    # format 4: the start it is paired with (the bundle's agent and head: only the prototype is written)
    start = Start(proto.flip(0))
    paired = policy_to_bytes(agent, bundle_name=bundle.name, bundle_sha256=bundle.sha256,
                             prototype_dim=bundle.prototype_dim, reward=Reward(head, proto, start=start))
    obj4 = torch.load(io.BytesIO(paired), weights_only=True)
    assert obj4["format_version"] == 4 and set(obj4["reward"]["start"]) == {"prototype"}
    st = checkpoint_from_bytes(paired, bundle)[2].start
    assert torch.equal(st.prototype, start.prototype) and st.agent is None and st.head is None and not st.refine
    own = Start(proto, agent={k: v + 2 for k, v in agent.items()}, head=head, refine=True)
    st = checkpoint_from_bytes(policy_to_bytes(agent, bundle_name=bundle.name, reward=Reward(head, proto,
                                                                                          start=own)), bundle)[2].start
    assert st.refine and all(torch.equal(v, own.agent[k]) for k, v in st.agent.items())
    assert all(torch.equal(v, head[k]) for k, v in st.head.items())
    short = Reward(head, proto, start=Start(proto[:-1]))  # a start of another prototype dimension is refused
    with pytest.raises(PolicyMismatch, match="dimension"):
        checkpoint_from_bytes(policy_to_bytes(agent, bundle_name=bundle.name, reward=short), bundle)

    # format 5: the start votes with the job's earlier checkpoints (the consensus rule), an empty tuple included
    earlier = ({k: v + 3 for k, v in agent.items()}, {k: v + 4 for k, v in agent.items()})
    for voters in ((), earlier):
        voted = policy_to_bytes(agent, bundle_name=bundle.name, reward=Reward(head, proto, start=replace(
            start, consensus=voters)))
        obj5 = torch.load(io.BytesIO(voted), weights_only=True)
        assert obj5["format_version"] == 5 and len(obj5["reward"]["start"]["consensus"]) == len(voters)
        st = checkpoint_from_bytes(voted, bundle)[2].start
        assert st.consensus is not None and len(st.consensus) == len(voters)
        assert all(torch.equal(a[k], b[k]) for a, b in zip(st.consensus, voters, strict=True) for k in agent)
    assert checkpoint_from_bytes(paired, bundle)[2].start.consensus is None  # format 4: the two heads' agreement

    # format 6: the heads (the reward's, the start's) stored apart, the file holding what store_head returned
    heads: dict[str, bytes] = {}

    def store(h):
        data = head_to_bytes(h)
        heads[str(len(heads))] = data
        return {"id": str(len(heads) - 1)}

    def load(ref):
        return head_from_bytes(heads[ref["id"]])

    apart = policy_to_bytes(agent, bundle_name=bundle.name, reward=Reward(head, proto, refine=True, start=own),
                            store_head=store)
    obj6 = torch.load(io.BytesIO(apart), weights_only=True)
    assert obj6["format_version"] == 6 and obj6["reward"]["head_ref"] == {"id": "0"} and "head" not in obj6["reward"]
    assert obj6["reward"]["start"]["head_ref"] == {"id": "1"} and len(heads) == 2
    assert len(apart) < len(refined) / 2  # the head was most of the file
    _, _, reward6 = checkpoint_from_bytes(apart, bundle, load_head=load)
    assert reward6.refine and all(torch.equal(v, head[k]) for k, v in reward6.head.items())
    assert all(torch.equal(v, head[k]) for k, v in reward6.start.head.items())
    assert policy_from_bytes(apart, bundle)[0].keys() == agent.keys()  # the agent alone needs no head
    with pytest.raises(ValueError, match="keeps its reward's head apart"):
        checkpoint_from_bytes(apart, bundle)  # no head reader

    obj3["format_version"] = 7
    buf = io.BytesIO()
    torch.save(obj3, buf)
    with pytest.raises(ValueError, match="format 7"):
        checkpoint_from_bytes(buf.getvalue(), bundle)


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
