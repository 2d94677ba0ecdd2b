"""Does the answer follow the query? Two real photographs of different classes in one image, asked for each.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/real_photo_pairs.py --bundle bundles/photo-general.pt \\
        --out runs/real_photo_pairs.json

The real-photo benchmark (``benchmarks/real_photos.py``) has one object per photo, so a method that finds *an*
object, whatever the exemplars, scores as well there as one that finds the object asked for. Here each photo
of a split is joined with one photo of another class of the same split (``pairs``: the partner drawn with a
fixed seed), the two scaled to a common side and stacked along their short side (``stitch``: two landscape
photos one above the other, so the result stays near square), and the image is localized twice: with the
exemplars of the first photo's class, then of the second's. Each query's answer is scored against its own
photo's hand-drawn box (IoU >= 0.5). A method blind to the query gives both queries the same box, so it
answers at most one of the two; ``same_answer`` is the share of pairs whose two answers overlap at IoU >= 0.5.

Exemplars, methods and settings are ``benchmarks/real_photos.py``'s (the exemplar split's boxes cut from
their photos; ``greedy``, ``nearest``, ``instances`` = the first of ``max_instances=4``, ``ranking_eq`` and
``template``); nothing is chosen here. Prints one JSON line per split and method, and a markdown table to
stderr; ``--out`` gets the per-query IoUs as well.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.real_photos import (  # noqa: E402
    TEMPLATE_FRACTIONS,
    _scale,
    candidates_within,
    exemplar_crops,
    input_crops,
    instance_evaluations,
)
from models.bundle import load_bundle  # noqa: E402
from models.core.boxes import paired_iou  # noqa: E402
from models.data import realphotos  # noqa: E402
from models.data.types import LabeledImages  # noqa: E402
from models.evaluate import ranking  # noqa: E402
from models.experiments.baselines import template_matching  # noqa: E402
from models.inference import Localizer, preprocess  # noqa: E402

SIDE = 640
"""The common side of the two photos (their width when stacked vertically, else their height)."""
METHODS = ("greedy", "nearest", "instances", "ranking_eq", "template")


def pairs(photos: list[realphotos.RealPhoto], seed: int = 0) -> list[tuple[realphotos.RealPhoto, ...]]:
    """Each photo with a partner of another class drawn uniformly (fixed ``seed``), in a random order."""
    rng = np.random.default_rng(seed)
    out = []
    for p in photos:
        others = [q for q in photos if q.cls != p.cls]
        q = others[int(rng.integers(len(others)))]
        out.append((p, q) if rng.random() < 0.5 else (q, p))
    return out


def stitch(a: realphotos.RealPhoto, b: realphotos.RealPhoto, side: int = SIDE
           ) -> tuple[Image.Image, list[tuple[float, ...]]]:
    """Two photos -> one image (stacked along their short side) and the two boxes in its pixels."""
    wide = (a.image.width / a.image.height + b.image.width / b.image.height) / 2 >= 1.0
    parts, boxes, at = [], [], 0
    for p in (a, b):
        f = side / (p.image.width if wide else p.image.height)
        im = p.image.resize((round(p.image.width * f), round(p.image.height * f)), Image.Resampling.BILINEAR)
        dx, dy = (0, at) if wide else (at, 0)
        x1, y1, x2, y2 = p.box
        boxes.append((x1 * f + dx, y1 * f + dy, x2 * f + dx, y2 * f + dy))
        parts.append((im, dx, dy))
        at += im.height if wide else im.width
    canvas = Image.new("RGB", (side, at) if wide else (at, side))
    for im, dx, dy in parts:
        canvas.paste(im, (dx, dy))
    return canvas, boxes


def evaluate(loc: Localizer, split: str, seed: int = 0, methods: tuple[str, ...] = METHODS) -> list[dict[str, Any]]:
    """Every method on the stitched pairs of ``split`` -> one row per method."""
    bundle, spec = loc.bundle, loc.spec
    classes = realphotos.classes()
    ex = {c: realphotos.load("exemplar", c) for c in classes}
    protos = {c: loc.prototype(exemplar_crops(ex[c], spec.channels, spec.fill)) for c in classes}
    templates = {c: input_crops(bundle, ex[c]) for c in classes}
    eq_cands, _ = candidates_within(bundle, instance_evaluations(bundle))
    agent = loc.agent(None)
    zero = torch.zeros(1, 4)

    def answer(batch, scales, cls, **kw):
        r = loc.localize_batch(batch, scales, protos[cls], agent, **kw)[0]
        return r.instances[0].box if kw.get("max_instances", 1) > 1 and r.instances else r.box

    run: dict[str, Callable] = {
        "greedy": lambda b, s, c: answer(b, s, c, nearest=False),
        "nearest": lambda b, s, c: answer(b, s, c, nearest=True),
        "instances": lambda b, s, c: answer(b, s, c, max_instances=4),
        "ranking_eq": lambda b, s, c: _scale(ranking(bundle, LabeledImages(b, zero), protos[c], eq_cands, batch=1),
                                             s)[0].tolist(),
        "template": lambda b, s, c: _scale(template_matching(b, templates[c], TEMPLATE_FRACTIONS,
                                                             ref_side=float(spec.size)), s)[0].tolist(),
    }
    got: dict[str, list] = {m: [] for m in methods}
    truth = []
    for a, b in pairs(realphotos.load(split), seed):
        image, boxes = stitch(a, b)
        batch, scales = preprocess([image], spec)
        truth.append(boxes)
        for m in methods:
            got[m].append([run[m](batch, scales, p.cls) for p in (a, b)])
    gt = torch.tensor(truth, dtype=torch.float32)  # [P, 2, 4]
    rows = []
    for m in methods:
        pred = torch.tensor(got[m], dtype=torch.float32)
        iou = paired_iou(pred.reshape(-1, 4), gt.reshape(-1, 4)).reshape(-1, 2)
        hit = iou >= 0.5
        same = paired_iou(pred[:, 0], pred[:, 1]) >= 0.5
        rows.append({"split": split, "method": m, "pairs": len(truth), "queries": int(hit.numel()),
                     "corloc": round(float(hit.float().mean() * 100), 2),
                     "both": round(float(hit.all(1).float().mean() * 100), 2),
                     "same_answer": round(float(same.float().mean() * 100), 2),
                     "mean_iou": round(float(iou.mean()), 4), "iou": [[round(float(v), 3) for v in r] for r in iou]})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="bundles/photo-general.pt")
    ap.add_argument("--splits", nargs="+", default=["val", "test"], choices=["val", "test"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--seed", type=int, default=0, help="the partners' draw")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    loc = Localizer(load_bundle(a.bundle), "cpu")
    rows = []
    for split in a.splits:
        for r in evaluate(loc, split, a.seed, tuple(a.methods)):
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "iou"}), flush=True)
    print("| split | method | pairs | CorLoc | both right | same answer | mean IoU |\n|---|---|---|---|---|---|---|",
          file=sys.stderr)
    for r in rows:
        print(f"| {r['split']} | {r['method']} | {r['pairs']} | {r['corloc']:.1f} | {r['both']:.1f} | "
              f"{r['same_answer']:.1f} | {r['mean_iou']:.3f} |", file=sys.stderr)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({
            "command": "benchmarks/real_photo_pairs.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "bundle": a.bundle, "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": platform.machine(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
