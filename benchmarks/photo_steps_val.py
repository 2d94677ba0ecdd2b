"""Episode length on the photo **val** splits (tuning; the test split is not read): greedy CorLoc of a
seed bundle before and after adaptation to each new class when episodes stop after T = 6 ... 20 steps.
This is where the agent was seen to walk past objects of new classes (BENCHMARKS.md, photos):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/photo_steps_val.py 1   # the runs/photo3-s1 bundle
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys

import torch

from models.adapt import adapt
from models.bundle import load_bundle
from models.core.metrics import corloc
from models.data.photos import generate, load_manifest
from models.evaluate import localize_boxes
from models.experiments.photos import PHOTO_CLASSES, PhotoTransferSetup, photo_set
from models.features import prototype_of


def main(seed: int) -> None:
    torch.set_num_threads(1)
    b = load_bundle(f"runs/photo3-s{seed}/seed{seed}/bundle.pt", "cpu")
    manifest = load_manifest()
    for c in PHOTO_CLASSES[1:]:
        ex = photo_set(b, manifest, c, "train", 5, seed + 1000, crops=True)
        unl = generate(manifest, c, "train", 64, seed=seed + 2000, size=224)
        val = photo_set(b, manifest, c, "val", 48, seed)
        proto = prototype_of(b, ex)
        cfg = dataclasses.replace(PhotoTransferSetup(c).adapt, seed=seed)
        adapted = adapt(b, proto, unl.images, cfg, device="cpu").agent_state
        row = {"class": c}
        for steps in (6, 8, 10, 12, 15, 20):
            short = copy.copy(b)
            short.config = copy.deepcopy(b.config)
            short.config.env.steps = steps
            row[f"before_T{steps}"] = corloc(localize_boxes(short, b.new_agent(), val, proto)[-1], val.boxes)
            row[f"after_T{steps}"] = corloc(localize_boxes(short, b.new_agent(adapted), val, proto)[-1], val.boxes)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
