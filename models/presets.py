"""The networks of PAPER.md as ``ModelConfig`` presets: cMNIST and photos."""

from __future__ import annotations

from typing import Any

from models.backbones import build_backbone
from models.backbones.imagenet import IMAGENET_MEAN, IMAGENET_STD
from models.config import AgentConfig, EncoderConfig, EnvConfig, HeadConfig, InputSpec, ModelConfig, RoIConfig
from models.core.actions import PHOTO_ACTIONS


def mnist_config(**agent_overrides: Any) -> ModelConfig:
    """The cMNIST networks of PAPER.md."""
    cfg = ModelConfig()
    for k, v in agent_overrides.items():
        setattr(cfg.agent, k, v)
    return cfg


def photo_config(size: int = 224, kind: str = "mobilenet_v2", options: dict[str, Any] | None = None,
                 exemplar_size: int | None = None, min_side: float | None = None,
                 use_prototype: bool = False) -> ModelConfig:
    """The photo networks of PAPER.md: frozen ImageNet backbone (stride 16), RoIAlign 7x7 at 1/16,
    head ``C*49 -> 1024 -> 1024``, agent over the 14 photo actions, minimum box side 40 px at 224.

    ``size`` is the square network input side (a multiple of 16). ``exemplar_size`` defaults to
    ``0.43 * size`` (96 at 224), the mean long side of the objects ``models.data.photos.generate`` pastes.
    For ``kind != "mobilenet_v2"`` the backbone is built once to read its channels and stride.
    ``use_prototype``: the agent also reads the direction from its box's embedding to the prototype (the
    photo benchmark's bundles do).
    """
    if size % 16:
        raise ValueError(f"photo input size must be a multiple of 16, got {size}")
    options = dict(options or {})
    enc = EncoderConfig(kind=kind, in_channels=3, frozen=True, options=options)
    if kind == "mobilenet_v2":
        channels, stride = 96, 16
    else:
        probe = build_backbone(enc)
        channels, stride = probe.out_channels, probe.stride
    scale = size / 224
    return ModelConfig(
        input=InputSpec(channels=3, size=size, mean=IMAGENET_MEAN, std=IMAGENET_STD,
                        exemplar_size=exemplar_size or round(96 * scale), fill=IMAGENET_MEAN),
        encoder=enc,
        roi=RoIConfig(output_size=7, spatial_scale=1.0 / stride, sampling_ratio=2),
        head=HeadConfig(in_features=channels * 49, hidden=1024, out_features=1024, dropout=0.5),
        agent=AgentConfig(in_channels=channels, roi_size=7, n_actions=PHOTO_ACTIONS, embed_dim=1024,
                          use_prototype=use_prototype),
        # "nearest": chosen on the photo val splits, where the agent walks past objects of new classes
        env=EnvConfig(steps=10, alpha=0.2, min_side=min_side if min_side is not None else 40.0 * scale,
                      resize=0.2, answer="nearest"),
    )

