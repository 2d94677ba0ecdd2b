"""Stage 1 (the ordinal embedding) and stage 2 (the agent) on a few images and epochs: which weights they keep,
what they train and leave alone, how they batch, evaluate and stop. The learning checks on a real budget are in
test_learning.py (marked slow); these are fast enough to run against every mutant of the trainers."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from model_stand_ins import LeftEdgeScorer

import models.train.agent as stage2
import models.train.embedding as stage1
from models.bundle import load_bundle
from models.core.ordinal import kind_margin_loss
from models.data.types import LabeledImages
from models.evaluate import evaluate_corloc, evaluate_ordacc, ranking_metrics, training_candidates
from models.experiments.cmnist import cmnist
from models.features import crop_embeddings, features_of, prototypes_for, with_features
from models.nets.embedding import ProjectionHead
from models.policy import policy_step
from models.train.agent import AgentTrainConfig, train_agent
from models.train.embedding import EmbeddingTrainConfig, Interrupted, train_embedding

BUNDLE = Path(__file__).resolve().parents[2] / "bundles" / "mnist-digit4.pt"


@pytest.fixture(scope="module")
def shipped():
    return load_bundle(BUNDLE, "cpu")


@pytest.fixture
def bundle(shipped):
    return copy.deepcopy(shipped)


@pytest.fixture(scope="module")
def data():
    return {"train": cmnist(4, "train", 12, "patch", 0), "val": cmnist(4, "val", 30, "patch", 0),
            "val_ex": cmnist(4, "val", 5, "patch", 1, offset=100)}


def _state(of: torch.nn.Module | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of a module's state dict, or of a state dict."""
    sd = of.state_dict() if isinstance(of, torch.nn.Module) else of
    return {k: v.detach().clone() for k, v in sd.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _spy(monkeypatch, module, name: str) -> list[tuple[tuple, object]]:  # noqa: ANN001
    """Wraps ``module.name`` so that every call's positional arguments and result are recorded -> the record."""
    calls, real = [], getattr(module, name)

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append((args, out := real(*args, **kwargs)))
        return out

    monkeypatch.setattr(module, name, spy)
    return calls


def _stage1(**kw) -> EmbeddingTrainConfig:
    return EmbeddingTrainConfig(**{"epochs": 1, "batch_size": 12, "recon_weight": 0.0, "head_only": True,
                                   "eval_every": 1, **kw})


# ---------------------------------------------------------------------------------------------------- stage 1


def test_stage1_refuses_an_unknown_anchor_and_reconstruction_on_cached_features(bundle, data):
    with pytest.raises(ValueError, match=r"anchor must be one of .*'centre'"):
        train_embedding(bundle, data["train"], data["val"], _stage1(anchor="centre"))
    cached = with_features(bundle, data["train"])
    with pytest.raises(ValueError, match="reconstruction loss trains the backbone"):
        train_embedding(bundle, cached, data["val"], _stage1(recon_weight=1.0))
    train_embedding(bundle, cached, data["val"], _stage1())  # cached features without reconstruction: fine


class _Scripted:
    """Stands in for stage 1's validation: the scores it is told to give, in turn."""

    def __init__(self, scores: list[float]):
        self.scores = list(scores)

    def __call__(self, *args, **kwargs) -> float:
        return self.scores.pop(0)


def test_stage1_restores_its_best_validation_epoch_and_evaluates_on_schedule(bundle, data, monkeypatch):
    built = _spy(monkeypatch, stage1, "build_decoder")  # the decoder stage 1 trains, held for the test to read
    monkeypatch.setattr(stage1, "evaluate_ordacc", _Scripted([70.0, 90.0, 90.0, 60.0]))
    snapshots = {}

    def on_log(rec: dict) -> None:  # called after each evaluation, with the weights it evaluated
        snapshots[rec["epoch"]] = (_state(bundle.embedder), _state(built[0][1]))

    cfg = _stage1(epochs=7, eval_every=2, recon_weight=1.0, head_only=False)
    s = train_embedding(bundle, data["train"], data["val"], cfg, on_log=on_log)
    assert [r["epoch"] for r in s["history"]] == [2, 4, 6, 7]  # every eval_every epochs, and the last
    assert [r["val/ordacc"] for r in s["history"]] == [70.0, 90.0, 90.0, 60.0]
    assert s["val/ordacc"] == 90.0 and s["best_epoch"] == 4  # the first of equally good ones
    assert _same(_state(bundle.embedder), snapshots[4][0]) and not _same(snapshots[4][0], snapshots[7][0])
    assert _same(bundle.training["decoder"], snapshots[4][1])  # the decoder of the same epoch, not the last one
    assert not _same(snapshots[4][1], _state(built[0][1]))
    assert all(set(r) == {"epoch", "losses/triplet", "losses/recon", "val/ordacc"} for r in s["history"])
    assert all(isinstance(r["losses/recon"], float) and r["losses/recon"] > 0 for r in s["history"])
    assert not bundle.embedder.training
    assert not any(p.requires_grad for p in bundle.embedder.parameters())


def test_stage1_scores_and_samples_on_the_candidates_it_is_given(bundle, data, monkeypatch):
    few = training_candidates(bundle)[::7]
    pairs = _spy(monkeypatch, stage1, "sample_pairs")
    cfg = _stage1(lr=0.0, seed=2)
    s = train_embedding(bundle, data["train"], data["val"], cfg, candidates=few)
    assert pairs and all(args[1] is few for args, _ in pairs)
    assert s["val/ordacc"] == pytest.approx(evaluate_ordacc(bundle, data["val"], seed=2, candidates=few))
    assert s["val/ordacc"] != pytest.approx(evaluate_ordacc(bundle, data["val"], seed=2))


def test_stage1_selects_by_the_val_exemplars_prototype_when_given(bundle, data):
    cfg = _stage1(epochs=2, lr=0.03, seed=1)
    s = train_embedding(bundle, data["train"], data["val"], cfg, val_exemplars=data["val_ex"])
    assert all("val/spearman" in r for r in s["history"])
    with torch.no_grad():
        m = ranking_metrics(bundle, data["val"], prototypes_for(bundle, data["val_ex"], data["val"]), seed=cfg.seed,
                            candidates=training_candidates(bundle))
    assert m["ordacc"] == pytest.approx(s["val/ordacc"])
    assert s["history"][s["best_epoch"] - 1]["val/spearman"] == pytest.approx(m["spearman"])


def test_stage1_head_only_trains_the_head_and_leaves_the_encoder(bundle, data):
    enc, head = _state(bundle.embedder.encoder), _state(bundle.embedder.head)
    train_embedding(bundle, data["train"], data["val"], _stage1(epochs=2))
    assert _same(_state(bundle.embedder.encoder), enc)
    assert not _same(_state(bundle.embedder.head), head)


def test_stage1_trains_the_encoder_unless_told_not_to(bundle, data):
    enc = _state(bundle.embedder.encoder)
    train_embedding(bundle, data["train"], data["val"], _stage1(epochs=2, head_only=False))
    assert not _same(_state(bundle.embedder.encoder), enc)


def test_stage1_weighs_the_triplet_loss(bundle, data):
    head = _state(bundle.embedder.head)
    s = train_embedding(bundle, data["train"], data["val"], _stage1(epochs=2, triplet_weight=0.0))
    assert _same(_state(bundle.embedder.head), head)  # no loss, no gradient: Adam does not move
    assert s["history"][-1]["losses/triplet"] > 0  # the term is computed all the same


def test_stage1_reconstruction_trains_a_decoder_kept_in_the_bundle(bundle, data):
    assert "decoder" in bundle.training  # the shipped cMNIST bundle carries stage 1's decoder
    before = _state(bundle.training["decoder"])
    s = train_embedding(bundle, data["train"], data["val"], _stage1(recon_weight=1.0, head_only=False, lr=0.0))
    assert all("losses/recon" in r for r in s["history"])
    # lr 0: nothing moves, so what is kept is the decoder it was given, loaded, not a fresh one
    assert _same(bundle.training["decoder"], before)
    train_embedding(bundle, data["train"], data["val"], _stage1(recon_weight=1.0, head_only=False, lr=1e-3))
    assert not _same(bundle.training["decoder"], before)


@pytest.mark.parametrize(("n", "drop_last", "sizes"), [(12, False, [5, 5, 2]), (12, True, [5, 5]), (10, True, [5, 5]),
                                                       (9, True, [5]), (9, False, [5, 4])])
def test_stage1_batches_each_image_once_per_epoch_and_asks_before_every_batch(bundle, data, monkeypatch, n,
                                                                                drop_last, sizes):
    train = cmnist(4, "train", n, "patch", 0)
    pairs = _spy(monkeypatch, stage1, "sample_pairs")
    asked = []

    def never() -> bool:
        asked.append(len(pairs))
        return False

    cfg = _stage1(epochs=2, batch_size=5, drop_last=drop_last, anchor="proto")  # small batches need no groups
    train_embedding(bundle, train, data["val"], cfg, should_stop=never)
    batches = [args[0] for args, _ in pairs]  # each batch's ground-truth boxes
    assert [len(b) for b in batches] == sizes * 2
    assert asked == list(range(2 * len(sizes)))  # before each batch, not after
    all_rows = {tuple(r) for r in train.boxes.tolist()}
    for epoch in range(2):
        rows = [tuple(r) for b in batches[epoch * len(sizes):(epoch + 1) * len(sizes)] for r in b.tolist()]
        assert len(rows) == len(set(rows)) and set(rows) <= all_rows  # no image twice in an epoch
        if not drop_last:
            assert set(rows) == all_rows
    calls = []

    def at_epoch_2() -> bool:
        calls.append(1)
        return len(calls) == len(sizes) + 1  # the first batch of epoch 2

    cfg.epochs = 3
    with pytest.raises(Interrupted, match="stopped at epoch 2 of 3"):
        train_embedding(bundle, train, data["val"], cfg, should_stop=at_epoch_2)


@pytest.mark.parametrize(("drop_last", "sizes"), [(True, [3, 3, 3]), (False, [1, 2, 3, 3, 3])])
def test_stage1_batches_of_several_kinds_hold_one_kind_and_follow_drop_last(bundle, monkeypatch, drop_last, sizes):
    train = LabeledImages.concat([cmnist(4, "train", 7, "patch", 2), cmnist(7, "train", 5, "patch", 2)])
    pairs = _spy(monkeypatch, stage1, "sample_pairs")
    train_embedding(bundle, train, train, _stage1(batch_size=3, drop_last=drop_last, anchor="proto"))
    batches = [args[0] for args, _ in pairs]  # each batch's ground-truth boxes
    assert sorted(len(b) for b in batches) == sizes  # 7 -> 3 + 3 (+ 1), 5 -> 3 (+ 2)
    kind_of = {tuple(r): int(k) for r, k in zip(train.boxes.tolist(), train.classes, strict=True)}
    assert all(len({kind_of[tuple(r)] for r in b.tolist()}) == 1 for b in batches)


def test_stage1_trains_through_the_exemplar_anchor(bundle, data, monkeypatch):
    """``shuffle_exemplar`` anchors are crop embeddings with their gradient: a loss of the anchor alone trains."""
    monkeypatch.setattr(stage1, "triplet_loss", lambda anchor, pos, neg, margin: anchor.norm(dim=-1).mean())
    head = _state(bundle.embedder.head)
    train_embedding(bundle, data["train"], data["val"], _stage1(anchor="shuffle_exemplar"))
    assert not _same(_state(bundle.embedder.head), head)


def test_stage1_cross_kind_term_only_with_a_weight_and_several_kinds(bundle, monkeypatch):
    others = _spy(monkeypatch, stage1, "_other_kind_prototype")
    two = LabeledImages.concat([cmnist(4, "train", 10, "patch", 2), cmnist(7, "train", 10, "patch", 2)])
    one = cmnist(4, "train", 20, "patch", 2)
    one_labeled = LabeledImages.concat([one])  # one kind, labeled as such
    assert one_labeled.classes is not None and one_labeled.classes.unique().tolist() == [0]
    for data_, weight in ((two, 0.0), (one, 5.0), (one_labeled, 5.0)):
        train_embedding(bundle, data_, data_, _stage1(batch_size=10, class_weight=weight, anchor="shuffle_exemplar"))
    assert others == []
    train_embedding(bundle, two, two, _stage1(batch_size=10, class_weight=0.5, group_size=4,
                                             anchor="shuffle_exemplar"))
    assert [args[3] for args, _ in others] == [4, 4]  # once per batch, with the configured group
    assert all(out.requires_grad for _, out in others)  # the other kind's prototype is trained through too


def test_stage1_anchors_and_the_cross_kind_term_read_the_ground_truth_boxes(bundle, monkeypatch):
    """Each image's row 0 is its ground-truth box: the ``self`` anchor and the cross-kind term's embedding are it."""
    trip, kind = _spy(monkeypatch, stage1, "triplet_loss"), _spy(monkeypatch, stage1, "kind_margin_loss")
    two = LabeledImages.concat([cmnist(4, "train", 10, "patch", 2), cmnist(7, "train", 10, "patch", 2)])
    train_embedding(bundle, two, two, _stage1(batch_size=10, class_weight=1.0, anchor="self", eval_every=5, epochs=1))
    (anchor, pos, _, _), _ = trip[-1]
    (emb, own, _, _), _ = kind[-1]
    assert torch.equal(emb, own) and torch.equal(anchor, emb)
    assert not torch.equal(anchor, pos[:, 0])


def test_stage1_cross_kind_term_pulls_each_kind_to_its_own(bundle):
    """Trained on the cross-kind term alone, the ground-truth boxes move nearer their own kind's prototype than the
    other's (measured: the hinge at margin 60 falls from 27.9 to 12.8; the term's sign flipped raises it to 52)."""
    two = LabeledImages.concat([cmnist(4, "train", 10, "patch", 2), cmnist(7, "train", 10, "patch", 2)])

    def hinge() -> float:
        with torch.no_grad():
            bundle.embedder.eval()
            crops = crop_embeddings(bundle, two)
            protos = torch.stack([crops[:10].mean(0), crops[10:].mean(0)])
            emb = bundle.embedder.embed(features_of(bundle, two.images), two.boxes[:, None])[:, 0]
            return (float(kind_margin_loss(emb[:10], protos[0].expand(10, -1), protos[1], 60.0))
                    + float(kind_margin_loss(emb[10:], protos[1].expand(10, -1), protos[0], 60.0))) / 2

    before = hinge()
    train_embedding(bundle, two, two, _stage1(epochs=4, batch_size=10, class_weight=1.0, triplet_weight=0.0,
                                              anchor="shuffle_exemplar", eval_every=4))
    after = hinge()
    assert after < 0.75 * before, (before, after)


def test_stage1_reconstruction_loss_falls(bundle, data):
    """The decoder's term is minimized (triplet off): a new decoder's loss falls over a few epochs."""
    del bundle.training["decoder"]
    s = train_embedding(bundle, data["train"], data["val"], _stage1(epochs=4, recon_weight=1.0, head_only=False,
                                                                    triplet_weight=0.0, lr=3e-3))
    recon = [r["losses/recon"] for r in s["history"]]
    assert recon == sorted(recon, reverse=True) and recon[-1] < 0.6 * recon[0], recon  # measured 0.197 -> 0.076


def test_stage1_is_seeded(shipped, data):
    def head_after(seed: int) -> dict[str, torch.Tensor]:
        b = copy.deepcopy(shipped)
        train_embedding(b, data["train"], data["val"], _stage1(epochs=2, seed=seed, anchor="shuffle_exemplar"))
        return _state(b.embedder.head)

    assert _same(head_after(0), head_after(0))
    assert not _same(head_after(0), head_after(1))


def test_stage1_teaches_a_fresh_head_to_order_boxes(bundle):
    """A learning check in seconds: the shipped encoder, a new random head, a few epochs of the triplet loss alone."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        bundle.embedder.head = ProjectionHead(bundle.config.head)
    train, val = cmnist(4, "train", 30, "patch", 5), cmnist(4, "val", 60, "patch", 5)
    before = evaluate_ordacc(bundle, val)
    s = train_embedding(bundle, train, val, _stage1(epochs=2, batch_size=15, eval_every=2, triplet_weight=1.0))
    after = evaluate_ordacc(bundle, val)
    assert after >= 93.0 and after >= before + 8, (before, after, s)  # measured: 84.5 -> 97.0


# ---------------------------------------------------------------------------------------------------- stage 2


def _stage2(**kw) -> AgentTrainConfig:
    return AgentTrainConfig(**{"iterations": 3, "eval_every": 1, **kw})


def test_stage2_keeps_its_best_validation_iteration(bundle, data, monkeypatch):
    scores, snapshots = [50.0, 80.0, 80.0, 40.0], {}

    def scripted(bundle_, agent, val, proto):  # noqa: ANN001, ANN202 -- stands in for validation CorLoc
        snapshots[len(snapshots)] = _state(agent)
        return scores[len(snapshots) - 1], None

    monkeypatch.setattr(stage2, "evaluate_corloc", scripted)
    steps = _spy(monkeypatch, stage2, "policy_step")
    logged = []
    cfg = _stage2(iterations=7, eval_every=2, lr=0.02, seed=2)
    s = train_agent(bundle, data["train"], data["val"], data["val_ex"], cfg, on_log=logged.append)
    assert len(steps) == 7  # one step per iteration, from the first to the last
    its = [r["iteration"] for r in s["history"]]
    assert its == [2, 4, 6, 7]  # every eval_every iterations, and the last
    assert logged == s["history"] and [r["val/corloc"] for r in logged] == scores
    assert s["val/corloc"] == 80.0 and s["best_iteration"] == 4  # the first of equally good ones
    assert _same(bundle.agent_state, snapshots[1]) and not _same(snapshots[1], snapshots[3])
    assert all(v.device.type == "cpu" and not v.requires_grad for v in bundle.agent_state.values())
    assert {"losses/policy", "losses/entropy", "charts/return", "val/corloc"} <= set(s["history"][0])


def test_stage2_validates_with_the_val_exemplars_prototype(bundle, data):
    s = train_agent(bundle, data["train"], data["val"], data["val_ex"], _stage2(iterations=2, lr=0.02, seed=2))
    with torch.no_grad():
        proto = prototypes_for(bundle, data["val_ex"], data["val"])
        corloc, _ = evaluate_corloc(bundle, bundle.new_agent(), data["val"], proto)
    assert corloc == pytest.approx(s["val/corloc"])  # the kept policy is the one that scored it, so measured


class _Recorder:
    """Stands in for ``policy_step``: records what each iteration is given (the agent is left untrained)."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, bundle, agent, opt, feats, protos, cfg, gen, gt=None):  # noqa: ANN001
        self.calls.append({"feats": feats, "protos": protos, "gt": gt, "lr": opt.param_groups[0]["lr"]})
        return {}


def _rows(feats: torch.Tensor, of: torch.Tensor) -> list[int]:
    """The row of ``of`` each of ``feats`` is."""
    return [int(((of - f).flatten(1).abs().amax(1) < 1e-5).nonzero().flatten()[0]) for f in feats]


def test_stage2_steps_each_image_with_another_groups_prototype(bundle, data, monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(stage2, "policy_step", rec)
    train = cmnist(4, "train", 10, "patch", 0)
    train_agent(bundle, train, data["val"], data["val_ex"], _stage2(iterations=2, lr=3e-4, group_size=5))
    with torch.no_grad():
        feats, crops = features_of(bundle, train.images), crop_embeddings(bundle, train)
    for call in rec.calls:
        assert call["lr"] == 3e-4 and call["gt"] is None  # the embedding reward needs no boxes
        assert torch.allclose(call["feats"], feats)  # no batch_size: every image, every iteration
        protos = call["protos"]
        values = protos.unique(dim=0)
        assert len(values) == 2  # two groups of five
        for v in values:
            mine = (protos == v).all(1)
            assert mine.sum() == 5
            assert torch.allclose(crops[~mine].mean(0), v, atol=1e-5)  # the other group's mean crop
            assert not torch.allclose(crops[mine].mean(0), v, atol=1e-3)


@pytest.mark.parametrize("reward", ["iou", "embedding"])
def test_stage2_draws_a_minibatch_with_its_boxes_for_a_box_reward(bundle, data, monkeypatch, reward):
    rec = _Recorder()
    monkeypatch.setattr(stage2, "policy_step", rec)
    train = data["train"]
    train_agent(bundle, train, data["val"], data["val_ex"], _stage2(iterations=3, batch_size=10, reward=reward))
    with torch.no_grad():
        feats = features_of(bundle, train.images)
    drawn = []
    for call in rec.calls:
        assert len(call["feats"]) == 10
        rows = _rows(call["feats"], feats)
        assert len(set(rows)) == 10
        if reward == "iou":
            assert torch.equal(call["gt"], train.boxes[rows])  # each image's own box
        else:
            assert call["gt"] is None
        drawn.append(tuple(rows))
    assert len(set(drawn)) > 1  # a new draw each iteration


def test_stage2_steps_on_the_features_the_data_carries(bundle, data, monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(stage2, "policy_step", rec)
    with torch.no_grad():
        carried = with_features(bundle, data["train"])
    carried.feats = carried.feats + 0.5  # not what the backbone would give: they must be the ones used
    train_agent(bundle, carried, data["val"], data["val_ex"], _stage2(iterations=2))
    assert all(torch.equal(c["feats"], carried.feats) for c in rec.calls)


def test_stage2_trains_one_kind_per_iteration_on_several_kinds(bundle, monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(stage2, "policy_step", rec)
    digits = (4, 7, 1)
    train = LabeledImages.concat([cmnist(d, "train", 10, "patch", 2) for d in digits])
    val = LabeledImages.concat([cmnist(d, "val", 3, "patch", 2) for d in digits])
    val_ex = LabeledImages.concat([cmnist(d, "val", 5, "patch", 3, offset=10) for d in digits])
    train_agent(bundle, train, val, val_ex, _stage2(iterations=12, reward="iou", batch_size=6, group_size=3))
    with torch.no_grad():
        feats = features_of(bundle, train.images)
    kinds = set()
    for call in rec.calls:
        rows = _rows(call["feats"], feats)
        assert len(rows) == len(set(rows)) == 6 and len(set(train.classes[rows].tolist())) == 1
        kinds.add(int(train.classes[rows[0]]))
        assert torch.equal(call["gt"], train.boxes[rows])
    assert kinds == {0, 1, 2}
    rec.calls.clear()
    train_agent(bundle, train, val, val_ex, _stage2(iterations=2, reward="iou"))  # no batch_size: a whole kind
    assert [len(c["feats"]) for c in rec.calls] == [10, 10]


def test_stage2_is_seeded(shipped, data):
    def agent_after(seed: int) -> dict[str, torch.Tensor]:
        b = copy.deepcopy(shipped)
        train_agent(b, data["train"], data["val"], data["val_ex"], _stage2(iterations=2, seed=seed))
        return b.agent_state

    assert _same(agent_after(0), agent_after(0))
    assert not _same(agent_after(0), agent_after(1))


# ---------------------------------------------------------------------------------------------- the policy step


def _step_setup(bundle, data):  # noqa: ANN001, ANN202
    with torch.no_grad():
        feats = features_of(bundle, data["train"].images)
        proto = prototypes_for(bundle, data["val_ex"], data["train"])
    agent = bundle.new_agent()
    return feats, proto.expand(len(feats), -1), agent, torch.optim.Adam(agent.parameters(), lr=1e-3)


def test_policy_step_reports_the_final_distance_of_its_scorer_on_the_pixels(bundle, data):
    feats, protos, agent, opt = _step_setup(bundle, data)
    scorer = LeftEdgeScorer()
    images = data["train"].images
    stats = policy_step(bundle, agent, opt, feats, protos, AgentTrainConfig(), torch.Generator().manual_seed(0),
                        scorer=scorer, images01=images)
    assert len(scorer.distances) == bundle.config.env.steps + 1  # the start and every step
    assert stats["charts/final_distance"] == pytest.approx(float(scorer.distances[-1].mean()))
    assert stats["charts/final_distance"] != pytest.approx(float(scorer.distances[-2].mean()))
    assert all(i is images for i in scorer.images)
    assert set(stats) == {"losses/policy", "losses/entropy", "charts/return", "charts/final_distance"}
    assert agent.training  # left in training mode


def test_policy_step_a_box_reward_reads_the_boxes_it_is_given(bundle, data):
    feats, protos, agent, _ = _step_setup(bundle, data)
    cfg = AgentTrainConfig(reward="iou")
    start = _state(agent)

    def ret(boxes: torch.Tensor) -> float:
        agent.load_state_dict(start)
        opt = torch.optim.Adam(agent.parameters(), lr=1e-3)
        return policy_step(bundle, agent, opt, feats, protos, cfg, torch.Generator().manual_seed(0),
                           gt_boxes=boxes)["charts/return"]

    right = data["train"].boxes
    wrong = right.flip(0)  # another image's box, the same episodes
    assert ret(right) != pytest.approx(ret(wrong))
    assert ret(right) == pytest.approx(ret(right))


def test_policy_step_adds_the_kl_to_its_reference_only_when_weighted(bundle, data):
    feats, protos, agent, opt = _step_setup(bundle, data)
    reference = copy.deepcopy(agent)
    gen = torch.Generator().manual_seed(0)
    off = policy_step(bundle, agent, opt, feats, protos, AgentTrainConfig(kl_coef=0.0), gen, reference=reference)
    assert "losses/kl" not in off
    same = copy.deepcopy(agent)
    on = policy_step(bundle, agent, torch.optim.Adam(agent.parameters(), lr=1e-3), feats, protos,
                     AgentTrainConfig(kl_coef=0.5), gen, reference=same)
    assert on["losses/kl"] == pytest.approx(0.0, abs=1e-6)  # the same policy: no divergence
    moved = policy_step(bundle, agent, torch.optim.Adam(agent.parameters(), lr=1e-3), feats, protos,
                        AgentTrainConfig(kl_coef=0.5), gen, reference=reference)
    assert isinstance(moved["losses/kl"], float) and moved["losses/kl"] > 0  # two steps away from the reference
