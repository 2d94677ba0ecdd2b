"""The two networks written out layer by layer: the agent's step and the RoI embedder's head, RoIAlign rows and
both RoIAlign paths, against torch's modules and torchvision's ``roi_align`` called plainly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchvision.ops import roi_align

from models.config import AgentConfig, EncoderConfig, HeadConfig, InputSpec, ModelConfig, RoIConfig
from models.nets import embedding as embedding_module
from models.nets.agent import Agent
from models.nets.embedding import ProjectionHead, RoIEmbedder, batched_rois


def lively(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``module`` with weights large enough that every nonlinearity is far from the identity."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (2.0 / max(p[0].numel(), 1) ** 0.5 if p.dim() > 1 else 0.5))
    return module


# ---- the agent ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cell", ["gru", "rnn"])
@pytest.mark.parametrize("use_prototype", [False, True])
def test_the_agents_step_is_its_layers_written_out(cell, use_prototype):
    cfg = AgentConfig(in_channels=6, conv_channels=3, roi_size=4, hidden=5, cell=cell, use_prototype=use_prototype,
                      embed_dim=7)
    agent = lively(Agent(cfg), 0).eval()
    g = torch.Generator().manual_seed(1)
    roi, h = torch.randn(3, 6, 4, 4, generator=g), torch.randn(3, 5, generator=g)
    offset = torch.randn(3, 7, generator=g) * 40 if use_prototype else None

    x = torch.relu(F.conv2d(roi, agent.reduce[0].weight, agent.reduce[0].bias)).reshape(3, -1)
    if use_prototype:
        direction = offset / (offset.norm(dim=1, keepdim=True) + 1e-6)  # scale-free: distances are O(10..100)
        x = torch.cat([x, torch.tanh(direction @ agent.offset[0].weight.T + agent.offset[0].bias)], dim=1)
    cell_module = torch.nn.GRUCell(x.shape[1], 5) if cell == "gru" else torch.nn.RNNCell(x.shape[1], 5)
    cell_module.load_state_dict(agent.cell.state_dict())
    h_expected = cell_module(x, h)
    logits, h_new = agent(roi, h, offset)
    torch.testing.assert_close(h_new, h_expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, h_expected @ agent.policy.weight.T + agent.policy.bias, rtol=1e-5, atol=1e-6)
    assert logits.shape == (3, cfg.n_actions)
    assert torch.equal(agent.initial_state(4), torch.zeros(4, 5))
    if use_prototype:  # the offset's length does not matter, its direction does
        torch.testing.assert_close(agent(roi, h, offset * 10)[0], logits, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(agent(roi, h, -offset)[0], logits, atol=1e-3)


def test_the_agent_refuses_an_unknown_cell_and_a_missing_offset_by_name():
    with pytest.raises(ValueError, match="agent cell must be 'gru' or 'rnn', got 'lstm'"):
        Agent(AgentConfig(cell="lstm"))
    agent = Agent(AgentConfig(in_channels=2, conv_channels=2, roi_size=2, hidden=3, use_prototype=True, embed_dim=4))
    with pytest.raises(ValueError, match=r"built with use_prototype=True: pass the prototype offset"):
        agent(torch.zeros(1, 2, 2, 2), torch.zeros(1, 3))


# ---- the embedder -------------------------------------------------------------------------------------------------


def test_the_projection_head_is_linear_relu_dropout_linear():
    head = lively(ProjectionHead(HeadConfig(in_features=2 * 3 * 3, hidden=6, out_features=4, dropout=0.5)), 2)
    feats = torch.randn(5, 2, 3, 3, generator=torch.Generator().manual_seed(3))
    lin1, lin2 = head.net[1], head.net[4]
    expected = torch.relu(feats.flatten(1) @ lin1.weight.T + lin1.bias) @ lin2.weight.T + lin2.bias
    torch.testing.assert_close(head.eval()(feats), expected, rtol=1e-5, atol=1e-6)
    head.train()  # in training, dropout zeroes hidden units: outputs change from one draw to the next
    with torch.random.fork_rng():  # dropout draws from the global generator: not left changed
        torch.manual_seed(0)
        a = head(feats)
        torch.manual_seed(1)
        assert not torch.allclose(a, head(feats))


def tiny_config(spatial_scale: float = 0.25, sampling_ratio: int = 2) -> ModelConfig:
    return ModelConfig(
        input=InputSpec(channels=1, size=32, mean=(0.1307,), std=(0.3081,), exemplar_size=12, fill=(0.0,)),
        encoder=EncoderConfig(),
        roi=RoIConfig(output_size=3, spatial_scale=spatial_scale, sampling_ratio=sampling_ratio),
        head=HeadConfig(in_features=64 * 3 * 3, hidden=8, out_features=5, dropout=0.0))


def test_rois_rows_are_batch_index_then_box():
    boxes = torch.tensor([[[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], [[0.5, 0.0, 9.0, 9.5], [2.0, 2.0, 4.0, 4.0]]])
    assert batched_rois(boxes).tolist() == [[0, 1, 2, 3, 4], [0, 5, 6, 7, 8], [1, 0.5, 0, 9, 9.5], [1, 2, 2, 4, 4]]
    assert batched_rois(boxes.double()).dtype == torch.float64


@pytest.mark.parametrize("direct", [True, False])
def test_roi_features_are_torchvisions_roi_align_on_every_box_on_either_path(monkeypatch, direct):
    """The CPU path calls torchvision's op itself; without it (``_CPU_ROI_ALIGN`` None: no compiled ops, or
    another device) the public ``roi_align`` serves, with the same scale, sampling and alignment."""
    if not direct:
        monkeypatch.setattr(embedding_module, "_CPU_ROI_ALIGN", None)
    cfg = tiny_config()
    embedder = RoIEmbedder(cfg, pretrained=False).eval()
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(2, 64, 8, 8, generator=g)
    boxes = torch.tensor([[[0.0, 0.0, 31.0, 31.0], [3.3, 4.1, 17.9, 20.2], [10.0, 2.0, 14.0, 30.0]],
                          [[5.5, 5.5, 9.5, 9.5], [0.0, 12.0, 32.0, 20.0], [1.0, 1.0, 2.0, 2.0]]])
    expected = torch.stack([roi_align(feats[i:i + 1], [boxes[i]], output_size=3, spatial_scale=0.25,
                                      sampling_ratio=2, aligned=True) for i in range(2)])  # one image at a time
    out = embedder.roi(feats, boxes)
    assert out.shape == (2, 3, 64, 3, 3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    # boxes of another dtype are read in the features' dtype
    torch.testing.assert_close(embedder.roi(feats, boxes.double()), expected, rtol=1e-5, atol=1e-6)
    # every box is its own head row: the embeddings of several boxes per image are each box's alone
    emb = embedder.embed(feats, boxes)
    assert emb.shape == (2, 3, 5)
    for i in range(2):
        for k in range(3):
            torch.testing.assert_close(emb[i, k], embedder.head(expected[i, k][None])[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(embedder.embed_roi(out), emb)


def test_the_embedder_loads_pretrained_backbone_weights_unless_told_not_to():
    """A photo embedder made from its config carries ImageNet weights (the pretrained file), and one made to be
    loaded from a bundle (``pretrained=False``) does not read them."""
    from models.backbones import build_backbone
    from models.presets import photo_config

    cfg = photo_config()
    pretrained = build_backbone(cfg.encoder, pretrained=True).state_dict()
    first = next(k for k, v in pretrained.items() if v.is_floating_point() and v.dim() == 4)
    assert torch.equal(RoIEmbedder(cfg).encoder.state_dict()[first], pretrained[first])
    assert not torch.equal(RoIEmbedder(cfg, pretrained=False).encoder.state_dict()[first], pretrained[first])
