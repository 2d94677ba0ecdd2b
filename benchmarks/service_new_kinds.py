"""New kinds of objects through the API, as a user would try them: the service's defaults, the shipped client.

For each glyph character (``--kinds``: kinds of objects no run or choice has used, fixed before the run) and seed,
through HTTP against a running service (``./scripts/run``: the embedded default, its worker included), with
``app.client.QlocClient``:

1. an exemplar set of 5 exemplar crops (PNG), on the default bundle (no ``bundle`` field);
2. localize 200 test images (held-out fonts; ``--split``) with ``checkpoint=base``: CorLoc before;
3. an adaptation job on 64 unlabeled images with every job field left to the server (``activate=auto``), waited for;
4. localize the same test images with ``checkpoint=active``: CorLoc after (= before when nothing was activated);
5. template matching (``models.experiments.baselines``, no learning) on the same images, for reference;
6. with ``--rerank``, the same images on the active checkpoint by the other ways of answering than the server's
   default (``rerank=templates``: a second look at doubtful answers), and each named: ``rerank=false`` (the agent's
   answer), ``rerank=true`` (the likeliest of the several-instances candidates by the calibration),
   ``rerank=templates`` and ``rerank=auto`` (the default before), the starting policy's with ``rerank=false``,
   ``templates`` and ``auto`` too, plus ``misses``: the test images the
   server's answer misses, with their IoU and template matching's.

``--split val`` localizes validation images (the training fonts) instead of test images: for choices.

    ./scripts/run &
    .venv/bin/python benchmarks/service_new_kinds.py --kinds 'Φ' '¥' --seeds 0 1 2 --out runs/service-kinds.json

One JSON line per target on stderr as it finishes; the whole result as JSON on stdout (and ``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _client import emit, to_png  # noqa: E402

from app.client import QlocClient  # noqa: E402
from models.bundle import load_bundle  # noqa: E402
from models.core.boxes import paired_iou  # noqa: E402
from models.core.metrics import corloc  # noqa: E402
from models.data.types import exemplar_crops  # noqa: E402
from models.experiments.baselines import template_matching  # noqa: E402
from models.experiments.datasets import GlyphKind  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def localized(qloc: QlocClient, set_id, pngs: list, checkpoint: str, per_request: int = 64, **options
              ) -> torch.Tensor:
    """The boxes the API answers for ``pngs``, ``per_request`` images a request (the server's default limit)."""
    boxes = []
    for i in range(0, len(pngs), per_request):
        boxes += [r.box for r in qloc.localize(set_id, pngs[i:i + per_request], checkpoint=checkpoint,
                                               **options).results]
    return torch.tensor(boxes, dtype=torch.float32)


def reranked(qloc: QlocClient, set_id, pngs: list, per_request: int = 64) -> dict[str, torch.Tensor]:
    """The active checkpoint's answers for ``pngs`` by each way of answering, named: ``rerank=false`` (the agent's
    answer), ``rerank=true`` (the likeliest candidate), ``rerank=templates`` (the default since 2026-11-29: ``auto``
    with template matching's window one more candidate) and ``rerank=auto``."""
    out: dict[str, list] = {"agent": [], "rerank": [], "templates": [], "auto": []}
    for i in range(0, len(pngs), per_request):
        chunk = pngs[i:i + per_request]
        out["agent"] += [r.box for r in qloc.localize(set_id, chunk, rerank=False).results]
        out["rerank"] += [r.box for r in qloc.localize(set_id, chunk, rerank=True).results]
        out["templates"] += [r.box for r in qloc.localize(set_id, chunk, rerank="templates").results]
        out["auto"] += [r.box for r in qloc.localize(set_id, chunk, rerank="auto").results]
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in out.items()}


def run_target(qloc: QlocClient, bundle, char: str, background: str, seed: int, n_test: int,  # noqa: PLR0913
               rerank: bool = False, split: str = "test") -> dict:
    kind = GlyphKind(char, background)
    ex = kind.draw(bundle, "exemplars", 5, seed)
    unl = kind.draw(bundle, "unlabeled", 64, seed, after=5)
    test = kind.draw(bundle, split, n_test, seed)
    crops = exemplar_crops(ex)
    pngs = [(f"test-{i}.png", to_png(t)) for i, t in enumerate(test.images)]
    t0 = time.perf_counter()
    s = qloc.create_exemplar_set([(f"crop-{i}.png", to_png(c)) for i, c in enumerate(crops)],
                                 name=f"kind {char} seed {seed}")
    base_checkpoint = s.active_checkpoint_id
    before = corloc(localized(qloc, s.id, pngs, "base"), test.boxes)
    before_agent = corloc(localized(qloc, s.id, pngs, "base", rerank=False), test.boxes) if rerank else None
    before_templates = corloc(localized(qloc, s.id, pngs, "base", rerank="templates"), test.boxes) if rerank else None
    before_auto = corloc(localized(qloc, s.id, pngs, "base", rerank="auto"), test.boxes) if rerank else None
    job = qloc.create_adaptation(s.id, [(f"unl-{i}.png", to_png(t)) for i, t in enumerate(unl.images)])
    job = qloc.wait(job, progress=False, poll=2.0)
    answered = localized(qloc, s.id, pngs, "active")
    after = corloc(answered, test.boxes)
    seconds = time.perf_counter() - t0
    templates = template_matching(test.images, crops)
    template = corloc(templates, test.boxes)
    extra = {}
    if rerank:
        by = reranked(qloc, s.id, pngs)
        iou, iou_t = paired_iou(answered, test.boxes), paired_iou(templates, test.boxes)
        extra = {"corloc_before_agent": round(before_agent, 1),  # type: ignore[arg-type]
                 "corloc_before_templates": round(before_templates, 1),  # type: ignore[arg-type]
                 "corloc_before_auto": round(before_auto, 1)} | {  # type: ignore[arg-type]
                 f"corloc_{k}": round(corloc(b, test.boxes), 1) for k, b in by.items()} | {
                 "misses": [{"image": i, "iou": round(float(iou[i]), 2), "iou_template": round(float(iou_t[i]), 2),
                             "true": [round(v) for v in test.boxes[i].tolist()],
                             "answer": [round(v) for v in answered[i].tolist()]}
                            for i in (iou < 0.5).nonzero().flatten().tolist()]}
    v = job.validation or {}
    activated = qloc.get_exemplar_set(s.id).active_checkpoint_id != base_checkpoint
    row = {"kind": char, "background": background, "seed": seed, "bundle": s.bundle, "status": job.status,
           "verdict": job.verdict, "activated": activated, "activated_iteration": v.get("activated_iteration"),
           "corloc_before": round(before, 1), "corloc_after": round(after, 1), "change": round(after - before, 1),
           "corloc_template": round(template, 1), "reward": v.get("reward"),
           "reward_choice": (v.get("reward_choice") or {}).get("chosen"), "seconds": round(seconds, 1), **extra}
    qloc.delete_exemplar_set(s.id)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key")
    p.add_argument("--kinds", nargs="+", required=True, help="glyph characters")
    p.add_argument("--background", default="patch")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--n-test", type=int, default=200)
    p.add_argument("--rerank", action="store_true", help="also rerank=false and rerank=true (step 6)")
    p.add_argument("--split", choices=("test", "val"), default="test",
                   help="the images localized: test (held-out fonts) or val (training fonts, for choices)")
    p.add_argument("--out")
    a = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    with QlocClient(a.url, api_key=a.api_key) as qloc:
        bundle = load_bundle(ROOT / "bundles" / f"{qloc.bundles()['default']}.pt", "cpu")  # the images' size and fill
        for seed in a.seeds:
            for char in a.kinds:
                row = run_target(qloc, bundle, char, a.background, seed, a.n_test, a.rerank, a.split)
                rows.append(row)
                print(json.dumps(row, ensure_ascii=False), file=sys.stderr, flush=True)

    def mean(key: str) -> float:
        return round(statistics.fmean(r[key] for r in rows), 1)

    summary = {"targets": len(rows), "corloc_before": mean("corloc_before"), "corloc_after": mean("corloc_after"),
               "corloc_template": mean("corloc_template"), "worst_change": min(r["change"] for r in rows),
               "activated": sum(bool(r["activated"]) for r in rows),
               "per_seed_after": {s: round(statistics.fmean(r["corloc_after"] for r in rows if r["seed"] == s), 1)
                                  for s in a.seeds},
               "per_seed_template": {s: round(statistics.fmean(r["corloc_template"] for r in rows
                                                               if r["seed"] == s), 1) for s in a.seeds}}
    if a.rerank:
        summary |= {k: mean(k) for k in ("corloc_before_agent", "corloc_agent", "corloc_rerank")}
    emit({"split": a.split, "kinds": a.kinds, "background": a.background, "seeds": a.seeds, "summary": summary,
          "rows": rows}, a.out)


if __name__ == "__main__":
    main()
