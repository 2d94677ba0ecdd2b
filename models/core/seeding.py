"""Seeded scopes: torch's global generator seeded for a block and restored after it.

Weight initialization and dropout draw from torch's global generator (they take no ``Generator``), so a
trainer that must repeat itself seeds it -- inside ``seeded``, which gives the caller its own generator
state back. Every other draw in the library takes an explicit ``torch.Generator``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def seeded(seed: int, device: str | torch.device | None = None) -> Iterator[None]:
    """Run the block with torch's global generator(s) seeded by ``seed``; restore the caller's state after.

    ``device``: a CUDA device whose generator is forked and seeded too (the CPU's always is)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    cuda = [dev] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.manual_seed(seed)
        yield
