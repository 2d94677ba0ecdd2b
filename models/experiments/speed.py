"""Localization speed, measured the way a client sees it."""

from __future__ import annotations

import statistics
import time

import torch
from torch import Tensor

from models.bundle import Bundle
from models.inference import Localizer, normalize


def measure_speed(bundle: Bundle, images01: Tensor, prototype: Tensor, batch_sizes: tuple[int, ...] = (1, 16),
                  repeats: int = 5, nearest: bool | None = None) -> dict[str, float]:
    """Images/s of a whole greedy localization (backbone once + ``steps`` RoI/head/agent steps) and of
    the backbone alone, measured alternately in the same process (median over ``repeats`` calls, after
    one warm-up each; the CPU is shared, so medians resist the other jobs' bursts). ``nearest``: the answer
    rule (``None``: the bundle's default)."""
    with torch.no_grad():
        loc = Localizer(bundle, device=bundle.device)
        agent = loc.agent()
        out: dict[str, float] = {"threads": torch.get_num_threads()}
        for bs in batch_sizes:
            x = images01[:bs]
            if len(x) < bs:
                raise ValueError(f"measure_speed needs at least {bs} images, got {len(images01)}")
            full, backbone = [], []
            for r in range(repeats + 1):
                t0 = time.perf_counter()
                loc.run(x, prototype, agent, nearest=nearest).boxes[-1].cpu()  # waits for the device, as a client would
                t1 = time.perf_counter()
                loc.embedder.features(normalize(x.to(loc.device), loc.spec)).cpu()
                t2 = time.perf_counter()
                if r:  # the first round warms up
                    full.append(t1 - t0)
                    backbone.append(t2 - t1)
            out[f"localize_images_per_s_batch{bs}"] = round(bs / statistics.median(full), 2)
            out[f"backbone_images_per_s_batch{bs}"] = round(bs / statistics.median(backbone), 2)
        return out
