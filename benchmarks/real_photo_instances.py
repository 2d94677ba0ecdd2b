"""Instance queries on the real photographs (issue 15): the same object in several photos (``instance`` in the
annotations: OpenCV's cookie box in ``box.png`` / ``box_in_scene.png``, the Eiffel Tower in three photos, ...).
Each photo's box is cut as the one exemplar, and every *other* photo of the same object is localized with it
(the service's default answer of the bundle), every ordered pair once. Prints each pair's IoU and the CorLoc
(IoU >= 0.5) per bundle.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/real_photo_instances.py [--bundles NAME ...]  # qloc fetch-real-photos
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.bundle import load_bundle  # noqa: E402
from models.core.boxes import paired_iou  # noqa: E402
from models.data import realphotos  # noqa: E402
from models.inference import Localizer  # noqa: E402


@torch.no_grad()
def main(bundles: list[str]) -> None:
    torch.set_num_threads(1)
    groups: dict[str, list[realphotos.RealPhoto]] = {}
    for p in realphotos.load("all"):
        if p.instance:
            groups.setdefault(p.instance, []).append(p)
    for name in bundles:
        loc = Localizer(load_bundle(ROOT / "bundles" / f"{name}.pt", "cpu"), "cpu")
        hits = []
        for inst, photos in sorted(groups.items()):
            for q in photos:
                proto = loc.prototype([q.image.crop(tuple(round(v) for v in q.box))])  # a PIL crop, as uploads
                for t in photos:
                    if t is q:
                        continue
                    box = loc.localize([t.image], proto)[0].box
                    iou = float(paired_iou(torch.tensor([box]), torch.tensor([t.box]))[0])
                    hits.append(iou >= 0.5)
                    print(json.dumps({"bundle": name, "instance": inst, "exemplar": q.file_name,
                                      "target": t.file_name, "iou": round(iou, 3)}), flush=True)
        print(json.dumps({"bundle": name, "pairs": len(hits),
                          "corloc": round(100 * sum(hits) / max(1, len(hits)), 1)}), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundles", nargs="+", default=["photo-mammals", "photo-general"])
    main(ap.parse_args().bundles)
