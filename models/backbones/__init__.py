"""Pluggable image encoders (backbones). A backbone maps ``[B, C, H, W]`` to a feature map
``[B, out_channels, H / stride, W / stride]`` and exposes ``out_channels`` and ``stride``.

Register a new one with ``@register_backbone("name")`` in a module of this package (it is found on
first use: every module here is imported once) or in any module imported before the bundle is
built. Its builder takes an ``EncoderConfig`` and ``pretrained`` (``False`` when every weight is about
to be overwritten, as by a bundle's state dict: skip reading a weights file) and returns the network;
``build_backbone`` is the one place that freezes it (``EncoderConfig.frozen``).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

from torch import nn

from models.config import EncoderConfig

BACKBONES: dict[str, Callable[[EncoderConfig, bool], nn.Module]] = {}
DECODERS: dict[str, Callable[[EncoderConfig], nn.Module]] = {}
"""Optional per backbone: a network mapping its feature map back to the image (stage 1's reconstruction loss)."""


def register_backbone(name: str):
    def deco(fn: Callable[[EncoderConfig, bool], nn.Module]):
        BACKBONES[name] = fn
        return fn
    return deco


def register_decoder(name: str):
    """Register the decoder of backbone ``name``: its builder takes the backbone's ``EncoderConfig``."""
    def deco(fn: Callable[[EncoderConfig], nn.Module]):
        DECODERS[name] = fn
        return fn
    return deco


def build_decoder(cfg: EncoderConfig) -> nn.Module:
    """The decoder registered for backbone ``cfg.kind``: ``[B, C', h, w] -> [B, C, H, W]`` in (0, 1)."""
    if cfg.kind not in DECODERS:
        discover()
    if cfg.kind not in DECODERS:
        raise ValueError(f"backbone {cfg.kind!r} has no decoder for the reconstruction loss (set recon_weight=0); "
                         f"backbones with one: {sorted(DECODERS)}")
    return DECODERS[cfg.kind](cfg)


def build_backbone(cfg: EncoderConfig, pretrained: bool = True) -> nn.Module:
    """The backbone ``cfg.kind`` built from ``cfg``; with ``cfg.frozen`` no parameter needs a gradient.
    ``pretrained=False`` skips loading pretrained weights (the caller loads all weights itself)."""
    if cfg.kind not in BACKBONES:
        discover()
    if cfg.kind not in BACKBONES:
        raise ValueError(f"unknown backbone {cfg.kind!r}; known: {sorted(BACKBONES)}")
    net = BACKBONES[cfg.kind](cfg, pretrained)
    if cfg.frozen:
        net.requires_grad_(False)
    return net


def discover() -> list[str]:
    """Import every module of this package, so their ``@register_backbone`` builders are known -> the names."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
    return sorted(BACKBONES)
