"""Pluggable image encoders (backbones). A backbone maps ``[B, C, H, W]`` to a feature map
``[B, out_channels, H / stride, W / stride]`` and exposes ``out_channels`` and ``stride``.

Register a new one with ``@register_backbone("name")``; its builder takes an ``EncoderConfig``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from models.config import EncoderConfig

BACKBONES: dict[str, Callable[[EncoderConfig], nn.Module]] = {}


def register_backbone(name: str):
    def deco(fn: Callable[[EncoderConfig], nn.Module]):
        BACKBONES[name] = fn
        return fn
    return deco


def build_backbone(cfg: EncoderConfig) -> nn.Module:
    if cfg.kind not in BACKBONES:
        _import_plugins()
    if cfg.kind not in BACKBONES:
        raise ValueError(f"unknown backbone {cfg.kind!r}; known: {sorted(BACKBONES)}")
    net = BACKBONES[cfg.kind](cfg)
    if cfg.frozen:
        for p in net.parameters():
            p.requires_grad_(False)
    return net


def _import_plugins() -> None:
    """Backbones living in other modules register themselves on import."""
    import importlib

    for mod in ("models.photo_backbones",):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


class MnistEncoder(nn.Module):
    """Conv(1->10, 3, s2)-ReLU-Conv(10->32)-ReLU-Conv(32->64): ``[B, 1, 84, 84] -> [B, 64, 42, 42]``."""

    out_channels = 64
    stride = 2

    def __init__(self, in_channels: int = 1):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(in_channels, 10, 3, stride=2, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(10, 32, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3, padding=1),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class MnistDecoder(nn.Module):
    """Mirror of ``MnistEncoder``: ``[B, 64, 42, 42] -> [B, 1, 84, 84]`` in (0, 1)."""

    def __init__(self, out_channels: int = 1):
        super().__init__()
        self.net = nn.Sequential(
            nn.ReLU(),
            nn.ConvTranspose2d(64, 32, 3, padding=1), nn.ReLU(inplace=True),
            nn.ConvTranspose2d(32, 10, 3, padding=1), nn.ReLU(inplace=True),
            nn.ConvTranspose2d(10, out_channels, 3, stride=2, padding=1, output_padding=1),
        )

    def forward(self, f: Tensor) -> Tensor:
        return torch.sigmoid(self.net(f))


@register_backbone("mnist_conv")
def _mnist(cfg: EncoderConfig) -> nn.Module:
    return MnistEncoder(cfg.in_channels)
