"""Behaviour of ``models.rollout`` and ``models.inference`` checked against slow, independent computations.

A tiny bundle (32 x 32 inputs, a 16-d embedding, 4 steps) keeps every test fast; each assertion pins a
value the serving path relies on (rewards, box layout, prototypes, preprocessing, box mapping).
"""

import dataclasses
import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from models.bundle import new_bundle
from models.config import AgentConfig, EnvConfig, HeadConfig, InputSpec, ModelConfig
from models.core.actions import apply_actions
from models.core.boxes import paired_iou
from models.inference import (
    Localization,
    Localizer,
    exemplar_canvas,
    normalize,
    pil_to_tensor,
    resize_batch,
    resolve_device,
    to_8bit,
)
from models.rollout import BoxEnv, rollout, search, select_actions

S = 32  # input side of the tiny bundle
STEPS = 4


def tiny_config(channels=1, use_prototype=False, answer="last", dropout=0.0):
    mean, std = ((0.1307,), (0.3081,)) if channels == 1 else ((0.4, 0.5, 0.6), (0.2, 0.25, 0.3))
    fill = (0.0,) if channels == 1 else (0.1, 0.5, 0.9)
    return ModelConfig(
        input=InputSpec(channels=channels, size=S, mean=mean, std=std, exemplar_size=12, fill=fill),
        head=HeadConfig(in_features=64 * 7 * 7, hidden=32, out_features=16, dropout=dropout),
        agent=AgentConfig(conv_channels=4, hidden=8, use_prototype=use_prototype, embed_dim=16),
        env=EnvConfig(steps=STEPS, alpha=0.2, min_side=8.0, resize=0.2, answer=answer),
    )


def lively_agent_state(state, seed):
    """Random agent weights large enough that greedy actions differ between images and steps."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * (3.0 / v[0].numel() ** 0.5 if v.dim() > 1 else 0.1)
            for k, v in state.items()}


def tiny_bundle(seed=0, **kw):
    cfg = tiny_config(**kw)
    cfg.encoder.in_channels = cfg.input.channels
    bundle = new_bundle("tiny", cfg, seed)
    bundle.agent_state = lively_agent_state(bundle.agent_state, seed)
    return bundle


def images(n, channels=1, seed=0, size=S, width=None):
    """Dim noise with one bright rectangle each (an object to find): ``[n, C, size, width or size]``."""
    g = torch.Generator().manual_seed(seed)
    h, w = size, width or size
    x = 0.3 * torch.rand(n, channels, h, w, generator=g)
    for i in range(n):
        bh = int(torch.randint(h // 5, h // 2, (1,), generator=g))
        bw = int(torch.randint(w // 5, w // 2, (1,), generator=g))
        x0, y0 = int(torch.randint(0, w - bw, (1,), generator=g)), int(torch.randint(0, h - bh, (1,), generator=g))
        x[i, :, y0:y0 + bh, x0:x0 + bw] = 0.7 + 0.3 * torch.rand(channels, bh, bw, generator=g)
    return x


def setup(n=5, seed=0, **kw):
    bundle = tiny_bundle(seed, **kw)
    x = images(n, bundle.config.input.channels, seed)
    with torch.no_grad():
        feats = bundle.embedder.features(normalize(x, bundle.config.input))
    protos = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed + 100))
    return bundle, x, feats, protos


def embed_boxes(bundle, feats, boxes):
    with torch.no_grad():
        return bundle.embedder.embed(feats, boxes[:, None])[:, 0]


@torch.no_grad()
def reference_rollout(bundle, agent, feats, protos, size, sample_gen=None, reference=None):
    """The obvious per-step loop: greedy (or sampled from ``sample_gen``), every box embedded."""
    cfg, b = bundle.config.env, len(feats)
    w, h = size
    boxes = torch.tensor([[0.0, 0.0, w, h]]).repeat(b, 1)
    hid = torch.zeros(b, agent.cfg.hidden)
    hid_ref = torch.zeros(b, agent.cfg.hidden)
    emb = embed_boxes(bundle, feats, boxes)
    dist = (emb - protos).norm(dim=-1)
    out = {"boxes": [boxes], "dists": [dist], "actions": [], "log_probs": [], "entropies": [], "rewards": [],
           "kl": []}
    for _ in range(cfg.steps):
        roi = bundle.embedder.roi(feats, boxes[:, None])[:, 0]
        offset = emb - protos
        logits, hid = agent(roi, hid, offset)
        logp = torch.log_softmax(logits, -1)
        if sample_gen is None:
            a = logits.argmax(-1)
        else:
            a = torch.multinomial(torch.softmax(logits, -1), 1, generator=sample_gen)[:, 0]
        if reference is not None:
            ref_logits, hid_ref = reference(roi, hid_ref, offset)
            ref_logp = torch.log_softmax(ref_logits, -1)
            out["kl"].append((logp.exp() * (logp - ref_logp)).sum(-1))
        out["actions"].append(a)
        out["log_probs"].append(logp.gather(1, a[:, None])[:, 0])
        out["entropies"].append(-(logp.exp() * logp).sum(-1))
        boxes = apply_actions(boxes, a, w, h, cfg.alpha, cfg.min_side, cfg.resize)
        emb = embed_boxes(bundle, feats, boxes)
        new = (emb - protos).norm(dim=-1)
        out["rewards"].append(dist - new)
        dist = new
        out["boxes"].append(boxes)
        out["dists"].append(dist)
    return {k: torch.stack(v) if v else None for k, v in out.items()}


# ------------------------------------------------------------------------------------------- rollout


@pytest.mark.parametrize("use_prototype", [False, True])
def test_greedy_rollout_matches_the_step_by_step_reference(use_prototype):
    bundle, _, feats, protos = setup(use_prototype=use_prototype)
    agent = bundle.new_agent().eval()
    size = (S, S - 6)  # a non-square frame: width and height must not be swapped
    ro = rollout(bundle.embedder, agent, feats, protos, bundle.config.env, size, deterministic=True)
    ref = reference_rollout(bundle, agent, feats, protos, size)
    b = len(feats)
    assert ro.boxes.shape == (STEPS + 1, b, 4) and ro.actions.shape == (STEPS, b)
    assert ro.rewards.shape == ro.log_probs.shape == ro.entropies.shape == (STEPS, b)
    assert ro.distances.shape == (STEPS + 1, b)
    assert torch.equal(ro.boxes[0], torch.tensor([[0.0, 0.0, S, S - 6]]).repeat(b, 1))  # the whole image
    assert torch.equal(ro.actions, ref["actions"])
    assert torch.allclose(ro.boxes, ref["boxes"])
    assert torch.allclose(ro.distances, ref["dists"], atol=1e-5)
    assert torch.allclose(ro.rewards, ref["rewards"], atol=1e-5)
    assert torch.allclose(ro.rewards, ro.distances[:-1] - ro.distances[1:], atol=1e-5)  # dist_before - dist
    assert torch.allclose(ro.log_probs, ref["log_probs"], atol=1e-5)
    assert torch.allclose(ro.entropies, ref["entropies"], atol=1e-5)
    assert ro.kl is None
    assert ro.log_probs.requires_grad and ro.entropies.requires_grad  # the agent's gradient flows
    assert not ro.distances.requires_grad and not ro.rewards.requires_grad  # the embedder's does not
    assert bool((ro.actions != ro.actions[0, 0]).any())  # the reference is not trivially one action


def test_sampled_rollout_draws_from_the_generator_like_multinomial():
    bundle, _, feats, protos = setup()
    agent = bundle.new_agent().eval()
    ro = rollout(bundle.embedder, agent, feats, protos, bundle.config.env, (S, S), deterministic=False,
                 generator=torch.Generator().manual_seed(7))
    ref = reference_rollout(bundle, agent, feats, protos, (S, S), sample_gen=torch.Generator().manual_seed(7))
    assert torch.equal(ro.actions, ref["actions"])
    assert torch.allclose(ro.rewards, ref["rewards"], atol=1e-5)
    greedy = rollout(bundle.embedder, agent, feats, protos, bundle.config.env, (S, S), deterministic=True)
    assert not torch.equal(ro.actions, greedy.actions)


def test_shared_prototype_vector_equals_one_row_per_image():
    bundle, _, feats, protos = setup()
    agent = bundle.new_agent().eval()
    one = rollout(bundle.embedder, agent, feats, protos[0], bundle.config.env, (S, S), deterministic=True)
    rows = rollout(bundle.embedder, agent, feats, protos[:1].expand(len(feats), -1), bundle.config.env, (S, S),
                   deterministic=True)
    assert torch.equal(one.boxes, rows.boxes) and torch.equal(one.distances, rows.distances)


@pytest.mark.parametrize("use_prototype", [False, True])
def test_inference_rollout_embeds_only_the_final_box(use_prototype):
    bundle, _, feats, protos = setup(use_prototype=use_prototype)
    agent = bundle.new_agent().eval()
    full = rollout(bundle.embedder, agent, feats, protos, bundle.config.env, (S, S), deterministic=True)
    fast = rollout(bundle.embedder, agent, feats, protos, bundle.config.env, (S, S), deterministic=True,
                   rewards=False)
    assert torch.equal(fast.actions, full.actions) and torch.equal(fast.boxes, full.boxes)
    assert fast.distances.shape == full.distances.shape and fast.rewards.shape == full.rewards.shape
    if use_prototype:  # every step is embedded anyway: nothing is lost
        assert torch.allclose(fast.distances, full.distances) and torch.allclose(fast.rewards, full.rewards)
    else:
        assert bool(fast.distances[:-1].isnan().all())
        assert not bool(fast.distances[-1].isnan().any())
        assert torch.equal(fast.rewards, torch.zeros(STEPS, len(feats)))
    final = (embed_boxes(bundle, feats, full.boxes[-1]) - protos).norm(dim=-1)
    assert torch.allclose(fast.distances[-1], final, atol=1e-5)


def test_episodes_are_image_major_rows():
    bundle, _, feats, protos = setup(n=3)
    agent = bundle.new_agent().eval()
    cfg = bundle.config.env
    one = rollout(bundle.embedder, agent, feats, protos, cfg, (S, S), deterministic=True)
    many = rollout(bundle.embedder, agent, feats, protos, cfg, (S, S), deterministic=True, episodes=2)
    assert many.boxes.shape == (STEPS + 1, 6, 4)
    for i in range(3):
        for j in range(2):  # episode j of image i is row 2 i + j, on image i's features and prototype
            assert torch.equal(many.actions[:, 2 * i + j], one.actions[:, i])
            assert torch.allclose(many.distances[:, 2 * i + j], one.distances[:, i], atol=1e-5)
    with pytest.raises(ValueError, match=r"^episodes must be >= 1, got 0$"):
        rollout(bundle.embedder, agent, feats, protos, cfg, (S, S), episodes=0)


def test_deterministic_mask_is_greedy_where_true_and_sampled_elsewhere():
    bundle, _, feats, protos = setup(n=4)
    agent = bundle.new_agent().eval()
    cfg = bundle.config.env
    greedy = rollout(bundle.embedder, agent, feats, protos, cfg, (S, S), deterministic=True)
    mask = torch.tensor([True, False, True, False])
    mixed = rollout(bundle.embedder, agent, feats, protos, cfg, (S, S), deterministic=mask,
                    generator=torch.Generator().manual_seed(1))
    assert torch.equal(mixed.actions[:, mask], greedy.actions[:, mask])
    assert not torch.equal(mixed.actions[:, ~mask], greedy.actions[:, ~mask])


def test_select_actions_greedy_sampled_and_mask():
    logits = torch.randn(64, 10, generator=torch.Generator().manual_seed(0))
    assert torch.equal(select_actions(logits, True, None), logits.argmax(-1))
    got = select_actions(logits, False, torch.Generator().manual_seed(5))
    want = torch.multinomial(torch.softmax(logits, -1), 1, generator=torch.Generator().manual_seed(5))[:, 0]
    assert torch.equal(got, want) and not torch.equal(got, logits.argmax(-1))
    torch.manual_seed(5)  # without a generator: the global stream
    got_global = select_actions(logits, False, None)
    torch.manual_seed(5)
    assert torch.equal(got_global, torch.multinomial(torch.softmax(logits, -1), 1)[:, 0])
    mask = torch.arange(64) % 2 == 0
    mixed = select_actions(logits, mask, torch.Generator().manual_seed(5))
    assert torch.equal(mixed, torch.where(mask, logits.argmax(-1), want))
    # Near one-hot logits sample their peak: sampling is from softmax(logits), not uniform.
    peaked = torch.full((32, 10), -1e4)
    peaked[torch.arange(32), torch.arange(32) % 10] = 0.0
    assert torch.equal(select_actions(peaked, False, torch.Generator().manual_seed(0)), torch.arange(32) % 10)
    assert select_actions(logits.double(), False, torch.Generator().manual_seed(5)).dtype == torch.long


@pytest.mark.parametrize("use_prototype", [False, True])
@torch.no_grad()
def test_reference_adds_the_kl_of_the_action_distributions(use_prototype):
    bundle, _, feats, protos = setup(n=4, use_prototype=use_prototype)
    agent = bundle.new_agent().eval()
    cfg = bundle.config.env
    same = rollout(bundle.embedder, agent, feats, protos, cfg, (S, S), deterministic=True, reference=agent)
    assert same.kl.shape == (STEPS, 4)
    assert float(same.kl.abs().max()) < 1e-6
    other = tiny_bundle(seed=3, use_prototype=use_prototype).new_agent().eval()  # reads the same offset
    ro = rollout(bundle.embedder, agent, feats, protos, cfg, (S, S), deterministic=True, reference=other)
    ref = reference_rollout(bundle, agent, feats, protos, (S, S), reference=other)
    assert torch.allclose(ro.kl, ref["kl"], atol=1e-5)
    assert float(ro.kl.min()) > 0
    assert torch.equal(ro.actions, same.actions)  # the reference never acts


def test_kl_carries_the_agents_gradient():
    bundle, _, feats, protos = setup(n=2)
    agent = bundle.new_agent()
    other = tiny_bundle(seed=3).new_agent()
    ro = rollout(bundle.embedder, agent, feats, protos, bundle.config.env, (S, S), reference=other,
                 generator=torch.Generator().manual_seed(0))
    ro.kl.sum().backward()
    assert agent.policy.weight.grad is not None and float(agent.policy.weight.grad.abs().sum()) > 0
    assert other.policy.weight.grad is None


@torch.no_grad()
def test_env_observe_and_step_with_embedding_rewards():
    bundle, _, feats, protos = setup(n=3)
    size = (S, S - 4)
    env = BoxEnv(bundle.embedder, feats, protos, bundle.config.env, size)
    assert torch.equal(env.boxes, torch.tensor([[0.0, 0.0, S, S - 4]]).repeat(3, 1))
    roi, emb, dist = env.observe()
    assert roi.shape == (3, 64, 7, 7)
    assert torch.allclose(emb, embed_boxes(bundle, feats, env.boxes), atol=1e-5)
    assert torch.allclose(dist, (emb - protos).norm(dim=-1))
    roi2, none_emb, none_dist = env.observe(embed=False)
    assert none_emb is None and none_dist is None and torch.equal(roi2, roi)
    a = torch.tensor([0, 4, 9])
    moved = apply_actions(env.boxes, a, S, S - 4, 0.2, 8.0, 0.2)
    _, emb1, dist1, r = env.step(a, dist)
    assert torch.equal(env.boxes, moved)
    assert torch.allclose(dist1, (embed_boxes(bundle, feats, moved) - protos).norm(dim=-1), atol=1e-5)
    assert torch.allclose(r, dist - dist1)
    out = env.step(torch.tensor([1, 2, 3]), dist1, embed=False)
    assert out[1:] == (None, None, None) and out[0].shape == (3, 64, 7, 7)
    assert torch.equal(env.boxes, apply_actions(moved, torch.tensor([1, 2, 3]), S, S - 4, 0.2, 8.0, 0.2))


@torch.no_grad()
def test_env_moves_boxes_with_the_configs_alpha_min_side_and_resize():
    bundle, _, feats, protos = setup(n=4)
    cfg = EnvConfig(steps=3, alpha=0.3, min_side=20.0, resize=0.5)
    env = BoxEnv(bundle.embedder, feats, protos, cfg, (S, S))
    boxes = env.boxes.clone()
    a = torch.tensor([0, 12, 13, 4])  # shrink, narrower, shorter, shrink to the centre: down to min_side
    for _ in range(3):
        boxes = apply_actions(boxes, a, S, S, 0.3, 20.0, 0.5)
        env.step(a, torch.zeros(4))
        assert torch.equal(env.boxes, boxes)
    sides = env.boxes[:, 2:] - env.boxes[:, :2]
    assert torch.equal(sides[0], torch.tensor([20.0, 20.0])) and torch.equal(sides[1], torch.tensor([20.0, 32.0]))


@torch.no_grad()
def test_env_iou_rewards_with_episodes():
    bundle, _, feats, protos = setup(n=2)
    gt = torch.tensor([[0.0, 0.0, 12.0, 12.0], [20.0, 20.0, 32.0, 32.0]])
    for kind in ("iou", "iou_sign"):
        env = BoxEnv(bundle.embedder, feats, protos, bundle.config.env, (S, S), reward=kind, gt_boxes=gt, episodes=2)
        before = env.boxes.clone()
        a = torch.tensor([0, 3, 0, 3])  # image 0: shrink to its top-left (toward its gt), then away; image 1 too
        _, _, _, r = env.step(a, torch.zeros(4))
        rows_gt = gt.repeat_interleave(2, 0)
        gain = paired_iou(env.boxes, rows_gt) - paired_iou(before, rows_gt)
        want = gain if kind == "iou" else torch.sign(gain)
        assert torch.allclose(r, want)
        assert bool((gain[[0, 3]] > 0).all()) and bool((gain[[1, 2]] < 0).all())
    ro = rollout(bundle.embedder, bundle.new_agent(), feats, protos, bundle.config.env, (S, S), reward="iou_sign",
                 gt_boxes=gt, generator=torch.Generator().manual_seed(0))
    assert set(ro.rewards.unique().tolist()) <= {-1.0, 0.0, 1.0}


def test_env_validates_reward_kind_and_ground_truth():
    bundle, _, feats, protos = setup(n=2)
    cfg = bundle.config.env
    with pytest.raises(ValueError) as e:
        BoxEnv(bundle.embedder, feats, protos, cfg, (S, S), reward="distance")
    assert str(e.value) == "reward must be one of ('embedding', 'iou', 'iou_sign'), got 'distance'"
    for kind in ("iou", "iou_sign"):
        with pytest.raises(ValueError) as e:
            BoxEnv(bundle.embedder, feats, protos, cfg, (S, S), reward=kind)
        assert str(e.value) == f"the {kind!r} reward needs ground-truth boxes"
    with pytest.raises(ValueError) as e:
        BoxEnv(bundle.embedder, feats, protos, cfg, (S, S), episodes=0)
    assert str(e.value) == "episodes must be >= 1, got 0"
    assert BoxEnv(bundle.embedder, feats, protos, cfg, (S, S), episodes=1).boxes.shape == (2, 4)
    assert BoxEnv(bundle.embedder, feats, protos, cfg, (S, S), reward="embedding").reward_kind == "embedding"


# -------------------------------------------------------------------------------------------- search


@pytest.mark.parametrize("samples", [1, 5])
def test_search_keeps_per_image_the_episode_with_the_nearest_final_box(samples):
    bundle, _, feats, protos = setup(n=4)
    agent = bundle.new_agent().eval()
    cfg, e = bundle.config.env, samples + 1
    mask = torch.arange(4 * e) % e == 0
    full = rollout(bundle.embedder, agent, feats, protos, cfg, (S, S), deterministic=mask, episodes=e,
                   generator=torch.Generator().manual_seed(2))
    out = search(bundle.embedder, agent, feats, protos, cfg, (S, S), e - 1, torch.Generator().manual_seed(2))
    assert out.boxes.shape == (STEPS + 1, 4, 4) and out.actions.shape == (STEPS, 4) and out.kl is None
    picked = []
    for i in range(4):
        rows = list(range(i * e, (i + 1) * e))
        j = rows[int(full.distances[-1, rows].argmin())]
        picked.append(j - i * e)
        assert torch.equal(out.boxes[:, i], full.boxes[:, j])
        assert torch.equal(out.actions[:, i], full.actions[:, j])
        assert torch.allclose(out.log_probs[:, i], full.log_probs[:, j])
        assert torch.allclose(out.distances[-1, i], full.distances[-1, rows].min(), atol=1e-5)
    assert any(p != 0 for p in picked)  # sampling did find better boxes somewhere
    assert bool(out.distances[:-1].isnan().all()) and torch.equal(out.rewards, torch.zeros(STEPS, 4))
    greedy = rollout(bundle.embedder, agent, feats, protos, cfg, (S, S), deterministic=True, rewards=False)
    assert bool((out.distances[-1] <= greedy.distances[-1] + 1e-6).all())


def test_search_without_samples_is_the_greedy_inference_rollout():
    bundle, _, feats, protos = setup(n=3)
    agent = bundle.new_agent().eval()
    cfg = bundle.config.env
    greedy = rollout(bundle.embedder, agent, feats, protos, cfg, (S, S), deterministic=True, rewards=False)
    out = search(bundle.embedder, agent, feats, protos, cfg, (S, S), 0)
    assert torch.equal(out.boxes, greedy.boxes) and torch.equal(out.actions, greedy.actions)
    assert bool(out.distances[:-1].isnan().all()) and torch.equal(out.distances[-1], greedy.distances[-1])
    with pytest.raises(ValueError) as e:
        search(bundle.embedder, agent, feats, protos, cfg, (S, S), -1)
    assert str(e.value) == "samples must be >= 0, got -1"


def _constant_embedder_bundle():
    """Every box embeds to the same vector: every distance ties."""
    bundle, x, feats, protos = setup(n=3)
    with torch.no_grad():
        bundle.embedder.head.net[-1].weight.zero_()
    return bundle, feats, protos


@torch.no_grad()
def test_search_ties_keep_the_greedy_episode():
    bundle, feats, protos = _constant_embedder_bundle()
    agent = bundle.new_agent().eval()
    cfg = bundle.config.env
    greedy = rollout(bundle.embedder, agent, feats, protos, cfg, (S, S), deterministic=True)
    assert bool((greedy.distances == greedy.distances[:1]).all())  # all tie
    out = search(bundle.embedder, agent, feats, protos, cfg, (S, S), 5, torch.Generator().manual_seed(0))
    assert torch.equal(out.boxes, greedy.boxes) and torch.equal(out.actions, greedy.actions)
    # nearest: ties keep the earliest step (1) of the greedy episode, then stay there
    near = search(bundle.embedder, agent, feats, protos, cfg, (S, S), 5, torch.Generator().manual_seed(0),
                  nearest=True)
    assert torch.equal(near.boxes[:2], greedy.boxes[:2])
    assert bool((near.boxes[1:] == greedy.boxes[1][None]).all())
    assert torch.equal(near.actions, greedy.actions)
    assert not torch.equal(near.boxes[-1], greedy.boxes[-1])


@pytest.mark.parametrize("samples", [0, 3])
def test_nearest_answers_with_the_visited_box_nearest_the_prototype(samples):
    bundle, _, feats, protos = setup(n=4, seed=1)
    agent = bundle.new_agent().eval()
    cfg, e = bundle.config.env, samples + 1
    full = rollout(bundle.embedder, agent, feats, protos, cfg, (S, S), episodes=e,
                   deterministic=torch.arange(4 * e) % e == 0, generator=torch.Generator().manual_seed(4))
    out = search(bundle.embedder, agent, feats, protos, cfg, (S, S), samples, torch.Generator().manual_seed(4),
                 nearest=True)
    assert out.boxes.shape == (STEPS + 1, 4, 4) and out.distances.shape == (STEPS + 1, 4)
    stops = []
    for i in range(4):
        best = None
        for t in range(1, STEPS + 1):  # the slow way; boxes after step 1, earlier steps and episodes win ties
            for j in range(e):
                d = float(full.distances[t, i * e + j])
                if best is None or d < best[0]:
                    best = (d, t, i * e + j)
        d, t, row = best
        stops.append(t)
        assert torch.equal(out.boxes[:t + 1, i], full.boxes[:t + 1, row])
        assert bool((out.boxes[t:, i] == full.boxes[t, row]).all())
        assert torch.allclose(out.distances[:t + 1, i], full.distances[:t + 1, row])
        assert bool((out.distances[t:, i] == full.distances[t, row]).all())
        assert torch.equal(out.actions[:, i], full.actions[:, row])
        assert torch.allclose(out.rewards[:, i], full.rewards[:, row])
    assert any(t < STEPS for t in stops)  # some answers stop early: the later steps are really replaced
    assert min(stops) >= 1


# ----------------------------------------------------------------------------------------- inference


def test_resolve_device(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto") == torch.device(want)
    assert resolve_device() == torch.device(want)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu") == resolve_device()
    for name in ("cuda", "cuda:0"):
        with pytest.raises(ValueError) as e:
            resolve_device(name)
        assert str(e.value) == "device 'cuda' was asked for but CUDA is not available; use 'auto' or 'cpu'"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (a device object needs no GPU)
    assert resolve_device("auto") == torch.device("cuda") == resolve_device()
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    assert resolve_device("cpu") == torch.device("cpu")


def test_pil_to_tensor_grayscale_and_rgb():
    rgb = np.zeros((2, 3, 3), dtype=np.uint8)  # h=2, w=3
    rgb[..., 0] = [[10, 20, 30], [40, 50, 60]]
    rgb[..., 1] = 100
    rgb[..., 2] = 255
    t = pil_to_tensor(Image.fromarray(rgb, "RGB"), 3)
    assert t.shape == (3, 2, 3) and t.dtype == torch.float32
    assert torch.equal(t, torch.from_numpy(rgb).permute(2, 0, 1).float() / 255.0)
    gray = np.array([[0, 51, 255], [102, 153, 204]], dtype=np.uint8)
    g = pil_to_tensor(Image.fromarray(gray, "L"), 1)
    assert g.shape == (1, 2, 3) and torch.equal(g[0], torch.from_numpy(gray).float() / 255.0)
    # RGB uploads to a grayscale bundle: PIL's luminance
    lum = np.asarray(Image.fromarray(rgb, "RGB").convert("L"), dtype=np.float32) / 255.0
    assert torch.equal(pil_to_tensor(Image.fromarray(rgb, "RGB"), 1)[0], torch.from_numpy(lum))
    # grayscale uploads to an RGB bundle: three equal channels
    g3 = pil_to_tensor(Image.fromarray(gray, "L"), 3)
    assert g3.shape == (3, 2, 3) and all(torch.equal(g3[c], g[0]) for c in range(3))


def test_pil_to_tensor_scales_16_bit_grayscale():
    """16-bit grayscale (``I;16``, as a 16-bit PNG opens) maps 0..65535 onto [0, 1] like its 8-bit version, where
    PIL's conversion would clip everything above 255 to white (``to_8bit``)."""
    gray = np.array([[0, 51, 255], [102, 153, 204]], dtype=np.uint8)
    sixteen = Image.fromarray(gray.astype(np.uint16) * 257)
    assert sixteen.mode == "I;16"
    assert torch.equal(pil_to_tensor(sixteen, 1), pil_to_tensor(Image.fromarray(gray, "L"), 1))
    assert torch.equal(pil_to_tensor(sixteen, 3), pil_to_tensor(Image.fromarray(gray, "L"), 3))
    assert np.array_equal(np.asarray(to_8bit(Image.fromarray(np.array([[0, 128, 65535]], np.uint16)))), [[0, 0, 255]])
    as_int32 = Image.fromarray(gray.astype(np.int32) * 257)  # mode I: scaled only when told it holds 16 bits
    assert to_8bit(as_int32) is as_int32
    assert np.array_equal(np.asarray(to_8bit(as_int32, int32_is_16bit=True)), gray)


def _rgba(alpha):
    arr = np.zeros((2, 2, 4), dtype=np.uint8)
    arr[..., 0], arr[..., 1], arr[..., 2] = 200, 40, 120
    arr[..., 3] = alpha
    return Image.fromarray(arr, "RGBA")


def test_pil_to_tensor_composites_transparency_onto_fill():
    img = _rgba(np.array([[0, 255], [0, 255]], dtype=np.uint8))
    t = pil_to_tensor(img, 3, (0.2, 0.4, 0.6))
    assert torch.allclose(t[:, :, 0], torch.tensor([[51.0, 51.0], [102.0, 102.0], [153.0, 153.0]]) / 255)
    assert torch.allclose(t[:, :, 1], torch.tensor([[200.0, 200.0], [40.0, 40.0], [120.0, 120.0]]) / 255)
    # one fill value serves every channel
    one = pil_to_tensor(img, 3, (0.6,))
    assert torch.allclose(one[:, :, 0], torch.full((3, 2), 153.0 / 255))
    assert torch.allclose(pil_to_tensor(img, 3)[:, :, 0], torch.zeros(3, 2))  # default: black
    # grayscale bundle: the composite's luminance
    g = pil_to_tensor(img, 1, (1.0,))
    assert torch.allclose(g[0, :, 0], torch.ones(2))
    opaque_l = np.asarray(Image.fromarray(np.full((1, 1, 3), [200, 40, 120], np.uint8), "RGB").convert("L"))
    assert torch.allclose(g[0, :, 1], torch.full((2,), float(opaque_l[0, 0]) / 255))
    # half transparent: the alpha blend
    half = pil_to_tensor(_rgba(np.full((2, 2), 128, np.uint8)), 3, (1.0, 1.0, 1.0))
    want = (torch.tensor([200.0, 40.0, 120.0]) * 128 + 255.0 * 127) / 255 / 255
    assert torch.allclose(half[:, 0, 0], want, atol=1.5 / 255)
    # LA, PA and P-with-transparency uploads are composited too
    la = Image.fromarray(np.array([[[90, 0], [90, 255]]], dtype=np.uint8), "LA")
    assert torch.allclose(pil_to_tensor(la, 1, (0.6,))[0, 0], torch.tensor([153.0, 90.0]) / 255)
    p = Image.new("P", (2, 1))
    p.putpalette([0, 0, 0, 250, 250, 250] + [0] * 762)
    p.putpixel((0, 0), 0)
    p.putpixel((1, 0), 1)
    p.info["transparency"] = 0
    assert torch.allclose(pil_to_tensor(p, 1, (0.6,))[0, 0], torch.tensor([153.0, 250.0]) / 255)
    pa = p.convert("PA")
    assert pa.mode == "PA"
    assert torch.allclose(pil_to_tensor(pa, 1, (0.6,))[0, 0], torch.tensor([153.0, 250.0]) / 255)


def test_normalize_per_channel():
    spec = InputSpec(channels=3, mean=(0.1, 0.5, 0.9), std=(0.5, 0.25, 2.0))
    x = torch.rand(2, 3, 4, 5, generator=torch.Generator().manual_seed(0))
    got = normalize(x, spec)
    for c in range(3):
        assert torch.allclose(got[:, c], (x[:, c] - spec.mean[c]) / spec.std[c])
    assert got.dtype == x.dtype
    x64 = x.double()  # computed in the input's precision: mean and std are not rounded to float32
    got64 = normalize(x64, spec)
    assert got64.dtype == torch.float64
    for c in range(3):
        assert torch.allclose(got64[:, c], (x64[:, c] - spec.mean[c]) / spec.std[c], rtol=0, atol=1e-12)
    assert normalize(x.half(), spec).dtype == torch.float16


def test_resize_batch_scales_and_passes_through_at_size():
    at = torch.rand(1, S, S, generator=torch.Generator().manual_seed(0))
    wide = torch.rand(1, 20, 48, generator=torch.Generator().manual_seed(1))  # h=20, w=48 (down in x, up in y)
    small = torch.rand(1, 16, 16, generator=torch.Generator().manual_seed(2))
    batch, scales = resize_batch([at, wide, small], S)
    assert batch.shape == (3, 1, S, S)
    assert torch.equal(batch[0], at)
    assert torch.equal(scales, torch.tensor([[1.0, 1.0], [48 / S, 20 / S], [0.5, 0.5]]))
    assert scales.dtype == torch.float32
    for got, im in ((batch[1], wide), (batch[2], small)):
        want = F.interpolate(im[None], size=(S, S), mode="bilinear", antialias=True, align_corners=False)[0]
        assert torch.allclose(got, want.clamp(0, 1))
    big = torch.rand(1, 64, 64, generator=torch.Generator().manual_seed(3))
    down, _ = resize_batch([big], S)
    no_aa = F.interpolate(big[None], size=(S, S), mode="bilinear", antialias=False, align_corners=False)
    assert not torch.allclose(down, no_aa, atol=1e-3)  # antialiased downsampling
    assert torch.allclose(down, F.interpolate(big[None], size=(S, S), mode="bilinear", antialias=True))
    # values are clamped to [0, 1] after a resize; an image already at size passes untouched
    wild = torch.rand(1, 10, 50, generator=torch.Generator().manual_seed(4)) * 3 - 1  # in [-1, 2]
    at_wild = torch.rand(1, S, S, generator=torch.Generator().manual_seed(5)) * 3 - 1
    out, _ = resize_batch([wild, at_wild], S)
    want = F.interpolate(wild[None], size=(S, S), mode="bilinear", antialias=True, align_corners=False)[0]
    assert float(want.min()) < 0 and float(want.max()) > 1
    assert torch.allclose(out[0], want.clamp(0, 1))
    assert torch.equal(out[1], at_wild)
    # a non-square image at the right height is still resized
    tall, sc = resize_batch([torch.rand(1, S, 16)], S)
    assert tall.shape == (1, 1, S, S) and torch.equal(sc, torch.tensor([[0.5, 1.0]]))


@pytest.fixture
def float64_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def test_preprocessing_is_float32_whatever_the_default_dtype(float64_default):
    _, scales = resize_batch([torch.rand(1, 20, 48, dtype=torch.float32)], S)
    assert scales.dtype == torch.float32
    canvases, boxes = exemplar_canvas([torch.rand(3, 5, 7, dtype=torch.float32)],
                                      InputSpec(channels=3, size=S, exemplar_size=12, fill=(0.1, 0.5, 0.9)))
    assert canvases.dtype == torch.float32 and boxes.dtype == torch.float32


def test_exemplar_canvas_keeps_aspect_and_centres():
    spec = InputSpec(channels=3, size=S, exemplar_size=12, fill=(0.1, 0.5, 0.9))
    wide = torch.rand(3, 6, 24, generator=torch.Generator().manual_seed(0))  # h=6, w=24 -> 3 x 12
    exact = torch.rand(3, 12, 9, generator=torch.Generator().manual_seed(1))  # already fits on its long side
    line = torch.rand(3, 1, 60, generator=torch.Generator().manual_seed(2))  # -> 1 x 12 (at least one pixel)
    hot = torch.full((3, 12, 12), 1.5)  # out of range: clamped
    hot[:, :6] = -0.5
    pole = torch.rand(3, 60, 1, generator=torch.Generator().manual_seed(3))  # -> 12 x 1
    canvases, boxes = exemplar_canvas([wide, exact, line, hot, pole], spec)
    assert canvases.shape == (5, 3, S, S)
    assert torch.equal(boxes, torch.tensor([[10.0, 14.0, 22.0, 17.0], [11.0, 10.0, 20.0, 22.0],
                                            [10.0, 15.0, 22.0, 16.0], [10.0, 10.0, 22.0, 22.0],
                                            [15.0, 10.0, 16.0, 22.0]]))
    assert boxes.dtype == torch.float32
    fill = torch.tensor(spec.fill).view(3, 1, 1)
    small = F.interpolate(wide[None], size=(3, 12), mode="bilinear", antialias=True, align_corners=False)[0]
    assert torch.allclose(canvases[0, :, 14:17, 10:22], small.clamp(0, 1))
    assert torch.equal(canvases[1, :, 10:22, 11:20], exact)
    lined = F.interpolate(line[None], size=(1, 12), mode="bilinear", antialias=True, align_corners=False)[0]
    assert torch.allclose(canvases[2, :, 15:16, 10:22], lined.clamp(0, 1))
    assert torch.equal(canvases[3, :, 10:22, 10:22], (hot > 0).float())
    for i, (x1, y1, x2, y2) in enumerate(boxes.long().tolist()):
        outside = torch.ones(S, S, dtype=torch.bool)
        outside[y1:y2, x1:x2] = False
        assert torch.equal(canvases[i][:, outside], fill.view(3, 1).expand(3, int(outside.sum())))
    gray, gboxes = exemplar_canvas([torch.rand(1, 5, 5)], InputSpec(size=S, exemplar_size=12))
    assert gray.shape == (1, 1, S, S) and torch.equal(gboxes, torch.tensor([[10.0, 10.0, 22.0, 22.0]]))


def _crops():
    g = torch.Generator().manual_seed(11)
    return [torch.rand(1, 10, 10, generator=g), torch.rand(1, 6, 14, generator=g), torch.rand(1, 18, 7, generator=g)]


@torch.no_grad()
def test_embed_crops_embeds_each_pasted_crop():
    bundle = tiny_bundle()
    loc = Localizer(bundle, "cpu")
    crops = _crops()
    emb = loc.embed_crops(crops)
    assert emb.shape == (3, 16)
    canvases, boxes = exemplar_canvas(crops, bundle.config.input)
    feats = bundle.embedder.features(normalize(canvases, bundle.config.input))
    for i in range(3):
        want = bundle.embedder.embed(feats[i:i + 1], boxes[i].view(1, 1, 4))[0, 0]
        assert torch.allclose(emb[i], want, atol=1e-5)
    assert not torch.allclose(emb[0], emb[1]) and not torch.allclose(emb[1], emb[2])


def test_prototype_is_the_mean_embedding_of_several_crops():
    bundle = tiny_bundle()
    loc = Localizer(bundle, "cpu")
    crops = _crops()
    emb = loc.embed_crops(crops)
    proto = loc.prototype(crops)
    assert proto.shape == (16,) and proto.device.type == "cpu"
    assert torch.allclose(proto, emb.mean(0), atol=1e-6)
    assert torch.allclose(proto, (emb[0] + emb[1] + emb[2]) / 3, atol=1e-6)
    for row in emb:  # the mean, not one crop's embedding
        assert not torch.allclose(proto, row, atol=1e-3)
    assert not torch.allclose(proto, emb.sum(0), atol=1e-3)
    # independently: embed each crop alone
    single = torch.stack([loc.prototype([c]) for c in crops])
    assert torch.allclose(single, emb, atol=1e-5)
    assert torch.allclose(proto, single.mean(0), atol=1e-5)
    # PIL crops give the same prototype as their tensors
    pil = [Image.fromarray((c[0].numpy() * 255).round().astype(np.uint8), "L") for c in crops]
    as_tensors = [pil_to_tensor(p, 1) for p in pil]
    assert torch.allclose(loc.prototype(pil), loc.prototype(as_tensors), atol=1e-6)
    assert torch.allclose(loc.prototype(pil), proto, atol=0.05 * float(proto.abs().max()))
    with pytest.raises(ValueError) as e:
        loc.prototype([])
    assert str(e.value) == "a prototype needs at least one exemplar crop"


def test_prototype_of_rgba_pil_crops_uses_the_bundle_fill():
    bundle = tiny_bundle(channels=3)
    loc = Localizer(bundle, "cpu")
    img = _rgba(np.array([[0, 255], [255, 0]], dtype=np.uint8)).resize((8, 8), Image.NEAREST)
    want = loc.prototype([pil_to_tensor(img, 3, bundle.config.input.fill)])
    assert torch.allclose(loc.prototype([img]), want, atol=1e-6)
    assert not torch.allclose(loc.prototype([pil_to_tensor(img, 3)]), want, atol=1e-4)


def test_localizer_agent_loads_the_state_in_eval_mode():
    bundle = tiny_bundle()
    loc = Localizer(bundle, "cpu")
    base = loc.agent()
    assert not base.training
    assert all(torch.equal(v, bundle.agent_state[k]) for k, v in base.state_dict().items())
    other = tiny_bundle(seed=5).agent_state
    adapted = loc.agent(other)
    assert all(torch.equal(v, other[k]) for k, v in adapted.state_dict().items())
    assert loc.device == torch.device("cpu") and loc.spec is bundle.config.input
    assert Localizer(bundle, torch.device("cpu")).device == torch.device("cpu")
    assert Localizer(tiny_bundle()).device == resolve_device("auto")  # the default: "auto"
    assert not loc.embedder.training


def test_default_nearest_follows_the_bundles_answer():
    assert Localizer(tiny_bundle(answer="nearest"), "cpu").default_nearest is True
    assert Localizer(tiny_bundle(answer="last"), "cpu").default_nearest is False


@torch.no_grad()
def test_run_follows_the_bundle_default_and_the_override():
    bundle, x, feats, protos = setup(n=3, answer="nearest")
    loc = Localizer(bundle, "cpu")
    agent = loc.agent()
    p, cfg = protos[0], bundle.config.env
    near = search(bundle.embedder, agent, feats, p, cfg, (S, S), 0, nearest=True)
    last = rollout(bundle.embedder, agent, feats, p, cfg, (S, S), deterministic=True, rewards=False)
    assert not torch.equal(near.boxes, last.boxes)
    assert torch.equal(loc.run(x, p, agent).boxes, near.boxes)
    assert torch.equal(loc.run(x, p, agent, nearest=False).boxes, last.boxes)
    # with rewards (or sampling), the default stays the last box
    full = loc.run(x, p, agent, rewards=True)
    assert torch.equal(full.boxes, last.boxes) and not bool(full.distances.isnan().any())
    sampled = loc.run(x, p, agent, deterministic=False, generator=torch.Generator().manual_seed(3))
    want = rollout(bundle.embedder, agent, feats, p, cfg, (S, S), generator=torch.Generator().manual_seed(3),
                   rewards=False)
    assert torch.equal(sampled.actions, want.actions)
    for kw in ({"deterministic": False}, {"rewards": True}):
        for extra in ({"samples": 2}, {"nearest": True}):
            with pytest.raises(ValueError) as e:
                loc.run(x, p, agent, **kw, **extra)
            assert str(e.value) == "samples (best-of-N search) and nearest are for greedy inference without rewards"


@torch.no_grad()
def test_run_best_of_n_defaults_to_seed_zero():
    bundle, x, feats, protos = setup(n=3)
    loc = Localizer(bundle, "cpu")
    agent = loc.agent()
    p = protos[1]
    got = loc.run(x, p, agent, samples=4)
    want = search(bundle.embedder, agent, feats, p, bundle.config.env, (S, S), 4, torch.Generator().manual_seed(0))
    assert torch.equal(got.boxes, want.boxes) and torch.equal(got.actions, want.actions)
    seeded = loc.run(x, p, agent, samples=4, generator=torch.Generator().manual_seed(9))
    want9 = search(bundle.embedder, agent, feats, p, bundle.config.env, (S, S), 4, torch.Generator().manual_seed(9))
    assert torch.equal(seeded.actions, want9.actions) and not torch.equal(seeded.actions, got.actions)


@torch.no_grad()
def test_localize_maps_boxes_back_to_the_uploaded_pixels():
    bundle = tiny_bundle()
    loc = Localizer(bundle, "cpu")
    uploads = [images(1, seed=4, size=20, width=48)[0], images(1, seed=5, size=40, width=24)[0], images(1, seed=6)[0]]
    proto = loc.prototype(_crops())
    res = loc.localize(uploads, proto, trajectory=True)
    batch, scales = resize_batch(uploads, S)
    ro = loc.run(batch, proto, loc.agent())
    assert len(res) == 3 and all(isinstance(r, Localization) for r in res)
    for i, (sx, sy) in enumerate([(48 / S, 20 / S), (24 / S, 40 / S), (1.0, 1.0)]):
        k = torch.tensor([sx, sy, sx, sy])
        want = ro.boxes[:, i] * k
        assert len(res[i].trajectory) == STEPS + 1
        assert torch.allclose(torch.tensor(res[i].trajectory), want, atol=1e-4)
        assert torch.allclose(torch.tensor(res[i].box), want[-1], atol=1e-4) and res[i].box == res[i].trajectory[-1]
        assert res[i].score == pytest.approx(float(ro.distances[-1, i]), abs=1e-5)
        assert all(isinstance(v, float) for v in res[i].box) and isinstance(res[i].score, float)
    assert res[0].trajectory[0] == (0.0, 0.0, 48.0, 20.0) and res[1].trajectory[0] == (0.0, 0.0, 24.0, 40.0)
    assert all(r.box != r.trajectory[0] for r in res[:2])  # the non-square uploads' boxes did move
    plain = loc.localize(uploads, proto)
    assert [r.box for r in plain] == [r.box for r in res] and all(r.trajectory is None for r in plain)
    # PIL uploads take the same path
    pil = [Image.fromarray((u[0].numpy() * 255).round().astype(np.uint8), "L") for u in uploads]
    from_pil = loc.localize(pil, proto)
    want_pil = loc.localize([pil_to_tensor(im, 1) for im in pil], proto)
    assert [r.box for r in from_pil] == [r.box for r in want_pil]
    # an adapted agent state is used
    other = tiny_bundle(seed=5).agent_state
    ro_other = loc.run(batch, proto, loc.agent(other))
    got_other = loc.localize(uploads, proto, other)
    assert got_other[0].box == pytest.approx(tuple(float(v) for v in ro_other.boxes[-1, 0] * k.new_tensor(
        [48 / S, 20 / S, 48 / S, 20 / S])), abs=1e-4)


@torch.no_grad()
def test_localize_seeding_is_deterministic():
    bundle = tiny_bundle()
    loc = Localizer(bundle, "cpu")
    uploads = list(images(4, seed=8))
    proto = loc.prototype(_crops())
    agent = loc.agent()
    batch = torch.stack(uploads)

    def boxes_of(res):
        return torch.tensor([r.box for r in res])

    sampled = boxes_of(loc.localize(uploads, proto, deterministic=False, seed=3))
    assert torch.equal(sampled, boxes_of(loc.localize(uploads, proto, deterministic=False, seed=3)))
    want = loc.run(batch, proto, agent, deterministic=False, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(sampled, want.boxes[-1])
    default = boxes_of(loc.localize(uploads, proto, deterministic=False))
    want0 = loc.run(batch, proto, agent, deterministic=False, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(default, want0.boxes[-1]) and not torch.equal(default, sampled)
    best = boxes_of(loc.localize(uploads, proto, samples=3, seed=6))
    assert torch.allclose(best, loc.run(batch, proto, agent, samples=3,
                                        generator=torch.Generator().manual_seed(6)).boxes[-1])
    best0 = boxes_of(loc.localize(uploads, proto, samples=3))
    assert torch.allclose(best0, loc.run(batch, proto, agent, samples=3).boxes[-1])
    assert not torch.equal(best0, best)
    greedy = boxes_of(loc.localize(uploads, proto, seed=6))
    assert torch.allclose(greedy, loc.run(batch, proto, agent).boxes[-1])
    near = boxes_of(loc.localize(uploads, proto, nearest=True))
    assert torch.allclose(near, loc.run(batch, proto, agent, nearest=True).boxes[-1])
    assert not torch.equal(near, greedy)


def test_localize_uses_the_bundle_default_answer():
    bundle = tiny_bundle(answer="nearest")
    loc = Localizer(bundle, "cpu")
    uploads = list(images(4, seed=8))
    proto = loc.prototype(_crops())
    default = [r.box for r in loc.localize(uploads, proto)]
    assert default == [r.box for r in loc.localize(uploads, proto, nearest=True)]
    assert default != [r.box for r in loc.localize(uploads, proto, nearest=False)]
    cfg = dataclasses.replace(bundle.config.env, answer="last")
    assert Localizer(dataclasses.replace(bundle, config=dataclasses.replace(bundle.config, env=cfg)),
                     "cpu").default_nearest is False


@torch.no_grad()
def test_localize_composites_transparent_uploads_onto_the_bundle_fill():
    bundle = tiny_bundle(channels=3)
    loc = Localizer(bundle, "cpu")
    arr = (images(1, channels=3, seed=2)[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    alpha = np.full(arr.shape[:2], 255, np.uint8)
    alpha[:, :10] = 0  # a transparent left border
    img = Image.fromarray(np.dstack([arr, alpha]), "RGBA")
    proto = loc.prototype([torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(0))])
    [got] = loc.localize([img], proto)
    [want] = loc.localize([pil_to_tensor(img, 3, bundle.config.input.fill)], proto)
    [black] = loc.localize([pil_to_tensor(img, 3)], proto)
    assert got.box == want.box and got.score == pytest.approx(want.score, abs=1e-6)
    assert black.score != pytest.approx(want.score, abs=1e-4)


@torch.no_grad()
def test_localize_seeds_even_a_single_sample():
    bundle = tiny_bundle()
    loc = Localizer(bundle, "cpu")
    uploads = list(images(6, seed=8))
    batch = torch.stack(uploads)
    proto = loc.prototype(_crops())
    agent = loc.agent()
    got = {s: torch.tensor([r.box for r in loc.localize(uploads, proto, samples=1, seed=s)]) for s in (0, 1, 2)}
    for s, boxes in got.items():
        want = loc.run(batch, proto, agent, samples=1, generator=torch.Generator().manual_seed(s)).boxes[-1]
        assert torch.allclose(boxes, want)
    assert not torch.equal(got[0], got[1]) or not torch.equal(got[0], got[2])


@pytest.mark.filterwarnings("ignore::UserWarning")
@torch.no_grad()
def test_every_tensor_stays_on_the_features_device():
    """The meta device stands in for an accelerator: a tensor made on the CPU by mistake fails to mix."""
    validate = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)  # validation reads values; meta has none
    try:
        bundle, x, feats, protos = setup(n=3)
        agent = bundle.new_agent().eval()
        meta = torch.device("meta")
        embedder, agent, f, p = bundle.embedder.to(meta), agent.to(meta), feats.to(meta), protos.to(meta)
        cfg = bundle.config.env
        for kw in ({"rewards": False}, {"reference": agent, "episodes": 2}, {"deterministic": False}):
            ro = rollout(embedder, agent, f, p, cfg, (S, S), **{"deterministic": True, **kw})
            fields = [t for t in ro if t is not None]
            assert all(t.device == meta for t in fields)
            assert ro.boxes.shape[:2] == ro.distances.shape[:2]
        for samples, nearest in ((0, True), (2, False), (2, True)):
            out = search(embedder, agent, f, p, cfg, (S, S), samples, None, nearest=nearest)
            assert out.boxes.device == meta and out.distances.device == meta
            assert out.boxes.shape == (STEPS + 1, 3, 4)
        loc = Localizer(tiny_bundle(), meta)  # a bundle still on the CPU: the Localizer moves it
        assert loc.device == meta and next(loc.embedder.parameters()).device == meta
        assert next(loc.agent().parameters()).device == meta
        for nearest in (False, True):
            assert loc.run(x, protos[0], loc.agent(), nearest=nearest).boxes.device == meta
    finally:
        torch.distributions.Distribution.set_default_validate_args(validate)


@pytest.mark.parametrize("mode,key,pixel", [("RGB", (0, 0, 0), [10, 20, 30]), ("L", 0, 77)])
def test_pil_to_tensor_honours_a_colour_key(mode, key, pixel):
    """A PNG whose transparency is a colour key (tRNS on an RGB or grayscale image, no alpha band): the
    keyed pixels are put on the fill, as an alpha PNG's transparent ones are."""
    arr = np.zeros((2, 2, 3) if mode == "RGB" else (2, 2), dtype=np.uint8)
    arr[0, 0] = pixel
    buf = io.BytesIO()
    Image.fromarray(arr, mode).save(buf, "PNG", transparency=key)
    img = Image.open(io.BytesIO(buf.getvalue()))
    assert "transparency" in img.info and img.mode == mode
    t = pil_to_tensor(img, 3, (1.0, 0.5, 0.0))
    assert torch.allclose(t[:, 1, 1], torch.tensor([1.0, 128 / 255, 0.0]))  # keyed: the fill
    kept = torch.tensor(pixel if mode == "RGB" else [pixel] * 3, dtype=torch.float32) / 255
    assert torch.allclose(t[:, 0, 0], kept)  # not keyed: its own colour
