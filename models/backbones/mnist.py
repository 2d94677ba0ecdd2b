"""The cMNIST backbone of PAPER.md (three small convolutions at stride 2) and its mirror decoder, which
stage 1's reconstruction loss uses."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.backbones import register_backbone, register_decoder
from models.config import EncoderConfig


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


@register_backbone("mnist_conv")
def _mnist(cfg: EncoderConfig, pretrained: bool = True) -> nn.Module:
    return MnistEncoder(cfg.in_channels)


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


@register_decoder("mnist_conv")
def _mnist_decoder(cfg: EncoderConfig) -> nn.Module:
    return MnistDecoder(cfg.in_channels)
