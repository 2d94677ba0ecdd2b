"""Does a verifier learned on printed characters tell *new* digits apart? (issue 13's new-digit `found`; val only.)

`models.verifier`'s check is served only for sets of a kind the verifier was trained on: one trained on other
handwritten digits reached 0.86-0.94 on a new digit at best (BENCHMARKS.md, "How far a better feature could take
`found`"). Printed characters are plentiful (the glyph generator renders any character in this machine's fonts): if a
verifier trained on many of them, plus the bundle's own kind and the background, transferred to handwritten digits,
`mnist-digit4` could ship one and check every set ("open": the set's prototype against every known kind and the
background). This script trains that verifier (``models.verifier.train_verifier``) on the train split of ``--digits``
and of ``--chars`` -- 64 characters that no benchmark of this project draws (not the digits, not the glyph benchmarks'
classes, not the unseen-glyph or API suites, not ``found_kinds_val.py``'s) -- on the four backgrounds, then makes sets
of new digits as the service makes them (5 crops of MNIST's train part) and reads ``--bundle``'s greedy answers on
validation images: 200 of the query, 22 of each other digit ("others") and the same 200 with the digit removed
("empty"). Printed per query and background: the open check's precision / recall at 0.5, the NCC fit's (served
today), and the best ``min(precision, recall)`` of any threshold on the verifier's cosine and on the NCC fit
(``found_verifier_val.best_min_pr``: right answers against wrong ones and the other images' answers).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/found_glyph_verifier_val.py      # ~5 min (training ~100 s)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from found_absent_val import removed  # noqa: E402
from found_verifier_val import best_min_pr  # noqa: E402

from models.bundle import load_bundle  # noqa: E402
from models.calibration import answers, calibrate_policy  # noqa: E402
from models.core.boxes import paired_iou  # noqa: E402
from models.data.cmnist import BACKGROUNDS  # noqa: E402
from models.data.glyphs import glyphs  # noqa: E402
from models.data.types import exemplar_crops  # noqa: E402
from models.experiments.cmnist import cmnist  # noqa: E402
from models.inference import Localizer  # noqa: E402
from models.verifier import TEMPERATURE, resize_crops, train_verifier  # noqa: E402

CHARS = "acdfhijkmnprtuvwxyEFHMNPVX+=<>*~^/|()[]{}!αβγεζηκμνξρστφχωΓΔΛΞΠΣΨ"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--digits", type=int, nargs="*", default=[4], help="digits the verifier learns (the bundle's)")
    p.add_argument("--chars", default=CHARS, help="characters it learns")
    p.add_argument("--per", type=int, default=60, help="train images per character and background (digits: twice)")
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--queries", type=int, nargs="+", default=[2, 7, 9])
    p.add_argument("--bundle", default=str(ROOT / "bundles" / "mnist-digit4.pt"))
    a = p.parse_args()
    torch.set_num_threads(2)
    images, boxes = {}, {}
    for d in a.digits:
        parts = [cmnist(d, "train", 2 * a.per, bg, 0) for bg in BACKGROUNDS]
        images[str(d)], boxes[str(d)] = torch.cat([q.images for q in parts]), torch.cat([q.boxes for q in parts])
    for c in a.chars:
        parts = [glyphs(c, "train", a.per, bg, 0) for bg in BACKGROUNDS]
        images[f"g{c}"], boxes[f"g{c}"] = torch.cat([q.images for q in parts]), torch.cat([q.boxes for q in parts])
    t0 = time.perf_counter()
    v = train_verifier(images, boxes, a.iterations, 0).freeze()
    print(json.dumps({"kinds": len(v.names), "train_s": round(time.perf_counter() - t0, 1)}), flush=True)
    torch.set_grad_enabled(False)
    loc = Localizer(load_bundle(a.bundle), "cpu")
    agent = loc.agent()
    for q in a.queries:
        for bg in ("patch", "clutter"):
            crops = exemplar_crops(cmnist(q, "train", 5, bg, 1000))
            pe = F.normalize(v.embed(resize_crops(crops)).mean(0), dim=-1)
            protos = torch.cat([pe[None], v.kinds])  # the set against every known kind and the background
            proto = loc.prototype(crops)
            cal = calibrate_policy(loc, proto, crops, nearest=loc.default_nearest, n=128, seed=0)
            pos = cmnist(q, "val", 200, bg, 0)
            sets = {"pos": pos.images, "empty": removed(pos.images, pos.boxes, bg),
                    "others": torch.cat([cmnist(o, "val", 22, bg, 0).images for o in range(10) if o != q])}
            r = {}
            for name, imgs in sets.items():
                b, s = answers(loc, agent, proto, imgs, nearest=loc.default_nearest)
                e = v.embed_boxes(imgs, b[:, None])[:, 0]
                r[name] = (b, torch.softmax(TEMPERATURE * e @ protos.T, -1)[:, 0], e @ pe,
                           cal.box_confidence(imgs, b[:, None], s[:, None])[:, 0])
            right = paired_iou(r["pos"][0], pos.boxes) >= 0.5
            row = {"query": q, "bg": bg, "known": round(float((v.kinds[:-1] @ pe).max()), 3),
                   "corloc": round(float(right.float().mean()), 3)}
            for i, label in ((1, "open check"), (3, "ncc fit")):
                f = r["pos"][i] >= 0.5
                tp = int((f & right).sum())
                row[label] = {f"precision vs {k}": round(tp / max(1, int(f.sum()) + int((r[k][i] >= 0.5).sum())), 3)
                              for k in ("others", "empty")} | {"recall": round(tp / len(right), 3)}
            for i, label in ((2, "verifier cosine"), (3, "ncc fit")):
                pos, wrong = r["pos"][i][right], r["pos"][i][~right]
                row[f"best {label}"] = {k: round(best_min_pr(pos, torch.cat([wrong, r[k][i]])), 3)
                                        for k in ("others", "empty")}
            print(json.dumps(row, ensure_ascii=False), flush=True)


if __name__ == "__main__":
    main()
