"""Photo localization speed with the last-box and the nearest answer, beside the backbone alone:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/photo_speed.py [--bundle bundles/photo-mammals.pt] [--repeats 10]

Images: 16 generated mammals test photos (224 px); prototype: 5 exemplar crops from the train split.
One JSON object: ``models.experiments.photos.measure_speed`` for each answer rule, measured in turn.
"""

from __future__ import annotations

import argparse
import json

import torch

from models.bundle import load_bundle
from models.data import photo_cache_dir
from models.data.photos import generate, load_manifest
from models.experiments.photos import photo_set
from models.experiments.speed import measure_speed
from models.features import prototype_of


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bundle", default="bundles/photo-mammals.pt")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache", default=str(photo_cache_dir()))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    manifest, b = load_manifest(a.cache), load_bundle(a.bundle, "cpu")
    proto = prototype_of(b, photo_set(b, manifest, "mammals", "train", 5, 1000, crops=True))
    images = generate(manifest, "mammals", "test", 16, seed=0, size=b.config.input.size).images
    out = {"bundle": a.bundle, "threads": a.threads}
    for name, nearest in (("last", False), ("nearest", True)):
        out[name] = measure_speed(b, images, proto, batch_sizes=(1, 16), repeats=a.repeats, nearest=nearest)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
