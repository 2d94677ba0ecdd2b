"""The known-kinds verifier's check as the service serves it, on validation images (issue 13; validation only).

`models.verifier`: for a set of a kind the bundle's verifier knows, ``found`` is the verifier's probability that the
answer's box is the set's kind rather than another known kind, the background or a negative exemplar. This script
makes each set as the service makes a new one (5 exemplar crops of MNIST's train part, `calibrate_policy` with the
verifier: the NCC fit and, where the set's prototype is within ``KNOWN_BAR`` of a known kind, the kind check) and
reads `mnist-general`'s greedy answers on validation images (the val part of MNIST's train file; glyphs' val split):

- each digit's query: 200 images of it, 22 of each other digit ("others": the look-alike reading of "half the
  images without the query object") and the same 200 with the digit removed ("empty": the literal reading);
- ``--draws``: more exemplar draws per digit and background, for the ``known`` score alone (does every digit set
  pass ``KNOWN_BAR``?); glyph sets (kinds the verifier never saw) likewise: which pass it?

Printed per set: ``known`` and the matched kind, whether the check applies, and precision (vs others, vs empty) /
recall of `found` by the served confidence (the check's where it applies) and by the NCC fit alone.

``--negatives``: instead, the choice of ``NEGATIVE_BAR`` -- queries with 5 crops each of their two look-alike digits
as negative exemplars (`not_found.py`'s), `found` against other digits with the check made without negatives, with
every negative as a prototype, and leaving out those within each bar of another known kind.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/found_kinds_val.py [--verifier FILE]   # ~6 min
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/found_kinds_val.py --negatives          # ~1 min
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from found_absent_val import removed  # noqa: E402

from models.bundle import load_bundle  # noqa: E402
from models.calibration import answers, calibrate_policy  # noqa: E402
from models.core.boxes import paired_iou  # noqa: E402
from models.data.cmnist import BACKGROUNDS  # noqa: E402
from models.data.glyphs import glyphs  # noqa: E402
from models.data.types import exemplar_crops  # noqa: E402
from models.experiments.cmnist import cmnist  # noqa: E402
from models.inference import Localizer  # noqa: E402
from models.verifier import KNOWN_BAR, load_verifier, resize_crops  # noqa: E402

GLYPHS = ["A", "K", "e", "?", "R", "W", "g", "#", "O", "o", "S", "s", "Z", "z", "l", "I", "b", "q", "B", "G", "D",
          "Q", "T", "L", "U", "C", "J", "Y", "&", "%"]


def digit(d, split, n, seed, bg):
    return cmnist(d, split, n, bg, seed)


def glyph(c, split, n, seed, bg):
    return glyphs(c, split, n, bg, seed)


@torch.no_grad()
def served(loc: Localizer, verifier, make, kind, others, bg: str, draw: int, full: bool) -> dict:
    ex = make(kind, "train", 5, draw, bg)
    crops = exemplar_crops(ex)
    check = verifier.check(crops)
    _, at, known = verifier.nearest_kind(crops)
    row = {"kind": kind, "bg": bg, "draw": draw, "known": round(known, 3), "nearest": verifier.names[at],
           "check": None if check is None else check.kind}
    if not full:
        return row
    proto = loc.prototype(crops)
    cal = calibrate_policy(loc, proto, crops, nearest=loc.default_nearest, n=128, seed=0, verifier=verifier)
    pos = make(kind, "val", 200, 0, bg)
    agent = loc.agent()
    sets = {"pos": pos.images, "others": torch.cat([make(o, "val", 22, 0, bg).images for o in others]),
            "empty": removed(pos.images, pos.boxes, bg)}
    conf = {}
    for name, imgs in sets.items():
        b, s = answers(loc, agent, proto, imgs, nearest=loc.default_nearest)
        conf[name] = (b, cal.box_confidence(imgs, b[:, None], s[:, None], verifier=verifier)[:, 0],
                      cal.box_confidence(imgs, b[:, None], s[:, None])[:, 0])
    right = paired_iou(conf["pos"][0], pos.boxes) >= 0.5
    for i, label in ((1, "served"), (2, "ncc")):
        f = conf["pos"][i] >= cal.threshold
        tp = int((f & right).sum())
        row[label] = {k: round(tp / max(1, tp + int((f & ~right).sum()) + int((conf[k][i] >= cal.threshold).sum())), 3)
                      for k in ("others", "empty")} | {"recall": round(tp / len(right), 3)}
    row["corloc"] = round(float(right.float().mean()), 3)
    return row


LOOKALIKES = {4: (7, 9), 7: (1, 9), 2: (3, 7), 9: (4, 7), 1: (7, 4), 3: (5, 8), 5: (3, 6), 8: (3, 0)}


@torch.no_grad()
def negatives(loc: Localizer, verifier, q: int, bars=(0.92, 0.8, 0.7)) -> dict:
    crops = exemplar_crops(cmnist(q, "train", 5, "patch", 1000))
    negs = [c for d in LOOKALIKES[q] for c in exemplar_crops(cmnist(d, "train", 5, "patch", 2000))]
    base = verifier.check(crops)
    e = verifier.embed(resize_crops(negs))
    sims = e @ verifier.kinds[:-1].T
    other = sims.argmax(1) != verifier.names.index(base.kind)
    checks = {"none": base, "all": replace(base, others=base.others + e.tolist())}
    checks |= {f"bar {b}": replace(base, others=base.others + e[~((sims.max(1).values >= b) & other)].tolist())
               for b in bars}
    proto, agent = loc.prototype(crops), loc.agent()
    pos = cmnist(q, "val", 200, "patch", 0)
    oth = torch.cat([cmnist(d, "val", 22, "patch", 0).images for d in range(10) if d != q])
    bp, _ = answers(loc, agent, proto, pos.images, nearest=loc.default_nearest)
    bo, _ = answers(loc, agent, proto, oth, nearest=loc.default_nearest)
    right = paired_iou(bp, pos.boxes) >= 0.5
    ep, eo = verifier.embed_boxes(pos.images, bp[:, None])[:, 0], verifier.embed_boxes(oth, bo[:, None])[:, 0]
    row: dict = {"query": q, "negatives": list(LOOKALIKES[q])}
    for name, c in checks.items():
        fp, fo = c.probability(ep) >= 0.5, c.probability(eo) >= 0.5
        tp = int((fp & right).sum())
        row[name] = {"precision": round(tp / max(1, int(fp.sum()) + int(fo.sum())), 3),
                     "recall": round(tp / max(1, int(right.sum())), 3)}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verifier", default=str(ROOT / "bundles" / "mnist-general.verifier"))
    p.add_argument("--draws", type=int, default=3, help="exemplar draws per digit and background for known alone")
    p.add_argument("--negatives", action="store_true", help="the choice of NEGATIVE_BAR instead")
    a = p.parse_args()
    torch.set_num_threads(2)
    verifier = load_verifier(a.verifier)
    loc = Localizer(load_bundle(ROOT / "bundles" / "mnist-general.pt"), "cpu")
    print(json.dumps({"known_bar": KNOWN_BAR, "verifier": verifier.sha256}), flush=True)
    if a.negatives:
        for q in LOOKALIKES:
            print(json.dumps(negatives(loc, verifier, q)), flush=True)
        return
    for d in range(10):
        for bg in ("patch", "clutter"):
            print(json.dumps(served(loc, verifier, digit, d, [o for o in range(10) if o != d], bg, 1000, True)),
                  flush=True)
    for d in range(10):
        for bg in BACKGROUNDS:
            for draw in range(1001, 1001 + a.draws):
                print(json.dumps(served(loc, verifier, digit, d, None, bg, draw, False)), flush=True)
    for c in GLYPHS:
        print(json.dumps(served(loc, verifier, glyph, c, None, "patch", 1000, False)), flush=True)
    for c in ("O", "o", "A", "D"):
        print(json.dumps(served(loc, verifier, glyph, c, [o for o in GLYPHS[:8] if o != c], "patch", 1000, True)),
              flush=True)


if __name__ == "__main__":
    main()
