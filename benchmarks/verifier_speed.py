"""The known-kinds verifier's encoder per batch of boxes: eager layers (batch norms folded) vs oneDNN's tensors.

``models.backbones.onednn.OneDnnConvs`` runs the shipped verifier's convolutions, ReLUs and max pools on oneDNN's
tensor layout (what ``KindVerifier.freeze`` serves since the twenty-second session); this times both on the same
28 x 28 box reads, one torch thread, the two alternating, and checks that they give the same embeddings:

    .venv/bin/python benchmarks/verifier_speed.py [--repeats 200]

Prints JSON: per batch size, the median ms per call of each, their ratio, and the largest embedding difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.verifier import load_verifier  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verifier", default=str(ROOT / "bundles" / "mnist-general.verifier"))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 16, 64])
    p.add_argument("--repeats", type=int, default=200)
    a = p.parse_args()
    torch.set_num_threads(1)
    fast = load_verifier(a.verifier)  # freeze(): oneDNN where available
    eager = load_verifier(a.verifier).freeze(onednn=False)
    rows = []
    with torch.no_grad():
        for n in a.batches:
            x = torch.rand(n, fast.channels, 28, 28, generator=torch.Generator().manual_seed(n))
            times: dict[str, list[float]] = {"eager": [], "onednn": []}
            for _ in range(10):
                eager.embed(x), fast.embed(x)
            for _ in range(a.repeats):
                for name, v in (("eager", eager), ("onednn", fast)):
                    t = time.perf_counter()
                    v.embed(x)
                    times[name].append((time.perf_counter() - t) * 1000)
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append({"boxes": n, "eager_ms": round(med["eager"], 3), "onednn_ms": round(med["onednn"], 3),
                         "speedup": round(med["eager"] / med["onednn"], 2),
                         "max_abs_diff": float((fast.embed(x) - eager.embed(x)).abs().max())})
    print(json.dumps({"onednn": type(fast._served[0]).__name__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
