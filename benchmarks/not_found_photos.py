"""Why the NCC features of the calibration are for grayscale bundles only: "not found" on photos.

For each class (``photo-mammals`` bundle as shipped; 5 exemplar crops of the class, train split), 40 validation
composites of the class (positives) and 8 of each other class (the class absent), the photo default's answers;
the set's calibration made as the service makes it, once with the score's fit only and once with the NCC fit
(``ncc=True``). Right = IoU >= 0.5 with the class's object; ``found`` = confidence >= 0.5. Prints precision,
recall, ECE and the AUROC of the confidence for right answers, per class and fit, and the calibration's own
AUROCs on its samples (``stats``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/not_found_photos.py   # needs `qloc fetch-photos`
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.bundle import load_bundle  # noqa: E402
from models.calibration import answers, calibrate_policy  # noqa: E402
from models.core.boxes import paired_iou  # noqa: E402
from models.core.platt import auroc, expected_calibration_error  # noqa: E402
from models.data.photos import CLASSES, generate, load_manifest  # noqa: E402
from models.data.photos import crops as photo_crops  # noqa: E402
from models.inference import Localizer  # noqa: E402

QUERIES = ("mammals", "birds", "fruit", "flowers")


def main() -> None:
    torch.set_num_threads(1)
    loc = Localizer(load_bundle(ROOT / "bundles" / "photo-mammals.pt"), "cpu")
    manifest = load_manifest(ROOT / "data" / "photos")
    size, agent, nearest = loc.spec.size, loc.agent(), loc.default_nearest
    for q in QUERIES:
        crops = photo_crops(generate(manifest, q, "train", 5, seed=1000, size=size))
        proto = loc.prototype(crops)
        pos = generate(manifest, q, "val", 40, seed=5, size=size)
        others = torch.cat([generate(manifest, o, "val", 8, seed=6, size=size).images for o in CLASSES if o != q])
        images = torch.cat([pos.images, others])
        boxes, scores = answers(loc, agent, proto, images, nearest=nearest)
        right = torch.zeros(len(images), dtype=torch.bool)
        right[:len(pos.images)] = paired_iou(boxes[:len(pos.images)], pos.boxes) >= 0.5
        cal = calibrate_policy(loc, proto, crops, nearest=nearest, n=128, seed=0, ncc=True)
        assert cal.templates is not None
        ncc, _ = cal.templates.ncc(images, boxes[:, None])
        for fit, conf in (("score", cal.confidence(scores)), ("ncc", cal.confidence(scores, ncc=ncc[:, 0]))):
            found = conf >= cal.threshold
            tp = int((found & right).sum())
            print(json.dumps({"class": q, "fit": fit, "images": len(images), "right": int(right.sum()),
                              "precision": round(tp / max(1, int(found.sum())), 3),
                              "recall": round(tp / max(1, int(right.sum())), 3),
                              "ece": round(expected_calibration_error(conf.double(), right), 3),
                              "auroc": round(auroc(conf.double(), right), 3),
                              "fit_auroc_score": cal.stats["auroc_score"], "fit_auroc_ncc": cal.stats["auroc_ncc"]}),
                  flush=True)


if __name__ == "__main__":
    main()
