"""Adaptation settings on the photo **val** splits of the new classes (tuning; the test split is not read).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/photo_adapt_val.py --bundle runs/photo2/seed0/bundle.pt \
        --seed 0 --variant kl0 kl_coef=0 --variant kl5 kl_coef=5 iterations=300

Each ``--variant NAME KEY=VALUE ...`` overrides fields of the benchmark's ``AdaptConfig`` (with no
``--variant``, the benchmark's settings run alone as ``default``). One JSON line per class: CorLoc
before adaptation and, per variant, after adaptation (greedy and best of 16). The bundle is a
``qloc photo-reproduce`` seed bundle; exemplars and unlabeled images are drawn as in the benchmark
(class train split), the evaluation images from the class's val split.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from models.adapt import AdaptConfig, adapt
from models.bundle import load_bundle
from models.core.metrics import corloc
from models.data import photo_cache_dir
from models.data.photos import generate, load_manifest
from models.evaluate import localize_boxes
from models.experiments.photos import PHOTO_CLASSES, PhotoTransferSetup, photo_set
from models.features import prototype_of


def variant(base: AdaptConfig, overrides: list[str]) -> AdaptConfig:
    """``base`` with ``KEY=VALUE`` overrides, each value parsed as the field's type."""
    types = {f.name: type(getattr(base, f.name)) for f in dataclasses.fields(base)}
    changes = {}
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in types:
            raise SystemExit(f"unknown AdaptConfig field {key!r}; fields: {sorted(types)}")
        changes[key] = value.lower() in ("1", "true", "yes") if types[key] is bool else types[key](value)
    return dataclasses.replace(base, **changes)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bundle", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variant", nargs="+", action="append", metavar=("NAME", "KEY=VALUE"),
                   help="a named set of AdaptConfig overrides (repeatable)")
    p.add_argument("--n-val", type=int, default=48)
    p.add_argument("--train-class", default="mammals")
    p.add_argument("--classes", nargs="+", default=list(PHOTO_CLASSES))
    p.add_argument("--cache", default=str(photo_cache_dir()))
    a = p.parse_args()
    torch.set_num_threads(1)
    manifest, b, s = load_manifest(a.cache), load_bundle(a.bundle, "cpu"), a.seed
    variants = {v[0]: v[1:] for v in (a.variant or [["default"]])}
    for c in a.classes:
        if c == a.train_class:
            continue
        ex = photo_set(b, manifest, c, "train", 5, s + 1000, crops=True)
        unl = generate(manifest, c, "train", PhotoTransferSetup(c).unlabeled, seed=s + 2000, size=b.config.input.size)
        val = photo_set(b, manifest, c, "val", a.n_val, s)
        proto = prototype_of(b, ex)
        row = {"seed": s, "class": c, "before": corloc(localize_boxes(b, b.new_agent(), val, proto)[-1], val.boxes)}
        for name, overrides in variants.items():
            cfg = variant(dataclasses.replace(PhotoTransferSetup(c).adapt, seed=s), overrides)
            agent = b.new_agent(adapt(b, proto, unl.images, cfg, device="cpu").agent_state)
            row[name] = corloc(localize_boxes(b, agent, val, proto)[-1], val.boxes)
            row[f"{name}_best16"] = corloc(localize_boxes(b, agent, val, proto, samples=15, seed=s)[-1], val.boxes)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
