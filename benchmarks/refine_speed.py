"""What refining an answer costs (``models.refine``, served for checkpoints adapted on a repaired reward): greedy
localization with and without it, the same bundle, images and thread, rounds alternating.

The head's weights do not change the cost, so the bundle's own head stands in for a repaired one. One JSON object
on stdout: per bundle and batch size, the median ms per image of each and their ratio.

    OMP_NUM_THREADS=1 python benchmarks/refine_speed.py > runs/refine_speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from models.bundle import load_bundle
from models.experiments.cmnist import cmnist
from models.inference import Localizer

ROOT = Path(__file__).resolve().parents[1]


def per_image_ms(loc: Localizer, agent, images: torch.Tensor, proto: torch.Tensor, batch: int) -> float:
    scales = torch.ones(batch, 2)
    t = time.perf_counter()
    for i in range(0, len(images) - batch + 1, batch):
        loc.localize_batch(images[i:i + batch], scales, proto, agent)
    return (time.perf_counter() - t) * 1000 / (len(images) // batch * batch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    out = {"threads": a.threads, "rounds": a.rounds, "runs": []}
    for name, batches, n in (("mnist-digit4", (1, 64), 128), ("photo-general", (1, 16), 32)):
        bundle = load_bundle(ROOT / "bundles" / f"{name}.pt", "cpu")
        spec = bundle.config.input
        if spec.channels == 1:
            images = cmnist(4, "test", n, "patch", 0).images
        else:  # the cost does not depend on the pixels: seeded noise at the input size
            images = torch.rand(n, spec.channels, spec.size, spec.size, generator=torch.Generator().manual_seed(0))
        plain, refining = Localizer(bundle, "cpu"), Localizer(replace(bundle, refine=True), "cpu")
        proto = plain.prototype([images[i] for i in range(5)])
        agent = plain.agent()
        for batch in batches:
            times = {"plain": [], "refined": []}
            for _ in range(a.rounds):
                for label, loc in (("plain", plain), ("refined", refining)):
                    times[label].append(per_image_ms(loc, agent, images, proto, batch))
            med = {k: round(statistics.median(v), 2) for k, v in times.items()}
            out["runs"].append({"bundle": name, "batch": batch, "ms_per_image": med,
                                "ratio": round(med["refined"] / med["plain"], 2)})
            print(json.dumps(out["runs"][-1]), flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
