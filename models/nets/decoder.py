"""Decoders that reconstruct the input from a backbone's feature map (stage 1's autoencoder loss)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


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

