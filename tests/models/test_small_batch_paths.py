"""The batch-1 fast paths of inference (issue 12's latency floors) give the very numbers of the code they replace.

``apply_actions`` looks each row's action up in tables: its boxes must be bit-identical to every action's own
formula (the per-action reference below, the previous implementation). The agent calls its layers' functions,
RoIAlign its CPU op, and an inference rollout takes its log-probabilities after the loop: each is pinned to the
module / wrapper / per-step computation it stands for.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torchvision.ops import roi_align

from models.bundle import new_bundle
from models.config import AgentConfig, EnvConfig, HeadConfig, InputSpec, ModelConfig
from models.core.actions import PHOTO_ACTIONS, apply_actions
from models.inference import normalize
from models.nets.agent import Agent
from models.nets.embedding import batched_rois
from models.rollout import rollout

S = 32  # input side of a tiny bundle (32 x 32 inputs, a 16-d embedding, 4 steps)


def setup(n, use_prototype=False):
    """(a tiny bundle with lively agent weights, images, their features, one prototype per image)."""
    cfg = ModelConfig(
        input=InputSpec(channels=1, size=S, mean=(0.1307,), std=(0.3081,), exemplar_size=12, fill=(0.0,)),
        head=HeadConfig(in_features=64 * 7 * 7, hidden=32, out_features=16, dropout=0.0),
        agent=AgentConfig(conv_channels=4, hidden=8, use_prototype=use_prototype, embed_dim=16),
        env=EnvConfig(steps=4, alpha=0.2, min_side=8.0, resize=0.2))
    bundle = new_bundle("tiny", cfg, 0)
    g = torch.Generator().manual_seed(0)
    bundle.agent_state = {k: torch.randn(v.shape, generator=g) * (3.0 / v[0].numel() ** 0.5 if v.dim() > 1 else 0.1)
                          for k, v in bundle.agent_state.items()}  # actions that differ between images and steps
    x = torch.rand(n, 1, S, S, generator=g)
    with torch.no_grad():
        feats = bundle.embedder.features(normalize(x, cfg.input))
    return bundle, x, feats, torch.randn(n, 16, generator=g)


def reference_actions(boxes: Tensor, actions: Tensor, width: float, height: float, alpha: float = 0.2,
                      min_side: float = 28.0, resize: float = 0.2) -> Tensor:
    """Every action's outcome written out as in PAPER.md, then the chosen one gathered (the old implementation)."""
    x1, y1, x2, y2 = boxes.unbind(-1)
    w, h = x2 - x1, y2 - y1
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    sw = torch.maximum(w * (1 - alpha), torch.minimum(w, torch.full_like(w, min_side)))
    sh = torch.maximum(h * (1 - alpha), torch.minimum(h, torch.full_like(h, min_side)))
    dx, dy = alpha * w, alpha * h

    def centred(nw, nh):
        nw, nh = nw.clamp(max=width), nh.clamp(max=height)
        nx1 = torch.minimum((cx - nw / 2).clamp(min=0), width - nw)
        ny1 = torch.minimum((cy - nh / 2).clamp(min=0), height - nh)
        return torch.stack([nx1, ny1, nx1 + nw, ny1 + nh], -1)

    def shifted(ox, oy):
        nx1 = torch.minimum((x1 + ox).clamp(min=0), width - w)
        ny1 = torch.minimum((y1 + oy).clamp(min=0), height - h)
        return torch.stack([nx1, ny1, nx1 + w, ny1 + h], -1)

    zero = torch.zeros_like(w)
    grow_w, grow_h = torch.maximum(w * (1 + resize), w), torch.maximum(h * (1 + resize), h)
    cut_w = torch.maximum(w * (1 - resize), torch.minimum(w, torch.full_like(w, min_side)))
    cut_h = torch.maximum(h * (1 - resize), torch.minimum(h, torch.full_like(h, min_side)))
    outcomes = torch.stack([
        torch.stack([x1, y1, x1 + sw, y1 + sh], -1), torch.stack([x2 - sw, y1, x2, y1 + sh], -1),
        torch.stack([x1, y2 - sh, x1 + sw, y2], -1), torch.stack([x2 - sw, y2 - sh, x2, y2], -1),
        centred(sw, sh), boxes,
        shifted(-dx, zero), shifted(dx, zero), shifted(zero, -dy), shifted(zero, dy),
        centred(w, grow_h), centred(grow_w, h), centred(cut_w, h), centred(w, cut_h),
    ], dim=1)
    return outcomes.gather(1, actions.long().view(-1, 1, 1).expand(-1, 1, 4)).squeeze(1)


def random_boxes(n, width, height, gen, dtype=torch.float32):
    size = torch.tensor([width, height], dtype=torch.float64)
    xy = torch.rand(n, 2, generator=gen, dtype=torch.float64) * size * 0.9
    wh = torch.rand(n, 2, generator=gen, dtype=torch.float64) * (size - xy)
    wh = torch.where(torch.rand(n, 2, generator=gen) < 0.3, wh.round(), wh)  # whole sides too
    boxes = torch.cat([xy, xy + wh], 1)
    boxes[:3] = torch.tensor([0.0, 0.0, width, height])  # the whole image, where every episode starts
    return boxes.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("width", "height", "alpha", "min_side", "resize"), [
    (84.0, 84.0, 0.2, 28.0, 0.2), (84, 84, 0.2, 8.0, 0.2), (100.3, 57.7, 0.1, 28.0, 0.25),
    (224.0, 160.0, 0.3, 50.0, 0.2), (30.0, 20.0, 0.2, 3.0, 0.1),
])
def test_every_action_is_bit_identical_to_its_own_formula(dtype, width, height, alpha, min_side, resize):
    g = torch.Generator().manual_seed(0)
    boxes = random_boxes(2000, width, height, g, dtype)
    actions = torch.arange(2000) % PHOTO_ACTIONS  # every action on many boxes
    for _ in range(4):  # and on the boxes earlier actions made
        got = apply_actions(boxes, actions, width, height, alpha, min_side, resize)
        want = reference_actions(boxes, actions, width, height, alpha, min_side, resize)
        assert got.dtype == dtype and got.shape == (2000, 4)
        assert torch.equal(got, want)
        boxes, actions = got, actions.roll(1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 80), st.floats(0, 80), st.floats(0.5, 84), st.floats(0.5, 84)),
                min_size=1, max_size=6),
       st.lists(st.integers(0, PHOTO_ACTIONS - 1), min_size=6, max_size=6))
def test_actions_match_the_reference_on_any_box(raw, acts):
    boxes = torch.tensor([(x, y, min(84.0, x + w), min(84.0, y + h)) for x, y, w, h in raw])
    actions = torch.tensor(acts[:len(raw)])
    assert torch.equal(apply_actions(boxes, actions, 84, 84), reference_actions(boxes, actions, 84, 84))


def test_action_tables_follow_the_device_dtype_and_image_size():
    boxes = torch.tensor([[10.0, 10.0, 60.0, 70.0]] * 3)
    actions = torch.tensor([11, 7, 4])  # wider, right, shrink to centre
    small = apply_actions(boxes, actions, 64.0, 72.0)  # the first size built its tables; another one its own
    big = apply_actions(boxes, actions, 200.0, 200.0)
    assert torch.equal(small, reference_actions(boxes, actions, 64.0, 72.0))
    assert torch.equal(big, reference_actions(boxes, actions, 200.0, 200.0)) and not torch.equal(small, big)
    # 50 x 1.2 = 60 wide (in float32: a hair more), centred at 35, pushed back inside the 64 px border
    assert small[0].tolist() == pytest.approx([4.0, 10.0, 64.0, 70.0], abs=1e-4) and small[0, 2] == 64.0
    half = apply_actions(boxes.double(), actions.int(), 64.0, 72.0)
    assert half.dtype == torch.float64 and torch.equal(half, reference_actions(boxes.double(), actions, 64.0, 72.0))
    with pytest.raises(IndexError):
        apply_actions(boxes, torch.tensor([0, 1, PHOTO_ACTIONS]), 84, 84)


def test_batched_rois_and_the_cpu_roi_align_equal_torchvisions_wrapper():
    bundle, _, feats, _ = setup(n=3)
    g = torch.Generator().manual_seed(1)
    boxes = random_boxes(6, S, S, g).view(3, 2, 4)
    rois = batched_rois(boxes)
    assert rois[:, 0].tolist() == [0, 0, 1, 1, 2, 2] and torch.equal(rois[:, 1:], boxes.view(6, 4))
    assert batched_rois(boxes[:1, :1])[:, 0].tolist() == [0]  # another shape, its own index column
    r = bundle.embedder.roi_cfg
    want = roi_align(feats, rois, output_size=r.output_size, spatial_scale=r.spatial_scale,
                     sampling_ratio=r.sampling_ratio, aligned=True).view(3, 2, *feats.shape[1:2], 7, 7)
    with torch.no_grad():
        assert torch.equal(bundle.embedder.roi(feats, boxes), want)


@pytest.mark.parametrize(("cell", "use_prototype"), [("gru", False), ("gru", True), ("rnn", False)])
def test_agent_forward_equals_its_modules(cell, use_prototype):
    torch.manual_seed(0)
    agent = Agent(AgentConfig(conv_channels=4, hidden=8, cell=cell, use_prototype=use_prototype, embed_dim=16))
    roi, h = torch.randn(5, 64, 7, 7), torch.randn(5, 8)
    offset = torch.randn(5, 16) if use_prototype else None
    x = agent.reduce(roi)
    if use_prototype:
        x = torch.cat([x, agent.offset(offset / (offset.norm(dim=-1, keepdim=True) + 1e-6))], -1)
    h_want = agent.cell(x, h)
    logits, h_got = agent(roi, h, offset)
    assert torch.equal(h_got, h_want) and torch.equal(logits, agent.policy(h_want))
    logits.sum().backward()  # the training path keeps its gradient
    assert agent.cell.weight_ih.grad is not None and agent.reduce[0].weight.grad is not None


@pytest.mark.parametrize("use_prototype", [False, True])
def test_inference_log_probs_after_the_loop_equal_the_per_step_ones(use_prototype):
    bundle, _, feats, protos = setup(n=4, use_prototype=use_prototype)
    agent = bundle.new_agent()
    cfg = bundle.config.env
    with torch.inference_mode():
        ro = rollout(bundle.embedder, agent, feats, protos, cfg, (S, S), deterministic=True, rewards=False)
    # the same episode with the gradient on: log-probabilities from a distribution at every step
    tracked = rollout(bundle.embedder, agent, feats, protos, cfg, (S, S), deterministic=True, rewards=False)
    assert torch.equal(ro.actions, tracked.actions) and torch.equal(ro.boxes, tracked.boxes)
    assert torch.allclose(ro.log_probs, tracked.log_probs.detach(), atol=1e-6)
    assert torch.allclose(ro.entropies, tracked.entropies.detach(), atol=1e-6)
    assert ro.log_probs.shape == ro.entropies.shape == (cfg.steps, 4)
    assert bool((ro.log_probs <= 0).all()) and bool((ro.entropies > 0).all())
    if not use_prototype:  # only the final box is embedded
        assert bool(ro.distances[:-1].isnan().all()) and not bool(ro.distances[-1].isnan().any())
        assert torch.equal(ro.rewards, torch.zeros(cfg.steps, 4))


def test_action_tables_stay_few_whatever_sizes_are_asked():
    from models.core import actions as module

    module._TABLES.clear()
    boxes, acts = torch.tensor([[1.0, 2.0, 30.0, 40.0]]), torch.tensor([11])
    for side in range(40, 140):  # 100 image sizes: the cache is emptied before it holds more than 64
        assert torch.equal(apply_actions(boxes, acts, side, side), reference_actions(boxes, acts, side, side))
        assert 1 <= len(module._TABLES) <= 64
    assert len(module._TABLES) == 100 - 64
