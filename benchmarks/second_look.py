"""Rules for a second look at doubtful answers (``rerank=auto``), compared on each image's answer and candidates.

Two steps. ``collect`` asks a running service (``./scripts/run``), through ``app.client.QlocClient``, for every image
of each target: the agent's answer and its 4 several-instances candidates (``max_instances=4``, ``rerank=false``),
each with its calibrated confidence, and writes them with their IoU with the true box, one JSON line per target:

    .venv/bin/python benchmarks/second_look.py collect --url http://127.0.0.1:8031 --split val \\
        --targets glyph:A:patch digit:4:patch:absent --out runs/second-look-val.jsonl [--adapt]

A target is ``glyph:CHAR:BACKGROUND`` or ``digit:D:BACKGROUND``; ``:absent`` adds 198 images of the other digits
(22 each), where every answer is wrong and ``found`` is a false alarm. Per target: an exemplar set of 5 crops on the
default bundle, 200 images of ``--split``; ``--adapt`` first runs an adaptation job on 64 unlabeled images with the
server's defaults and answers with its active checkpoint (else the starting policy).

``rules`` replays every rule on those answers (no server): the CorLoc each would give (and, with images without the
object, its false alarms there and the precision / recall of ``found``), per group of targets, and each rule's worst
change against the agent's answer:

    .venv/bin/python benchmarks/second_look.py rules runs/second-look-val.jsonl ...
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _client import to_png  # noqa: E402

from app.client import QlocClient  # noqa: E402
from models.bundle import load_bundle  # noqa: E402
from models.core.boxes import paired_iou  # noqa: E402
from models.data.types import exemplar_crops  # noqa: E402
from models.experiments.datasets import CMnistKind, GlyphKind  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

Rule = Callable[[float, float, float], bool]
"""(the answer's confidence, the likeliest candidate's, the set's threshold) -> take the candidate."""

RULES: dict[str, tuple[str, Rule]] = {
    "agent": ("the agent's answer (`rerank=false`)", lambda c, b, t: False),
    "below": ("any answer below the threshold, any likelier candidate", lambda c, b, t: c < t and b > c),
    "below-found": ("below the threshold, a candidate reaching it", lambda c, b, t: c < t and b >= t),
    "below-margin": ("below the threshold, a candidate likelier by 0.3", lambda c, b, t: c < t and b > c + 0.3),
    "half": ("below half the threshold, any likelier candidate", lambda c, b, t: c < t / 2 and b > c),
    "half-found": ("below half the threshold, a candidate reaching it (`rerank=auto`)",
                   lambda c, b, t: c < t / 2 and b >= t),
}


def iou(k: int, box: list[float], truth: torch.Tensor, n_present: int) -> float:
    """IoU of image ``k``'s ``box`` with its true box; 0 on the images without the object (``k >= n_present``)."""
    return float(paired_iou(torch.tensor([box]), truth[k:k + 1])[0]) if k < n_present else 0.0


def collect(a: argparse.Namespace) -> None:
    with QlocClient(a.url) as qloc, open(a.out, "a") as out:
        bundle = load_bundle(ROOT / "bundles" / f"{qloc.bundles()['default']}.pt", "cpu")
        for target in a.targets:
            what, name, background, *extra = target.split(":")
            kind = GlyphKind(name, background) if what == "glyph" else CMnistKind(int(name), background)
            ex, test = kind.draw(bundle, "exemplars", 5, a.seed), kind.draw(bundle, a.split, 200, a.seed)
            images, n_present = test.images, len(test.images)
            if "absent" in extra:
                images = torch.cat([images] + [CMnistKind(d, background).draw(bundle, a.split, 22, a.seed).images
                                               for d in range(10) if d != int(name)])
            pngs = [(f"{i}.png", to_png(x)) for i, x in enumerate(images)]
            s = qloc.create_exemplar_set([(f"c{i}.png", to_png(c)) for i, c in enumerate(exemplar_crops(ex))],
                                         name=f"second look {target}")
            if a.adapt:
                unl = kind.draw(bundle, "unlabeled", 64, a.seed, after=5)
                qloc.wait(qloc.create_adaptation(s.id, [(f"u{i}.png", to_png(x)) for i, x in enumerate(unl.images)]),
                          progress=False, poll=2.0)
            answers = []
            for i in range(0, len(pngs), 64):
                answers += qloc.localize(s.id, pngs[i:i + 64], max_instances=4, rerank=False).results

            rows = [{"present": k < n_present, "confidence": r.confidence, "iou": iou(k, r.box, test.boxes, n_present),
                     "candidates": [[c.confidence, iou(k, c.box, test.boxes, n_present)] for c in r.instances or []]}
                    for k, r in enumerate(answers)]
            threshold = qloc.get_exemplar_set(s.id).model_extra.get("threshold", 0.5)
            out.write(json.dumps({"target": target, "split": a.split, "seed": a.seed, "adapted": a.adapt,
                                  "threshold": threshold, "images": rows}, ensure_ascii=False) + "\n")
            out.flush()
            print(target, "done", file=sys.stderr, flush=True)
            qloc.delete_exemplar_set(s.id)


def replay(record: dict, rule: Rule) -> tuple[float, int, int, int]:
    """A target's CorLoc under ``rule``; its false alarms (``found`` on images without the object); its answers
    ``found`` and right (IoU >= 0.5), and ``found`` in all (the precision and recall of ``found``)."""
    t = record["threshold"]
    right = present = alarms = found_right = found = 0
    for im in record["images"]:
        best = max(im["candidates"], key=lambda c: c[0], default=[im["confidence"], im["iou"]])
        confidence, iou = best if rule(im["confidence"], best[0], t) else (im["confidence"], im["iou"])
        found += confidence >= t
        if im["present"]:
            present, right = present + 1, right + (iou >= 0.5)
            found_right += confidence >= t and iou >= 0.5
        else:
            alarms += confidence >= t
    return 100.0 * right / max(present, 1), alarms, found_right, found


def group(record: dict) -> str:
    what, _, background, *extra = record["target"].split(":")
    state = "after the job" if record["adapted"] else "starting policy"
    return f"{what}s on {background}{', with absent' if extra else ''}, {state}"


def rules(paths: list[str]) -> None:
    records = [json.loads(line) for p in paths for line in Path(p).read_text().splitlines() if line.strip()]
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(group(r), []).append(r)
    print("| rule | " + " | ".join(f"{g} ({len(rs)})" for g, rs in groups.items()) + " | worst change |")
    print("|---" * (len(groups) + 2) + "|")
    for label, rule in RULES.values():
        cells, worst = [], 0.0
        for rs in groups.values():
            scores = [replay(r, rule) for r in rs]
            worst = min([worst] + [s[0] - replay(r, RULES["agent"][1])[0] for s, r in zip(scores, rs, strict=True)])
            cell = f"{sum(s[0] for s in scores) / len(scores):.1f}"
            if any("absent" in r["target"] for r in rs):  # found: precision / recall over the group's images
                present = sum(im["present"] for r in rs for im in r["images"])
                right, found = sum(s[2] for s in scores), sum(s[3] for s in scores)
                cell += (f" ({sum(s[1] for s in scores)} false alarms; found P / R {right / max(found, 1):.3f} / "
                         f"{right / max(present, 1):.3f})")
            cells.append(cell)
        print(f"| {label} | " + " | ".join(cells) + f" | {worst:+.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--url", default="http://127.0.0.1:8000")
    c.add_argument("--targets", nargs="+", required=True)
    c.add_argument("--split", choices=("val", "test"), default="val")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--adapt", action="store_true")
    c.add_argument("--out", required=True)
    r = sub.add_parser("rules")
    r.add_argument("files", nargs="+")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.step == "collect":
        collect(a)
    else:
        rules(a.files)


if __name__ == "__main__":
    main()
