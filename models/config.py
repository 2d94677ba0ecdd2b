"""Config dataclasses of the networks. Each is saved in the bundle as a plain dict and rebuilt from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class InputSpec:
    """How an uploaded image becomes a network input."""

    channels: int = 1
    """1 = grayscale, 3 = RGB."""
    size: int = 84
    """Images are resized to ``size x size``; boxes are mapped back to the uploaded pixels."""
    mean: tuple[float, ...] = (0.1307,)
    std: tuple[float, ...] = (0.3081,)
    exemplar_size: int = 28
    """Exemplar crops are resized to fit this side and pasted at the centre of a blank canvas."""
    fill: tuple[float, ...] = (0.0,)
    """Canvas colour (in [0, 1]) around pasted exemplar crops: the typical background."""


@dataclass
class EncoderConfig:
    """A backbone from ``models.backbones.BACKBONES``; ``options`` are passed to its builder."""

    kind: str = "mnist_conv"
    in_channels: int = 1
    frozen: bool = False
    """Frozen backbones (pretrained photo networks) are never updated, not even in stage 1."""
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class RoIConfig:
    output_size: int = 7
    spatial_scale: float = 0.5
    sampling_ratio: int = 2


@dataclass
class HeadConfig:
    in_features: int = 64 * 7 * 7
    hidden: int = 1024
    out_features: int = 512
    dropout: float = 0.5


@dataclass
class AgentConfig:
    in_channels: int = 64
    roi_size: int = 7
    conv_channels: int = 32
    hidden: int = 48
    n_actions: int = 10
    cell: str = "gru"
    """"gru" or "rnn" (Elman, as in the reference code)."""
    use_prototype: bool = False
    """Also feed the difference between the current box's embedding and the prototype."""
    embed_dim: int = 512


ANSWERS = ("last", "nearest")


@dataclass
class EnvConfig:
    steps: int = 10
    alpha: float = 0.2
    min_side: float = 28.0
    resize: float = 0.2
    answer: str = "last"
    """What an episode answers by default at inference: its ``last`` box (the paper's), or the box it
    visited ``nearest`` the prototype (``models.rollout.search``). Callers may override it per call."""

    def __post_init__(self) -> None:
        if self.answer not in ANSWERS:
            raise ValueError(f"env answer must be one of {ANSWERS}, got {self.answer!r}")


@dataclass
class ModelConfig:
    input: InputSpec = field(default_factory=InputSpec)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    roi: RoIConfig = field(default_factory=RoIConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (tuples become lists), safe for ``torch.load(weights_only=True)``."""
        return _plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        kinds = {"input": InputSpec, "encoder": EncoderConfig, "roi": RoIConfig, "head": HeadConfig,
                 "agent": AgentConfig, "env": EnvConfig}
        parts = {}
        for name, kind in kinds.items():
            known = {f.name: f for f in dataclasses.fields(kind)}
            raw = d.get(name, {})
            unknown = set(raw) - set(known)
            if unknown:
                raise ValueError(f"unknown {name} config keys {sorted(unknown)}: bundle from a newer qloc?")
            vals = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
            parts[name] = kind(**vals)
        return cls(**parts)


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return x
