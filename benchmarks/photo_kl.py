"""Adaptation settings on the photo **val** splits of the new classes (tuning; the test split is not read).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/photo_kl.py --bundle runs/photo2/seed0/bundle.pt --seed 0 \
        --kl 0 1 5 --iterations 100

One JSON line per class: CorLoc before adaptation and, for each KL weight, after adaptation (greedy and
best of 16). The bundle is a ``qloc photo-reproduce`` seed bundle; exemplars and unlabeled images are
drawn as in the benchmark (class train split), the evaluation images from the class's val split.
"""

from __future__ import annotations

import argparse
import json

import torch

from models.adapt import adapt
from models.bundle import load_bundle
from models.metrics import corloc
from models.photo_experiments import PHOTO_CLASSES, PhotoTransferSetup, localize, photo_set, prototype_of
from models.photos import DEFAULT_CACHE, generate, load_manifest


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bundle", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kl", type=float, nargs="+", default=[0.0, 1.0, 5.0])
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--n-val", type=int, default=48)
    p.add_argument("--train-class", default="mammals")
    p.add_argument("--cache", default=str(DEFAULT_CACHE))
    a = p.parse_args()
    torch.set_num_threads(1)
    manifest, b, s = load_manifest(a.cache), load_bundle(a.bundle, "cpu"), a.seed
    for c in PHOTO_CLASSES:
        if c == a.train_class:
            continue
        ex = photo_set(b, manifest, c, "train", 5, s + 1000, crops=True)
        unl = generate(manifest, c, "train", PhotoTransferSetup(c).unlabeled, seed=s + 2000, size=b.config.input.size)
        val = photo_set(b, manifest, c, "val", a.n_val, s)
        proto = prototype_of(b, ex)
        row = {"seed": s, "class": c, "before": corloc(localize(b, b.new_agent(), val.feats, proto)[-1], val.boxes)}
        for kl in a.kl:
            cfg = PhotoTransferSetup(c).adapt
            cfg.seed, cfg.kl_coef, cfg.iterations = s, kl, a.iterations
            agent = b.new_agent(adapt(b, proto, unl.images, cfg, device="cpu").agent_state)
            row[f"kl{kl:g}"] = corloc(localize(b, agent, val.feats, proto)[-1], val.boxes)
            row[f"kl{kl:g}_best16"] = corloc(localize(b, agent, val.feats, proto, samples=15, seed=s)[-1], val.boxes)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
