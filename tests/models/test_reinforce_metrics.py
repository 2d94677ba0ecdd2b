import math

import pytest
import torch
from scipy.stats import spearmanr

from models.core.metrics import corloc, spearman
from models.core.ordinal import group_prototypes, kind_margin_loss, ordinal_accuracy, sample_pairs, triplet_loss
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
    emb = torch.tensor([[0.0, 0], [3.0, 0]])
    own = torch.tensor([[1.0, 0], [3.0, 4]])  # distances 1 and 4
    other = torch.tensor([0.0, 2])  # distances 2 and sqrt(13)
    # image 0: 1 + 1 - 2 = 0; image 1: 1 + 4 - sqrt(13) > 0
    assert kind_margin_loss(emb, own, other, margin=1.0).item() == pytest.approx((0 + 5 - math.sqrt(13)) / 2)
    assert kind_margin_loss(emb, own, other, margin=0.0).item() == pytest.approx((4 - math.sqrt(13)) / 2)
    far = torch.tensor([100.0, 100])
    assert kind_margin_loss(emb, own, far, margin=1.0).item() == 0.0  # nearer its own kind by the margin: no loss


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
