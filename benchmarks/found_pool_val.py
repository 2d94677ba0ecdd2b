"""Could a set's pool of unlabeled images teach ``found`` to tell the query digit from look-alikes? (issue 13;
**validation** images only: MNIST's train file; the test file is not read.)

A transductive try, label-free: the agent answers every pool image (half of them hold the query digit, half another
digit only); the pool answers most like the 5 exemplars (NCC) are taken as pseudo-positives, the least like them as
pseudo-negatives (``--fractions``), and an answer is scored by its k-nearest pseudo-positives (and exemplars) minus
its k-nearest pseudo-negatives, re-labelling the pool with that score (3 rounds); or by a linear classifier fit on
the pseudo-labels. Each answer is read 27 ways (``jittered``) in one of three representations: 16 x 16 pixels
(``px``, what the served NCC reads), gradient histograms (``hog``) or the bundle's backbone features (``bb``). The
printed number is the best ``min(precision, recall)`` of ``found`` over every threshold on 150 query-digit and 153
other-digit validation images: a ceiling for a calibration that must also pick its threshold without labels.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/found_pool_val.py --rep hog --pool 128   # ~10 s a representation
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from found_features_val import best_min_pr, hog  # noqa: E402

from models.bundle import load_bundle  # noqa: E402
from models.calibration import answers  # noqa: E402
from models.core.boxes import paired_iou  # noqa: E402
from models.core.templates import box_contents, jittered, make_templates, zero_mean_unit  # noqa: E402
from models.data.types import exemplar_crops  # noqa: E402
from models.experiments.cmnist import cmnist  # noqa: E402
from models.inference import Localizer  # noqa: E402

SIDE = {"px": 16, "bb": 28, "hog": 32}


def main() -> None:  # noqa: PLR0915 -- an exploration, top to bottom
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default="mnist-digit4")
    p.add_argument("--queries", type=int, nargs="+", default=[7, 2, 9])
    p.add_argument("--rep", choices=tuple(SIDE), default="px")
    p.add_argument("--pool", type=int, default=128, help="pool images with the query digit (about as many without)")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.4])
    p.add_argument("-k", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    bundle = load_bundle(ROOT / "bundles" / f"{a.bundle}.pt")
    loc = Localizer(bundle, "cpu")
    agent = loc.agent()

    def unit(f: torch.Tensor) -> torch.Tensor:
        f = f.flatten(1)
        return f / f.norm(dim=1, keepdim=True).clamp(min=1e-12)

    def rep(x: torch.Tensor) -> torch.Tensor:  # [m, 1, s, s] -> [m, D]
        if a.rep == "px":
            return zero_mean_unit(x).float()
        if a.rep == "hog":
            return hog(x)
        with torch.no_grad():
            return unit(F.adaptive_avg_pool2d(bundle.embedder.encoder(x), 7))

    def reads(images: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:  # [n, 27, D]
        jb = jittered(boxes.float())
        return rep(box_contents(images, jb, SIDE[a.rep]).flatten(0, 1)).view(len(jb), jb.shape[1], -1)

    def sim(r: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # best read's cosine with each of t: [n, m]
        return (r @ t.T).amax(1)

    def topk(s: torch.Tensor) -> torch.Tensor:
        return s.topk(min(a.k, s.shape[1]), dim=1).values.mean(1)

    for q in a.queries:
        crops = exemplar_crops(cmnist(q, "train", 5, "patch", 1000))
        proto = loc.prototype(crops)
        ex = rep(make_templates(crops, SIDE[a.rep]))

        def draw(npos: int, seed: int, offset: int, q: int = q, proto: torch.Tensor = proto):
            pos = cmnist(q, "train", npos, "patch", seed, offset=offset)
            per = max(1, round(npos / 9))
            oth = torch.cat([cmnist(d, "train", per, "patch", seed, offset=offset).images for d in range(10) if d != q])
            images = torch.cat([pos.images, oth])
            boxes, _ = answers(loc, agent, proto, images, nearest=loc.default_nearest)
            right = torch.zeros(len(images), dtype=torch.bool)
            right[:npos] = paired_iou(boxes[:npos], pos.boxes) >= 0.5
            return reads(images, boxes), right

        val, y = draw(150, 3000, 200)  # the images found_features_val.py scores
        pool, _ = draw(a.pool, 4000, 600)  # disjoint draws: other images, seed and offset
        row: dict = {"query": q, "rep": a.rep, "pool": len(pool),
                     "exemplars_only": best_min_pr(sim(val, ex).mean(1), y)}
        j = (pool @ ex.T).mean(-1).argmax(1)
        aligned = pool[torch.arange(len(pool)), j]  # each pool answer's read best aligned with the exemplars
        for frac in a.fractions:
            score = sim(pool, ex).mean(1)
            for it in range(3):
                order = score.argsort(descending=True)
                m = int(len(order) * frac)
                pos_, neg_ = torch.cat([ex, aligned[order[:m]]]), aligned[order[-m:]]
                row[f"knn {frac} round {it}"] = best_min_pr(topk(sim(val, pos_)) - topk(sim(val, neg_)), y)
                score = topk(sim(pool, pos_)) - topk(sim(pool, neg_))
            x = torch.cat([pos_, neg_]).float()
            t = torch.cat([torch.ones(len(pos_)), torch.zeros(len(neg_))])
            w, b = torch.zeros(x.shape[1], requires_grad=True), torch.zeros(1, requires_grad=True)
            opt = torch.optim.LBFGS([w, b], max_iter=200)

            def closure(x: torch.Tensor = x, t: torch.Tensor = t, w: torch.Tensor = w, b: torch.Tensor = b,
                        opt: torch.optim.Optimizer = opt) -> torch.Tensor:
                opt.zero_grad()
                loss = F.binary_cross_entropy_with_logits(x @ w + b, t) + 1e-2 * w.pow(2).sum()
                loss.backward()
                return loss

            opt.step(closure)
            with torch.no_grad():
                row[f"linear {frac}"] = best_min_pr((val.float() @ w + b).amax(1), y)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
