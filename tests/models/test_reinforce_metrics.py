import math

import pytest
import torch
from scipy.stats import spearmanr

from models.core.metrics import corloc, spearman
from models.core.ordinal import (
    class_batches,
    group_prototypes,
    kind_margin_loss,
    ordinal_accuracy,
    sample_pairs,
    triplet_loss,
)
from models.core.reinforce import discounted_returns, reinforce_loss


def test_discounted_returns_known_answer():
    r = torch.tensor([[1.0, 0.0], [0.0, 0.0], [2.0, 1.0]])  # [T=3, B=2]
    g = discounted_returns(r, 0.5)
    assert g[:, 0].tolist() == [1 + 0.25 * 2, 0 + 0.5 * 2, 2]
    assert g[:, 1].tolist() == [0.25, 0.5, 1.0]


def test_reinforce_gradient_prefers_better_actions():
    # Two samples took action 0 / 1; only action 0 earned reward: the loss gradient must raise its logit.
    logits = torch.zeros(1, 2, requires_grad=True)
    dist = torch.distributions.Categorical(logits=logits.expand(2, 2))
    actions = torch.tensor([0, 1])
    log_probs = dist.log_prob(actions)[None]  # [T=1, B=2]
    out = reinforce_loss(log_probs, dist.entropy()[None], torch.tensor([[1.0, 0.0]]), gamma=0.99,
                         entropy_coef=0.0, normalize=False)
    out.loss.backward()
    assert logits.grad[0, 0] < 0 < logits.grad[0, 1]  # gradient descent raises logit 0
    assert out.mean_return.item() == pytest.approx(0.5)


def test_per_image_baseline_is_leave_one_out_and_ignores_the_image_offset():
    torch.manual_seed(0)
    T, B, E = 4, 3, 4
    log_probs = torch.randn(T, B * E, requires_grad=True)
    rewards = torch.randn(T, B * E)
    out = reinforce_loss(log_probs, torch.zeros(T, B * E), rewards, gamma=0.9, entropy_coef=0.0,
                         normalize=False, episodes=E)
    (grad,) = torch.autograd.grad(out.loss, log_probs)
    g = discounted_returns(rewards, 0.9)
    for i in range(B * E):  # the slow, obvious way: minus the mean of the image's other episodes
        image = i // E
        others = [j for j in range(image * E, image * E + E) if j != i]
        adv = g[:, i] - g[:, others].mean(dim=1)
        assert torch.allclose(grad[:, i], -adv / (B * E), atol=1e-6)
    # an image that starts farther from the prototype (a larger first reward in all its episodes)
    # changes nothing: the baseline absorbs it
    shifted = rewards.clone()
    shifted[0, :E] += 50.0
    out2 = reinforce_loss(log_probs, torch.zeros(T, B * E), shifted, gamma=0.9, entropy_coef=0.0,
                          normalize=True, episodes=E)
    out1 = reinforce_loss(log_probs, torch.zeros(T, B * E), rewards, gamma=0.9, entropy_coef=0.0,
                          normalize=True, episodes=E)
    assert torch.allclose(out1.loss, out2.loss, atol=1e-5)
    with pytest.raises(ValueError, match="groups of 5"):
        reinforce_loss(log_probs, torch.zeros(T, B * E), rewards, episodes=5)


def test_corloc_known_values():
    gt = torch.tensor([[0.0, 0, 10, 10]] * 4)
    pred = torch.tensor([[0.0, 0, 10, 10], [0, 0, 10, 20], [0, 0, 10, 21], [50, 50, 60, 60]])
    assert corloc(pred, gt) == 50.0  # IoU 1, 0.5 (counts), 0.476, 0


def test_ordacc_known_values():
    a = torch.zeros(1, 2)
    pos = torch.tensor([[[1.0, 0], [3.0, 0]]])
    neg = torch.tensor([[[2.0, 0], [1.0, 0]]])
    assert ordinal_accuracy(a, pos, neg).item() == 50.0
    assert triplet_loss(a, pos, neg, margin=1.0).item() == pytest.approx(((1 + 1 - 2) + (1 + 3 - 1)) / 2)


def test_kind_margin_loss_known_values():
    # three images of two dimensions, none of the differences symmetric: a norm over the wrong axis, or the other
    # kind's prototype added instead of subtracted, gives other numbers
    emb = torch.tensor([[0.0, 0], [3.0, 0], [1.0, 1]])
    own = torch.tensor([[1.0, 0], [3.0, 4], [1.0, 3]])  # distances 1, 4, 2
    other = torch.tensor([0.0, 2])  # distances 2, sqrt(13), sqrt(2)
    near, far = torch.tensor([1.0, 4.0, 2.0]), torch.tensor([2.0, math.sqrt(13), math.sqrt(2)])
    for margin in (1.0, 0.0, 3.0):
        want = float(torch.relu(margin + near - far).mean())
        assert kind_margin_loss(emb, own, other, margin=margin).item() == pytest.approx(want)
    # image 0: 1 + 1 - 2 = 0; image 1: 1 + 4 - sqrt(13); image 2: 1 + 2 - sqrt(2)
    assert kind_margin_loss(emb, own, other, margin=1.0).item() == pytest.approx(
        (0 + 5 - math.sqrt(13) + 3 - math.sqrt(2)) / 3)
    far_away = torch.tensor([100.0, 100])
    assert kind_margin_loss(emb, own, far_away, margin=1.0).item() == 0.0  # nearer its own kind by the margin


def test_spearman_matches_scipy():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 40, generator=g).double()
    y = (x + torch.randn(5, 40, generator=g)).round(decimals=0)  # ties included
    ours = spearman(x, y)
    for i in range(5):
        assert ours[i].item() == pytest.approx(spearmanr(x[i], y[i]).statistic, abs=1e-9)
    assert math.isclose(spearman(torch.arange(5.0), -torch.arange(5.0)).item(), -1.0)


def test_corloc_refuses_shapes_that_differ_naming_both():
    with pytest.raises(ValueError, match=r"pred \(3, 4\) and gt \(2, 4\) must have the same shape"):
        corloc(torch.zeros(3, 4), torch.zeros(2, 4))


def test_spearman_of_two_values_and_of_a_constant():
    assert spearman(torch.tensor([1.0, 2.0]), torch.tensor([5.0, 7.0])).item() == pytest.approx(1.0)
    assert spearman(torch.tensor([1.0, 2.0]), torch.tensor([7.0, 5.0])).item() == pytest.approx(-1.0)
    assert spearman(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 4.0, 4.0])).item() == 0.0  # not NaN


def test_pair_sampling_orders_by_iou_and_spans_bins():
    from models.core.boxes import paired_iou, square_candidates

    cands = square_candidates(84, 28, 76, 4, 4)
    gt = torch.tensor([[10.0, 20, 38, 48], [50, 50, 78, 78]])
    p = sample_pairs(gt, cands, 200, generator=torch.Generator().manual_seed(0))
    assert p.pos.shape == (2, 200, 4)
    assert bool((p.pos_iou > p.neg_iou).all())
    assert torch.allclose(paired_iou(p.pos, gt[:, None]), p.pos_iou)
    bins = (p.neg_iou * 10).floor().unique()
    assert len(bins) >= 5  # group-based: low-IoU bins are drawn, not only the most common ones


def test_shuffle_proto_never_contains_the_image():
    emb = torch.eye(10) * 100  # image i's embedding is far from all others
    protos = group_prototypes(emb, 5, shuffle=True, generator=torch.Generator().manual_seed(0))
    # With shuffle the prototype is the mean of the *other* group: image i's own coordinate is 0.
    assert bool((protos.diagonal() == 0).all())
    own = group_prototypes(emb, 5, shuffle=False, generator=torch.Generator().manual_seed(0))
    assert bool((own.diagonal() == 20).all())


def test_class_batches_hold_one_kind_each_and_cover_the_data():
    classes = torch.tensor([0] * 7 + [1] * 5 + [2] * 2)
    batches = class_batches(classes, 3, drop_last=True, generator=torch.Generator().manual_seed(0))
    assert [len(b) for b in batches] == [3, 3, 3]  # 7 -> 2 full batches, 5 -> 1, 2 -> none
    for b in batches:
        assert len(classes[b].unique()) == 1
    assert sorted(classes[torch.cat(batches)].tolist()) == [0] * 6 + [1] * 3
    kept = class_batches(classes, 3, drop_last=False, generator=torch.Generator().manual_seed(0))
    assert sorted(torch.cat(kept).tolist()) == list(range(14))  # every image, once
    again = class_batches(classes, 3, drop_last=True, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(batches, again, strict=True))
    other = class_batches(classes, 3, drop_last=False, generator=torch.Generator().manual_seed(1))
    assert [b.tolist() for b in other] != [b.tolist() for b in kept]  # the generator draws the order


def test_class_batches_by_value_on_one_kind():
    # one kind of 7 in batches of 3: with drop_last 2 batches (6 images), without 3 (the last of 1); each batch is a
    # run of the kind's shuffled indices, in order
    classes = torch.tensor([5, 0, 5, 5, 0, 5, 5, 5, 5])
    g = torch.Generator().manual_seed(3)
    perm = torch.tensor([1, 4])[torch.randperm(2, generator=g)]  # kind 0's shuffle, drawn first
    fives = torch.tensor([0, 2, 3, 5, 6, 7, 8])[torch.randperm(7, generator=g)]
    batches = class_batches(classes, 3, drop_last=False, generator=torch.Generator().manual_seed(3))
    want = [perm.tolist(), fives[0:3].tolist(), fives[3:6].tolist(), fives[6:].tolist()]
    assert sorted(b.tolist() for b in batches) == sorted(want)
    dropped = class_batches(classes, 3, drop_last=True, generator=torch.Generator().manual_seed(3))
    assert sorted(b.tolist() for b in dropped) == sorted([fives[0:3].tolist(), fives[3:6].tolist()])
    exact = class_batches(torch.zeros(6, dtype=torch.long), 3, drop_last=True, generator=torch.Generator())
    assert sorted(len(b) for b in exact) == [3, 3]  # a kind of exactly two batches keeps both
    assert class_batches(torch.zeros(2, dtype=torch.long), 3, drop_last=True) == []


def test_pair_sampling_with_two_bins_only():
    # every candidate's IoU with the ground truth falls in bin 9 (the box itself) or bin 0 (far away): two bins are
    # enough, each pair one of each
    gt = torch.tensor([[0.0, 0, 10, 10]])
    cands = torch.tensor([[0.0, 0, 10, 10], [50, 50, 60, 60], [60, 60, 70, 70]])
    p = sample_pairs(gt, cands, 20, generator=torch.Generator().manual_seed(0))
    assert bool((p.pos_iou == 1).all()) and bool((p.neg_iou == 0).all())
    assert bool((p.pos == gt[:, None]).all())
    with pytest.raises(ValueError, match="at least two IoU bins"):
        sample_pairs(gt, cands[1:], 5)
