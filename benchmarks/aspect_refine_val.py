"""Can the refinement find the object's shape, not only its place and size? Validation images only.

A cMNIST bundle's boxes are squares (BENCHMARKS.md, "Kinds no choice ever looked at"): the ten actions and the
refinement (``models.refine``) scale both sides alike, so a narrow object is answered with a square around it. This
compares, on the repaired reward a job would make (``models.repair.guarded_setup``, the job defaults: 256 probes),
the starting policy's greedy answers on the ``val`` split (training fonts) of each kind:

- ``unrefined``: the agent's last box;
- ``square``: refined as served (``RefineConfig()``: shifts and scales);
- ``shape``: refined as served, then ``--aspect-rounds`` more rounds that change widths and heights in opposite
  ways (``RefineConfig(aspect_rounds=..., aspect=...)``), 27 boxes a round.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/aspect_refine_val.py --kinds '!' 'j' '?' --seed 0

Prints one JSON line per kind (CorLoc of each answer, mean IoU, the objects' median width / height, seconds).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch
from aspect_val import median_aspect

from models.bundle import load_bundle
from models.core.boxes import paired_iou
from models.core.metrics import corloc
from models.data.types import exemplar_crops
from models.evaluate import localize_boxes
from models.experiments.datasets import GlyphKind
from models.features import features_of
from models.inference import Localizer
from models.refine import RefineConfig, refine
from models.repair import RepairConfig, guarded_setup


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", nargs="+", required=True, help="glyph characters")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--background", default="patch")
    p.add_argument("--images", type=int, default=200)
    p.add_argument("--bundle", default="bundles/mnist-general.pt")
    p.add_argument("--variants", nargs="+", default=["0.2"], help="RefineConfig.aspect values to try")
    p.add_argument("--aspect-rounds", type=int, default=4)
    p.add_argument("--min-side", type=float, default=1.0,
                   help="the shape variants' smallest side, as a fraction of the bundle's min_side")
    a = p.parse_args()
    torch.set_num_threads(1)
    bundle = load_bundle(a.bundle, "cpu")
    s, min_side = float(bundle.config.input.size), bundle.config.env.min_side
    for char in a.kinds:
        t0 = time.perf_counter()
        kind = GlyphKind(char, a.background)
        ex = kind.draw(bundle, "exemplars", 5, a.seed)
        unl = kind.draw(bundle, "unlabeled", 64, a.seed, after=5)
        val = kind.draw(bundle, "val", a.images, a.seed)
        crops = exemplar_crops(ex)
        proto = Localizer(bundle, "cpu").prototype(crops)
        g = guarded_setup(bundle, proto, crops, unl.images, None, synthetic=256, generator_seed=a.seed,
                          repair=RepairConfig())
        kept = g.repair is not None and g.repair.kept
        rb = replace(g.bundle, refine=False)
        feats = features_of(rb, val.images)
        last = localize_boxes(rb, rb.new_agent(None), replace(val, feats=feats), g.prototype)[-1]
        with torch.no_grad():
            d0 = (rb.embedder.embed(feats, last[:, None])[:, 0] - g.prototype).norm(dim=-1)
        answers = {"unrefined": last,
                   "square": refine(rb.embedder, feats, g.prototype, last, d0, (s, s), min_side)[0]}
        for v in a.variants:
            cfg = RefineConfig(aspect_rounds=a.aspect_rounds, aspect=float(v))
            answers[f"shape {v}"] = refine(rb.embedder, feats, g.prototype, last, d0, (s, s), min_side * a.min_side,
                                           cfg)[0]
        row = {"kind": char, "seed": a.seed, "repair_kept": kept, "objects_w_h": round(median_aspect(val.boxes), 2),
               **{f"corloc {k}": round(corloc(b, val.boxes), 1) for k, b in answers.items()},
               **{f"iou {k}": round(float(paired_iou(b, val.boxes).mean()), 3) for k, b in answers.items()},
               "seconds": round(time.perf_counter() - t0, 1)}
        print(json.dumps(row, ensure_ascii=False), flush=True)


if __name__ == "__main__":
    main()
