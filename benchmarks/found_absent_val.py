"""`found` when the object is simply absent: the same images with the object removed (issue 13; validation only).

`benchmarks/not_found.py` makes the images without the query hold *another digit* (look-alikes: the hard
reading of "half the test images without the query object"). This is the literal reading: each validation image
of the query digit (the val part of MNIST's train file; the test file is not read) and the same image with the
digit removed -- its box set to the background it was pasted on (0 on patch and clutter, whose patches and
fragments never overlap the digit; fresh noise of the same law on gaussian). The set is made as the service makes
a new one (5 exemplar crops, `calibrate_policy`: the NCC fit grayscale sets serve, threshold 0.5), the answers
are the agent's greedy ones (the bundle's `nearest`). Printed per bundle, query and background: precision and
recall of `found` over the two halves (an answer on an image without the digit is wrong; one with it is right at
IoU >= 0.5), the share of empty images called found, and the best ``min(precision, recall)`` of any threshold.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/found_absent_val.py     # ~4 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/found_absent_val.py --thresholds 0.5 0.4 0.3 0.2   # + other digits
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from found_verifier_val import best_min_pr  # noqa: E402

from models.bundle import load_bundle  # noqa: E402
from models.calibration import answers, calibrate_policy  # noqa: E402
from models.core.boxes import paired_iou  # noqa: E402
from models.data.types import exemplar_crops  # noqa: E402
from models.experiments.cmnist import cmnist  # noqa: E402
from models.inference import Localizer  # noqa: E402

BACKGROUNDS = ("patch", "clutter", "gaussian")
N = 200


def removed(images: Tensor, boxes: Tensor, background: str) -> Tensor:
    """``images [n, 1, 84, 84]`` with each one's digit box set to its background (one image at a time: data)."""
    out, gen = images.clone(), torch.Generator().manual_seed(1)
    for i, (x1, y1, x2, y2) in enumerate(boxes.round().long().tolist()):
        if background == "gaussian":  # models.data.cmnist: N(0, 0.12) on black, clipped to [0, 1]
            out[i, :, y1:y2, x1:x2] = (torch.randn(1, y2 - y1, x2 - x1, generator=gen) * 0.12).clamp(0, 1)
        else:
            out[i, :, y1:y2, x1:x2] = 0
    return out


def at_thresholds(loc: Localizer, agent, proto: Tensor, cal, q: int, cp: Tensor, right: Tensor, ce: Tensor,
                  thresholds: list[float], nearest: bool) -> dict:
    """Patch only: per threshold, the recall and the precision of `found` against empty images and against images
    of the other digits (22 val images of each: `not_found.py`'s look-alike reading, on validation images)."""
    others = torch.cat([cmnist(d, "val", 22, "patch", 0).images for d in range(10) if d != q])
    bo, so = answers(loc, agent, proto, others, nearest=nearest)
    co = cal.confidence(so, ncc=cal.templates.ncc(others, bo[:, None])[0][:, 0]).float()
    out = {}
    for t in thresholds:
        found = cp >= t
        tp = int((found & right).sum())
        out[str(t)] = {"recall": round(tp / max(1, int(right.sum())), 3),
                       "precision_vs_empty": round(tp / max(1, int(found.sum()) + int((ce >= t).sum())), 3),
                       "precision_vs_other_digits": round(tp / max(1, int(found.sum()) + int((co >= t).sum())), 3)}
    return out


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--thresholds", type=float, nargs="*", default=[],
                   help="also, on patch: recall and precision against empty images and other digits at these")
    a = p.parse_args()
    torch.set_num_threads(1)
    for name in ("mnist-digit4", "mnist-general"):
        loc = Localizer(load_bundle(ROOT / "bundles" / f"{name}.pt"), "cpu")
        agent, nearest = loc.agent(), loc.default_nearest
        for q in (4, 2, 7, 9):
            crops = exemplar_crops(cmnist(q, "train", 5, "patch", 1000))
            proto = loc.prototype(crops)
            cal = calibrate_policy(loc, proto, crops, nearest=nearest, n=128, seed=0)
            assert cal.templates is not None
            row: dict = {"bundle": name, "query": q, "new_to_bundle": name == "mnist-digit4" and q != 4}
            for bg in BACKGROUNDS:
                pos = cmnist(q, "val", N, bg, 0)
                empty = removed(pos.images, pos.boxes, bg)
                bp, sp = answers(loc, agent, proto, pos.images, nearest=nearest)
                be, se = answers(loc, agent, proto, empty, nearest=nearest)
                right = paired_iou(bp, pos.boxes) >= 0.5
                cp = cal.confidence(sp, ncc=cal.templates.ncc(pos.images, bp[:, None])[0][:, 0]).float()
                ce = cal.confidence(se, ncc=cal.templates.ncc(empty, be[:, None])[0][:, 0]).float()
                fp, fe = cp >= cal.threshold, ce >= cal.threshold
                tp = int((fp & right).sum())
                row[bg] = {"corloc": round(float(right.float().mean()) * 100, 1),
                           "precision": round(tp / max(1, int(fp.sum()) + int(fe.sum())), 3),
                           "recall": round(tp / max(1, int(right.sum())), 3),
                           "found_on_empty": round(float(fe.float().mean()), 3),
                           # wrong answers on the query's images count as negatives, as empty images do
                           "best_min_pr": round(best_min_pr(cp[right], torch.cat([cp[~right], ce])), 3)}
                if bg == "patch" and a.thresholds:
                    row["patch_thresholds"] = at_thresholds(loc, agent, proto, cal, q, cp, right, ce, a.thresholds,
                                                            nearest)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
