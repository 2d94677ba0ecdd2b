"""Template matching's speed (``models.core.matching.template_matching``, every template of a set at once by FFT:
``best_windows``) against the loop it replaced (one ``ncc_map`` per crop and scale, written out here), and whether
the two pick the same boxes: 5 kinds x 2 seeds x 100 validation images, then one image at a time (what
``rerank=templates`` matches per doubtful image), on one thread.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/template_matching_speed.py      # ~1 min
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.bundle import load_bundle  # noqa: E402
from models.core.matching import TEMPLATE_SCALES, ncc_map, scaled_template, template_matching  # noqa: E402
from models.data.types import exemplar_crops  # noqa: E402
from models.experiments.datasets import CMnistKind, GlyphKind  # noqa: E402


def one_at_a_time(images01: torch.Tensor, crops: list[torch.Tensor]) -> torch.Tensor:
    """The loop before: one ``ncc_map`` per crop and scale, the first strictly better window kept."""
    n, _, hh, ww = images01.shape
    best = torch.full((n,), -torch.inf)
    boxes = torch.zeros(n, 4)
    for crop in crops:
        for s in sorted(TEMPLATE_SCALES):
            t = scaled_template(crop, s)
            h, w = t.shape[-2:]
            if h > hh or w > ww:
                continue
            top, idx = ncc_map(images01, t).flatten(1).max(dim=1)
            x, y = (idx % (ww - w + 1)).float(), torch.div(idx, ww - w + 1, rounding_mode="floor").float()
            better = top > best
            best = torch.where(better, top, best)
            boxes[better] = torch.stack([x, y, x + w, y + h], dim=1)[better]
    return boxes


def median_ms(fn, repeats: int = 9) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(1000 * statistics.median(times), 2)


def main() -> None:
    torch.set_num_threads(1)
    bundle = load_bundle(ROOT / "bundles" / "mnist-general.pt")
    kinds = [GlyphKind("A", "patch"), GlyphKind("Φ", "patch"), GlyphKind("?", "clutter"), CMnistKind(4, "patch"),
             CMnistKind(2, "impulse")]
    same = total = 0
    batch = {"before": 0.0, "now": 0.0}
    single = []
    for kind in kinds:
        for seed in (0, 1):
            crops = exemplar_crops(kind.draw(bundle, "exemplars", 5, seed))
            images = kind.draw(bundle, "val", 100, seed).images
            t = time.perf_counter()
            before = one_at_a_time(images, crops)
            batch["before"] += time.perf_counter() - t
            t = time.perf_counter()
            now = template_matching(images, crops)
            batch["now"] += time.perf_counter() - t
            same += int((before == now).all(dim=1).sum())
            total += len(images)
            if seed == 0:
                one = images[:1]
                single.append({"kind": str(kind), "crop_sizes": sorted({tuple(c.shape[-2:]) for c in crops}),
                               "before_ms": median_ms(lambda one=one, crops=crops: one_at_a_time(one, crops)),
                               "now_ms": median_ms(lambda one=one, crops=crops: template_matching(one, crops))})
                print(json.dumps(single[-1]), flush=True)
    print(json.dumps({"same_boxes": same, "images": total, "seconds_before": round(batch["before"], 2),
                      "seconds_now": round(batch["now"], 2)}))


if __name__ == "__main__":
    main()
