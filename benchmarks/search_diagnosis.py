"""Where do the adapted agent's misses come from: the embedding or the search? (BENCHMARKS.md, backgrounds)

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/search_diagnosis.py --seed 1 --background impulse --iterations 300

Trains stages 1-2 as ``qloc reproduce backgrounds`` does (or loads ``--bundle``), adapts to digit 2 on
the background, and prints JSON: CorLoc after adaptation; the misses split by which box is nearer the
prototype (the ground truth: a search failure; the agent's: an embedding failure); CorLoc after a local
refinement of the final box; the ranking baseline with and without that refinement; the best-of-N search.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from models.adapt import AdaptConfig, adapt
from models.bundle import Bundle, load_bundle
from models.core.boxes import paired_iou
from models.core.metrics import corloc
from models.data.types import exemplar_crops
from models.evaluate import evaluate_corloc, ranking
from models.experiments.cmnist import TrainSetup, cmnist, train_bundle
from models.features import features_of
from models.inference import Localizer


@torch.no_grad()
def distances(bundle: Bundle, feats: torch.Tensor, boxes: torch.Tensor, proto: torch.Tensor) -> torch.Tensor:
    return (bundle.embedder.embed(feats, boxes[:, None])[:, 0] - proto).norm(dim=-1)


@torch.no_grad()
def refine(bundle: Bundle, feats: torch.Tensor, boxes: torch.Tensor, proto: torch.Tensor,
           rounds=((4, 2), (2, 1), (1, 1)), scales=(0.85, 1.0, 1.15)) -> torch.Tensor:
    """Coarse-to-fine local search on the images' backbone ``feats``: shifts of ``step`` px up to ``radius``
    steps and 3 scales around each box, the candidate nearest the prototype kept, per round -> ``[N, 4]``."""
    s, ms = bundle.config.input.size, bundle.config.env.min_side
    for step, radius in rounds:
        d = torch.arange(-radius, radius + 1, dtype=torch.float32) * step
        dx, dy, sc = (t.flatten() for t in torch.meshgrid(d, d, torch.tensor(scales), indexing="ij"))
        cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
        w = (boxes[:, 2:3] - boxes[:, 0:1]) * sc
        h = (boxes[:, 3:4] - boxes[:, 1:2]) * sc
        w, h = w.clamp(ms, s), h.clamp(ms, s)
        x0 = torch.minimum((cx[:, None] + dx - w / 2).clamp(min=0), s - w)
        y0 = torch.minimum((cy[:, None] + dy - h / 2).clamp(min=0), s - h)
        cands = torch.stack([x0, y0, x0 + w, y0 + h], -1)  # [N, K, 4]
        dist = (bundle.embedder.embed(feats, cands) - proto).norm(dim=-1)
        boxes = cands[torch.arange(len(cands)), dist.argmin(1)]
    return boxes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bundle", help="a trained bundle (default: train stages 1-2 on digit 3, patch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--background", default="impulse")
    p.add_argument("--iterations", type=int, default=300)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    bundle = load_bundle(a.bundle, "cpu") if a.bundle else train_bundle("mnist-digit3", TrainSetup(digit=3),
                                                                        a.seed, torch.device("cpu"))
    ex = cmnist(2, "train", 5, a.background, a.seed + 1000)
    unl = cmnist(2, "train", 500, a.background, a.seed + 1000, offset=5)
    test = cmnist(2, "test", 500, a.background, a.seed)
    proto = Localizer(bundle, "cpu").prototype(exemplar_crops(ex))
    t0 = time.perf_counter()
    res = adapt(bundle, proto, unl.images, AdaptConfig(iterations=a.iterations, batch_size=64, seed=a.seed))
    agent = bundle.new_agent(res.agent_state)
    after, boxes = evaluate_corloc(bundle, agent, test, proto)
    miss = paired_iou(boxes, test.boxes) < 0.5
    feats = features_of(bundle, test.images)  # once, for every distance and refinement below
    d_pred, d_gt = distances(bundle, feats, boxes, proto), distances(bundle, feats, test.boxes, proto)
    ranked = ranking(bundle, test, proto)
    out = {"seed": a.seed, "background": a.background, "iterations": a.iterations, "corloc_after": after,
           "misses_gt_nearer_pct": float((miss & (d_gt < d_pred)).float().mean() * 100),
           "misses_agent_nearer_pct": float((miss & (d_gt >= d_pred)).float().mean() * 100),
           "after_refined": corloc(refine(bundle, feats, boxes, proto), test.boxes),
           "ranking": corloc(ranked, test.boxes),
           "ranking_refined": corloc(refine(bundle, feats, ranked, proto), test.boxes)}
    for n in (4, 16):
        out[f"after_best_of_{n}"] = evaluate_corloc(bundle, agent, test, proto, seed=0, samples=n - 1)[0]
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
