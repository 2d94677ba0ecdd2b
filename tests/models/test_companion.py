"""``models.companion.Companion``: a localizer whose greedy answers compete, image by image, with another policy's.

The companion (an adaptation job's starting policy, with its own head and prototype) answers as it would alone;
each image then keeps whichever of the two answers is nearer the localizer's prototype under the localizer's
head, with that distance as its score. The backbone still runs once per image.
"""

import pytest
import torch
from test_rollout_inference_behaviour import images, setup, tiny_bundle

from models.companion import Companion
from models.inference import Localizer, normalize, preprocess
from models.rollout import Rollout


def _pair(seed=0):
    """A localizer on another head than its bundle's (a repaired reward), a companion on the bundle's own head
    with another agent and prototype, images and the localizer's prototypes -> (loc, companion, feats, protos)."""
    bundle, _, feats, protos = setup(6, seed)
    other = tiny_bundle(seed + 7)  # another head and agent, the same config
    repaired = bundle.with_head(other.embedder.head.state_dict())
    start = Companion(Localizer(bundle, "cpu"), Localizer(bundle, "cpu").agent(), protos.flip(0))
    loc = Localizer(repaired, "cpu", companion=start)
    return loc, start, feats, protos, other


def _distances(loc, feats, boxes, protos):
    with torch.no_grad():
        return (loc.embedder.embed(feats, boxes[:, None])[:, 0] - protos).norm(dim=-1)


@pytest.mark.parametrize("nearest", [False, True])
def test_each_image_keeps_the_answer_nearer_under_the_localizers_head(nearest):
    loc, start, feats, protos, other = _pair()
    agent = loc.bundle.new_agent(other.agent_state).eval()
    alone = Localizer(loc.bundle, "cpu")  # the same head, no companion
    mine = alone.run_features(feats, protos, agent, nearest=nearest)
    theirs = start.localizer.run_features(feats, start.prototype, start.agent, nearest=nearest)
    got = loc.run_features(feats, protos, agent, nearest=nearest)
    d_theirs = _distances(loc, feats, theirs.boxes[-1], protos)
    take = d_theirs < mine.distances[-1]
    assert 0 < int(take.sum()) < len(take), "the test wants both outcomes among its images"
    assert torch.equal(got.boxes, torch.where(take[None, :, None], theirs.boxes, mine.boxes))  # whole episodes
    assert torch.equal(got.actions, torch.where(take[None], theirs.actions, mine.actions))
    assert torch.allclose(got.distances[-1], torch.minimum(d_theirs, mine.distances[-1]))
    want = torch.where(take[None], theirs.distances, mine.distances)[:-1]  # NaN where an episode embeds no step
    assert torch.allclose(got.distances[:-1], want, equal_nan=True)


def test_the_companion_scores_under_its_own_head_and_prototype():
    """The companion's answer is the one it serves alone (its head, its prototype), not one chosen under the
    localizer's head: with the companion on the localizer's head instead, other boxes come back."""
    loc, start, feats, protos, other = _pair()
    agent = loc.bundle.new_agent(other.agent_state).eval()
    on_mine = Companion(Localizer(loc.bundle, "cpu"), start.agent, protos)
    mixed = Localizer(loc.bundle, "cpu", companion=on_mine).run_features(feats, protos, agent, nearest=True)
    got = loc.run_features(feats, protos, agent, nearest=True)
    assert not torch.equal(mixed.boxes[-1], got.boxes[-1])


def test_a_companion_with_the_same_policy_changes_nothing_and_ties_keep_the_own_answer():
    bundle, _, feats, protos = setup(4, 3)
    plain = Localizer(bundle, "cpu")
    same = Localizer(bundle, "cpu", companion=Companion(plain, plain.agent(), protos))
    a, b = plain.run_features(feats, protos, plain.agent()), same.run_features(feats, protos, plain.agent())
    for x, y in zip(a, b, strict=True):
        assert (x is None and y is None) or torch.allclose(x, y, equal_nan=True)


def test_sampled_runs_and_runs_with_rewards_ignore_the_companion():
    loc, start, feats, protos, other = _pair(1)
    agent = loc.bundle.new_agent(other.agent_state).eval()
    alone = Localizer(loc.bundle, "cpu")
    g = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    for kw in ({"samples": 3}, {"deterministic": False}, {"rewards": True, "deterministic": False}):
        got = loc.run_features(feats, protos, agent, generator=g(), **kw)
        want = alone.run_features(feats, protos, agent, generator=g(), **kw)
        assert torch.equal(got.boxes, want.boxes), kw


def test_localize_batch_runs_the_backbone_once_and_answers_with_the_picked_boxes(monkeypatch):
    loc, start, _, protos, other = _pair(2)
    agent = loc.bundle.new_agent(other.agent_state).eval()
    ims = list(images(6, 1, 11, size=40, width=48))
    batch, scales = preprocess(ims, loc.spec)
    calls = []
    real = loc.embedder.features
    monkeypatch.setattr(loc.embedder, "features", lambda x: calls.append(len(x)) or real(x))
    monkeypatch.setattr(start.localizer.embedder, "features", lambda x: pytest.fail("the backbone ran again"))
    answers = loc.localize_batch(batch, scales, protos, agent, trajectory=True)
    assert calls == [6]
    with torch.no_grad():
        feats = real(normalize(batch, loc.spec))
    ro: Rollout = loc.run_features(feats, protos, agent)
    k = torch.cat([scales, scales], dim=1)
    for a, box, d in zip(answers, (ro.boxes[-1] * k).tolist(), ro.distances[-1].tolist(), strict=True):
        assert a.box == pytest.approx(tuple(box), abs=1e-4) and a.score == pytest.approx(d, abs=1e-5)
        assert a.trajectory[-1] == pytest.approx(a.box, abs=1e-4)


@pytest.mark.parametrize("nearest", [False, True])
def test_a_judge_picks_by_the_cosine_of_the_answers_backbone_features(nearest):
    """With a ``judge`` (the exemplars' mean RoI feature), each image keeps the answer whose RoI-pooled backbone
    features have the higher cosine with it, whatever the heads say; the score stays the chosen answer's distance
    under the localizer's head."""
    loc, start, feats, protos, other = _pair(4)
    agent = loc.bundle.new_agent(other.agent_state).eval()
    mine = Localizer(loc.bundle, "cpu").run_features(feats, protos, agent, nearest=nearest)
    theirs = start.localizer.run_features(feats, start.prototype, start.agent, nearest=nearest)
    with torch.no_grad():
        roi = loc.embedder.roi(feats, torch.stack([mine.boxes[-1], theirs.boxes[-1]], 1))  # [B, 2, C, s, s]
    flat = roi.flatten(2)
    judge = flat[:, 1].mean(0) - 0.5 * flat[:, 0].mean(0)  # leans to the companion's answers, not on every image
    cos = torch.nn.functional.cosine_similarity(flat, judge.expand_as(flat), dim=-1)  # written out, [B, 2]
    take = cos[:, 1] > cos[:, 0]
    assert 0 < int(take.sum()) < len(take), "the test wants both outcomes among its images"
    judged = Localizer(loc.bundle, "cpu", companion=Companion(start.localizer, start.agent, start.prototype, judge))
    got = judged.run_features(feats, protos, agent, nearest=nearest)
    assert torch.equal(got.boxes, torch.where(take[None, :, None], theirs.boxes, mine.boxes))
    d_theirs = _distances(loc, feats, theirs.boxes[-1], protos)
    assert torch.allclose(got.distances[-1], torch.where(take, d_theirs, mine.distances[-1]), atol=1e-6)
    by_head = loc.run_features(feats, protos, agent, nearest=nearest)  # the same companion without a judge
    assert not torch.equal(by_head.boxes[-1], got.boxes[-1]), "the judge should overrule the head somewhere"


def test_feature_distances_is_one_minus_the_cosine_over_channels_and_cells():
    from models.companion import feature_distances

    g = torch.Generator().manual_seed(0)
    roi, ref = torch.randn(3, 2, 4, 5, 5, generator=g), torch.randn(4, 5, 5, generator=g)
    want = torch.tensor([[1 - float(torch.dot(r.flatten(), ref.flatten()) / (r.norm() * ref.norm())) for r in row]
                         for row in roi])
    assert torch.allclose(feature_distances(roi, ref), want, atol=1e-6)
    assert torch.allclose(feature_distances(roi, ref.flatten()), want, atol=1e-6)  # a flat reference, as stored
    assert torch.allclose(feature_distances(roi[0, 0], ref), want[0, 0], atol=1e-6)  # one box


@pytest.mark.parametrize("nearest", [False, True])
def test_agree_keeps_the_own_answer_only_where_both_heads_prefer_it(nearest):
    """``Companion(agree=True)`` (a paired checkpoint): the localizer's answer stands only where it is nearer the
    localizer's prototype under the localizer's head *and* nearer the companion's prototype under the companion's
    head; elsewhere, ties included, the companion's answer, scored under the localizer's head."""
    loc, start, feats, protos, other = _pair(5)
    agent = loc.bundle.new_agent(other.agent_state).eval()
    mine = Localizer(loc.bundle, "cpu").run_features(feats, protos, agent, nearest=nearest)
    theirs = start.localizer.run_features(feats, start.prototype, start.agent, nearest=nearest)
    d_mine_mine, d_theirs_mine = mine.distances[-1], _distances(loc, feats, theirs.boxes[-1], protos)
    d_mine_start = _distances(start.localizer, feats, mine.boxes[-1], start.prototype)
    d_theirs_start = _distances(start.localizer, feats, theirs.boxes[-1], start.prototype)
    keep = (d_mine_mine < d_theirs_mine) & (d_mine_start < d_theirs_start)  # written out
    by_mine = d_mine_mine < d_theirs_mine  # the localizer's head alone (the plain companion's rule)
    assert bool((by_mine & ~keep).any()), "the test wants the companion's head to overrule somewhere"
    paired = Localizer(loc.bundle, "cpu", companion=Companion(start.localizer, start.agent, start.prototype,
                                                              agree=True))
    got = paired.run_features(feats, protos, agent, nearest=nearest)
    assert torch.equal(got.boxes, torch.where(keep[None, :, None], mine.boxes, theirs.boxes))
    assert torch.allclose(got.distances[-1], torch.where(keep, d_mine_mine, d_theirs_mine), atol=1e-6)
    same = Localizer(loc.bundle, "cpu", companion=Companion(Localizer(loc.bundle, "cpu"), agent, protos,
                                                            agree=True))
    assert torch.equal(same.run_features(feats, protos, agent, nearest=nearest).boxes[-1],
                       mine.boxes[-1])  # the same policy: every answer ties, and ties are the companion's (equal)


def test_with_reward_serves_a_format_4_checkpoint_paired_with_its_start():
    """``Localizer.with_reward``: a reward without a start is its head alone; with one (format 4), a companion
    that is the start as it was served (the bundle's head, or the start's own head) under the agreement rule."""
    from models.bundle import Reward, Start

    bundle, _, feats, protos = setup(6, 5)
    other, third = tiny_bundle(12), tiny_bundle(13)
    head = other.embedder.head.state_dict()
    base = Localizer(bundle, "cpu")
    agent = base.bundle.new_agent(other.agent_state).eval()
    alone = base.with_reward(Reward(head, protos[0]))
    assert alone.companion is None and not alone.bundle.refine
    paired = base.with_reward(Reward(head, protos[0], start=Start(protos[1])))
    c = paired.companion
    assert c is not None and c.agree and c.localizer is base and torch.equal(c.prototype, protos[1])
    assert all(torch.equal(v, bundle.agent_state[k]) for k, v in c.agent.state_dict().items())  # the bundle's own
    want = Localizer(paired.bundle, "cpu", companion=Companion(base, base.agent(), protos[1], agree=True))
    assert torch.equal(paired.run_features(feats, protos[0], agent).boxes, want.run_features(feats, protos[0],
                                                                                                agent).boxes)
    st = Start(protos[2], agent=third.agent_state, head=third.embedder.head.state_dict())
    own = base.with_reward(Reward(head, protos[0], start=st)).companion
    assert own is not None and own.localizer is not base
    assert all(torch.equal(v, third.embedder.head.state_dict()[k])
               for k, v in own.localizer.embedder.head.state_dict().items())
    assert all(torch.equal(v, third.agent_state[k]) for k, v in own.agent.state_dict().items())


def test_agree_with_a_judge_needs_the_judge_to_prefer_the_own_answer_too():
    loc, start, feats, protos, other = _pair(5)
    agent = loc.bundle.new_agent(other.agent_state).eval()
    mine = Localizer(loc.bundle, "cpu").run_features(feats, protos, agent)
    theirs = start.localizer.run_features(feats, start.prototype, start.agent)
    agree = Localizer(loc.bundle, "cpu", companion=Companion(start.localizer, start.agent, start.prototype,
                                                             agree=True)).run_features(feats, protos, agent)
    kept = (agree.boxes[-1] == mine.boxes[-1]).all(-1) & (mine.boxes[-1] != theirs.boxes[-1]).any(-1)
    assert bool(kept.any()), "the test wants images where both heads keep the own answer"
    with torch.no_grad():
        flat = loc.embedder.roi(feats, torch.stack([mine.boxes[-1], theirs.boxes[-1]], 1)).flatten(2)
    judge = flat[:, 1].mean(0) - 0.5 * flat[:, 0].mean(0)  # leans to the companion's answers
    cos = torch.nn.functional.cosine_similarity(flat, judge.expand_as(flat), dim=-1)
    keep = kept & (cos[:, 0] > cos[:, 1])  # written out: both heads and the judge
    assert bool((kept & ~keep).any()), "the test wants the judge to overrule the heads somewhere"
    three = Localizer(loc.bundle, "cpu", companion=Companion(start.localizer, start.agent, start.prototype, judge,
                                                             agree=True)).run_features(feats, protos, agent)
    assert torch.equal(three.boxes[-1], torch.where(keep[:, None], mine.boxes[-1], theirs.boxes[-1]))


def test_consensus_picks_the_answer_that_overlaps_the_others_most_and_ties_go_to_the_first():
    from models.companion import consensus

    a = torch.tensor([[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 10.0]])
    b = torch.tensor([[1.0, 1.0, 11.0, 11.0], [20.0, 20.0, 30.0, 30.0]])
    c = torch.tensor([[50.0, 50.0, 60.0, 60.0], [21.0, 21.0, 31.0, 31.0]])
    # image 0: a and b overlap (c is alone); a and b tie, so the first (a); image 1: b and c overlap, b first
    assert consensus(torch.stack([a, b, c])).tolist() == [0, 1]
    assert consensus(torch.stack([c, b, a])).tolist() == [1, 0]  # image 0: b and a tie -> b, now the first
    assert consensus(torch.stack([a, a])).tolist() == [0, 0]  # two equal answers: the first
    assert consensus(torch.stack([a, c])).tolist() == [0, 0]  # two disjoint ones: the first too


@pytest.mark.parametrize("nearest", [False, True])
def test_members_answer_each_image_by_the_consensus_of_every_episode(nearest):
    """``Companion(members=...)`` (a format-5 checkpoint): the companion's episode (its head, its prototype), each
    member's and the localizer's own (both under the localizer's head), and per image the whole episode whose answer
    overlaps the others most, scored under the localizer's head; an empty ``members`` is the companion vs the own
    answer, where ties (every pair of two) go to the companion."""
    from models.core.boxes import paired_iou

    loc, start, feats, protos, other = _pair(3)
    agent = loc.bundle.new_agent(other.agent_state).eval()
    members = tuple(loc.bundle.new_agent(tiny_bundle(20 + i).agent_state).eval() for i in range(3))
    alone = Localizer(loc.bundle, "cpu")
    runs = [start.localizer.run_features(feats, start.prototype, start.agent, nearest=nearest),
            *(alone.run_features(feats, protos, m, nearest=nearest) for m in members),
            alone.run_features(feats, protos, agent, nearest=nearest)]
    finals = torch.stack([r.boxes[-1] for r in runs])  # [5, B, 4]
    overlap = torch.stack([torch.stack([paired_iou(finals[i], finals[j]) for j in range(5)]).sum(0)
                           for i in range(5)])  # [5, B], written out
    pick = overlap.argmax(0)
    assert len(set(pick.tolist())) > 1, "the test wants different episodes picked among its images"
    voted = Localizer(loc.bundle, "cpu", companion=Companion(start.localizer, start.agent, start.prototype,
                                                             members=members))
    got = voted.run_features(feats, protos, agent, nearest=nearest)
    b = torch.arange(finals.shape[1])
    assert torch.equal(got.boxes, torch.stack([r.boxes for r in runs])[pick, :, b].transpose(0, 1))
    assert torch.equal(got.actions, torch.stack([r.actions for r in runs])[pick, :, b].T)
    finals_d = torch.stack([_distances(loc, feats, runs[0].boxes[-1], protos), *(r.distances[-1] for r in runs[1:])])
    assert torch.allclose(got.distances[-1], finals_d[pick, b], atol=1e-6)  # every score under the localizer's head
    two = Localizer(loc.bundle, "cpu", companion=Companion(start.localizer, start.agent, start.prototype,
                                                           members=())).run_features(feats, protos, agent,
                                                                                     nearest=nearest)
    assert torch.equal(two.boxes[-1], runs[0].boxes[-1])  # start vs own alone: every image a tie, the start's


def test_with_reward_serves_a_format_5_checkpoint_by_consensus():
    from models.bundle import Reward, Start

    bundle, _, feats, protos = setup(6, 5)
    other = tiny_bundle(12)
    base = Localizer(bundle, "cpu")
    voters = (tiny_bundle(21).agent_state, tiny_bundle(22).agent_state)
    served = base.with_reward(Reward(other.embedder.head.state_dict(), protos[0],
                                     start=Start(protos[1], consensus=voters)))
    c = served.companion
    assert c is not None and c.members is not None and len(c.members) == 2 and c.localizer is base
    assert all(torch.equal(v, voters[i][k]) for i, m in enumerate(c.members) for k, v in m.state_dict().items())
    agent = base.bundle.new_agent(other.agent_state).eval()
    want = Localizer(served.bundle, "cpu", companion=Companion(base, base.agent(), protos[1], members=tuple(
        base.agent(v) for v in voters)))
    assert torch.equal(served.run_features(feats, protos[0], agent).boxes,
                       want.run_features(feats, protos[0], agent).boxes)


# ``compete`` against scripted localizers: every rule's comparisons, ties and episode mixing on answers written out.
# B = 4 images and T = 2 steps (T + 1 != B: a mask laid along the wrong axis fails to broadcast).


class _Embedder:
    """Embeds a box ``(x1, y1, x2, y2)`` as ``[y1]`` and reads its RoI feature as ``[x1, y1]`` (one channel, 1 x 2)."""

    def embed(self, feats, boxes):  # boxes [B, K, 4] -> [B, K, 1]
        return boxes[..., 1:2].clone()

    def roi(self, feats, boxes):  # [B, K, 4] -> [B, K, 1, 1, 2]
        return boxes[..., None, None, :2].clone()


class _Scripted:
    """A stand-in ``Localizer`` for ``compete``: ``bundle`` maps each agent to its scripted ``Rollout``; its head
    scores a box by its ``x1`` (``box_distances``), a companion's by its ``y1`` (``_Embedder``); every construction
    and run is recorded in ``log``."""

    def __init__(self, bundle, device="cpu", *, fast_episode=True, log=None):
        self.bundle, self.device, self.fast_episode = bundle, device, fast_episode
        self.embedder, self.log = _Embedder(), bundle["log"]
        self.log.append(("made", device, fast_episode))

    def run_features(self, feats, prototype, agent, nearest=None):
        self.log.append(("run", agent, nearest))
        return self.bundle[agent]

    def box_distances(self, feats, boxes, prototype):
        return boxes[:, 0].clone()


def _episode(finals, before=None, distances=None):
    """A scripted greedy ``Rollout`` of T = 2 steps whose final boxes are ``finals [B, 4]`` (the box before them
    ``before``, default the whole 100-px image), every other field distinct per episode."""
    b = finals.shape[0]
    whole = torch.tensor([0.0, 0.0, 100.0, 100.0]).expand(b, 4)
    boxes = torch.stack([whole, whole if before is None else before, finals])
    tag = float(finals.sum())
    d = finals[:, 0].clone() if distances is None else distances
    return Rollout(boxes, torch.full((2, b), int(tag) % 9), torch.full((2, b), -tag), torch.full((2, b), tag),
                   torch.zeros(2, b), torch.stack([torch.full((b,), float("nan"))] * 2 + [d]))


def _compete(mine_ro, theirs_ro, **kw):
    from models.companion import compete

    log = []
    runs = {"log": log, "own": mine_ro, "start": theirs_ro, **kw.pop("runs", {})}  # one bundle: the members' too
    mine, theirs = _Scripted(runs, "mine's device", fast_episode=False), _Scripted(runs)
    c = Companion(theirs, "start", kw.pop("prototype", torch.tensor([0.0])), **kw)
    return compete(mine, c, mine_ro, torch.zeros(4, 1, 1, 1), torch.tensor([0.0]), True), log  # feats: unread


def _boxes(*x1s, y1=0.0):
    return torch.tensor([[x, y1, x + 10.0, y1 + 10.0] for x in x1s])


def test_compete_nearer_rule_takes_whole_episodes_and_ties_keep_the_own():
    mine_ro = _episode(_boxes(5, 5, 5, 5), distances=torch.tensor([5.0, 5.0, 5.0, 5.0]))
    theirs_ro = _episode(_boxes(3, 5, 7, 4))  # x1 = its distance under mine's head: nearer, tie, farther, nearer
    got, log = _compete(mine_ro, theirs_ro)
    take = torch.tensor([True, False, False, True])
    for field, m, t in zip(got, mine_ro, theirs_ro, strict=True):
        if m is None:
            assert field is None
            continue
        want = torch.where(take.view(1, -1, *([1] * (m.dim() - 2))), t, m)
        n = len(want) - 1 if field is got.distances else len(want)
        assert torch.equal(field[:n].nan_to_num(-1), want[:n].nan_to_num(-1))
    assert got.distances[-1].tolist() == [3.0, 5.0, 5.0, 4.0]  # the taken answer scored under mine's head
    assert ("run", "start", True) in log  # the companion runs as asked (nearest)


def test_compete_agree_keeps_the_own_only_where_both_heads_strictly_prefer_it():
    # own answers: x1 5 (distance 5 under the own head), y1 0 (distance |0 - prototype| under the companion's)
    mine_ro = _episode(_boxes(5, 5, 5, 5, 5, y1=0.0), distances=torch.full((5,), 5.0))
    theirs_ro = _episode(torch.tensor([[9.0, 3, 19, 13], [5, 3, 15, 13], [9, 0, 19, 10], [1, 3, 11, 13],
                                       [9, 3, 19, 13]]))
    proto = torch.tensor([[0.0], [0.0], [0.0], [0.0], [3.0]])  # the companion's, per image
    got, _ = _compete(mine_ro, theirs_ro, agree=True, prototype=proto)
    # 0: both heads prefer the own -> own; 1: the own head ties (5, 5) -> theirs; 2: the companion's head ties
    # (0, 0) -> theirs; 3: the own head prefers theirs (1 < 5); 4: the companion's prefers theirs (0 < 3)
    assert got.boxes[-1].tolist() == [mine_ro.boxes[-1][0].tolist(), *theirs_ro.boxes[-1][1:].tolist()]
    assert got.actions.T.tolist() == [mine_ro.actions[:, 0].tolist(), *theirs_ro.actions[:, 1:].T.tolist()]
    assert got.distances[-1].tolist() == [5.0, 5.0, 9.0, 1.0, 9.0]


def test_compete_agree_with_a_judge_needs_the_judge_to_strictly_prefer_the_own_too():
    # own answers: RoI feature [5, 1], distance 5 under the own head, 0 under the companion's (prototype y1 = 1)
    mine_ro = _episode(_boxes(5, 5, 5, 5, y1=1.0), distances=torch.full((4,), 5.0))
    theirs_ro = _episode(torch.tensor([[9.0, 2, 19, 12], [10, 2, 20, 12], [9, 3, 19, 13], [2, 5, 12, 15]]))
    got, _ = _compete(mine_ro, theirs_ro, agree=True, judge=torch.tensor([5.0, 1.0]), prototype=torch.tensor([1.0]))
    # 0, 2: both heads and the judge (own parallel to it) prefer the own -> own; 1: [10, 2] is parallel to the own
    # [5, 1], the judge ties -> theirs; 3: the own head prefers theirs (2 < 5), whatever the judge says -> theirs
    assert got.boxes[-1][:, 0].tolist() == [5.0, 10.0, 5.0, 2.0]
    got, _ = _compete(mine_ro, theirs_ro, agree=True, judge=torch.tensor([9.0, 2.0]), prototype=torch.tensor([1.0]))
    assert got.boxes[-1][:, 0].tolist() == [9.0, 10.0, 5.0, 2.0]  # image 0: the judge now prefers theirs


def test_compete_judge_alone_takes_the_companion_only_where_the_judge_strictly_prefers_it():
    mine_ro = _episode(_boxes(5, 5, 5, y1=1.0))
    theirs_ro = _episode(torch.tensor([[9.0, 1.0, 19.0, 11.0], [10.0, 2.0, 20.0, 12.0], [1.0, 1.0, 11.0, 11.0]]))
    got, _ = _compete(mine_ro, theirs_ro, judge=torch.tensor([9.0, 1.0]))
    # image 0: theirs parallel to the judge -> theirs; 1: [10, 2] and own [5, 1] tie -> own; 2: [1, 1] farther -> own
    assert got.boxes[-1][:, 0].tolist() == [9.0, 5.0, 5.0]
    assert got.distances[-1].tolist() == [9.0, mine_ro.distances[-1][1].item(), mine_ro.distances[-1][2].item()]


def test_compete_consensus_votes_on_final_boxes_runs_members_as_asked_and_scores_under_the_own_head():
    # the votes are on the final boxes, not on the step before them (there the start's equal the own answers, and the
    # others all sit on one far box)
    far = _boxes(50, 50, 50, 50)
    own = _episode(_boxes(0, 0, 30, 60), before=far)
    start = _episode(_boxes(0, 60, 30, 0), before=_boxes(0, 0, 30, 60))
    m1 = _episode(_boxes(1, 61, 60, 90), before=far)
    m2 = _episode(_boxes(90, 1, 61, 61), before=far)
    got, log = _compete(own, start, members=("m1", "m2"), runs={"m1": m1, "m2": m2})
    from models.core.boxes import paired_iou

    finals = torch.stack([start.boxes[-1], m1.boxes[-1], m2.boxes[-1], own.boxes[-1]])
    votes = torch.stack([sum(paired_iou(finals[i], finals[j]) for j in range(4)) for i in range(4)])
    pick = votes.argmax(0)
    assert len(set(pick.tolist())) > 1, "the test wants different picks among its images"
    runs = [start, m1, m2, own]
    b = torch.arange(4)
    assert torch.equal(got.boxes, torch.stack([r.boxes for r in runs])[pick, :, b].transpose(0, 1))
    assert torch.equal(got.actions, torch.stack([r.actions for r in runs])[pick, :, b].T)
    start_d = start.boxes[-1][:, 0]  # the companion's answer scored under the own head (x1)
    want_d = torch.stack([start_d, m1.distances[-1], m2.distances[-1], own.distances[-1]])[pick, b]
    assert torch.equal(got.distances[-1], want_d)
    assert [e for e in log if e[0] == "run"] == [("run", "start", True), ("run", "m1", True), ("run", "m2", True)]
    made = [e for e in log if e[0] == "made"]  # mine, the companion's, then the one the members run on
    assert made[2:] == [("made", "mine's device", False)]  # the own bundle (the runs above), device, episode mode


def test_start_companion_keeps_the_base_device_episode_mode_and_the_start_refine():
    from models.bundle import Start
    from models.companion import start_companion

    bundle, _, _, protos = setup(2, 1)
    head = tiny_bundle(9).embedder.head.state_dict()
    for fast in (True, False):
        base = Localizer(bundle, "cpu", fast_episode=fast)
        for refine in (True, False):
            c = start_companion(base, Start(protos[0], head=head, refine=refine))
            assert c.localizer.fast_episode is fast and c.localizer.device == base.device
            assert c.localizer.bundle.refine is refine and c.agree and c.members is None
            assert torch.equal(c.localizer.embedder.head.state_dict()["net.1.weight"], head["net.1.weight"])


def test_with_reward_keeps_the_device_and_episode_mode_and_refines_as_the_reward_says():
    from models.bundle import Reward

    bundle, _, _, protos = setup(2, 1)
    head = tiny_bundle(9).embedder.head.state_dict()
    for fast in (True, False):
        base = Localizer(bundle, "cpu", fast_episode=fast)
        for refine in (True, False):
            served = base.with_reward(Reward(head, protos[0], refine=refine))
            assert served.fast_episode is fast and served.device == base.device and served.companion is None
            assert served.bundle.refine is refine
    assert Localizer(bundle, "cpu").fast_episode is True  # compiled / CUDA-graph episodes unless told otherwise
