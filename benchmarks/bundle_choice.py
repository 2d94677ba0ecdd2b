"""Which cMNIST bundle should the service serve? Bundles side by side on kinds of objects, before adaptation:
what a user gets from localize before any job (greedy CorLoc, as served) and how well the embedding orders
boxes by IoU around the object (OrdAcc and Spearman rho with the exemplars' prototype).

Targets: glyphs (letters and symbols, ``models.data.glyphs``: kinds neither bundle saw) on the four
backgrounds, and the ten digits on the patch background (for reference: a general bundle was trained on
them). Each target: 5 exemplar crops of the train split, ``--n`` images of ``--split`` (``val``, a held-out
part of the train split and the training fonts, for the choice; ``test`` for the report). One JSON object on
stdout: the rows and, per bundle, the mean over glyph targets per seed, then mean and std over seeds.

    python benchmarks/bundle_choice.py --bundles bundles/mnist-digit4.pt bundles/mnist-general.pt --split val
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from models.bundle import load_bundle
from models.evaluate import evaluate_corloc, ranking_metrics
from models.experiments.datasets import CMnistKind, GlyphKind
from models.experiments.report import mean_std
from models.features import prototype_of

GLYPHS = ("A", "K", "R", "e", "#", "&", "@", "?")
BACKGROUNDS = ("patch", "clutter", "impulse", "gaussian")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--bundles", nargs="+", required=True)
    p.add_argument("--split", choices=("val", "test"), default="val")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--n", type=int, default=200, help="images per target")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    kinds = [GlyphKind(c, bg) for bg in BACKGROUNDS for c in GLYPHS] + [CMnistKind(d, "patch") for d in range(10)]
    t0 = time.perf_counter()
    rows = []
    for path in a.bundles:
        bundle = load_bundle(path, "cpu")
        for seed in a.seeds:
            for kind in kinds:
                ex = kind.draw(bundle, "exemplars", 5, seed)
                data = kind.draw(bundle, a.split, a.n, seed)
                proto = prototype_of(bundle, ex)
                m = ranking_metrics(bundle, data, proto, seed=seed)
                row = {"bundle": path, "target": kind.describe(), "glyph": isinstance(kind, GlyphKind),
                       "seed": seed, "corloc": evaluate_corloc(bundle, bundle.new_agent(None), data, proto)[0],
                       "ordacc": m["ordacc"], "spearman": m["spearman"]}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    summary = {}
    for path in a.bundles:
        for group, is_glyph in (("glyphs", True), ("digits", False)):
            per_seed = {k: [statistics.fmean(r[k] for r in rows if r["bundle"] == path and r["seed"] == s
                                             and r["glyph"] == is_glyph) for s in a.seeds]
                        for k in ("corloc", "ordacc", "spearman")}
            summary.setdefault(path, {})[group] = {k: mean_std(v, 2) for k, v in per_seed.items()}
    print(json.dumps({"split": a.split, "seeds": a.seeds, "command": " ".join(["python", *sys.argv]),
                      "wall_seconds": round(time.perf_counter() - t0, 1), "summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
