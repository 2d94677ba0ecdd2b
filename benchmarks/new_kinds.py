"""New kinds of objects (issue 11): the shipped cMNIST bundle on glyphs (letters and symbols, not digits).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/new_kinds.py --out runs/new_kinds.json

For each seed and glyph class on the patch background (``--classes``), and a smaller set of classes on the
other three backgrounds (``--other-classes`` x ``--other-backgrounds``, seeds ``--other-seeds``): 5 exemplar
crops and 64 unlabeled images from one train-font draw (disjoint slices), ``--n-test`` test images from the
held-out test fonts (``models.experiments.datasets.GlyphKind``). Per row, CorLoc and wall time of

- ``before``: the base policy, greedy;
- ``before_best16``: the best-of-16 search (greedy + 15 sampled episodes, the nearest final box kept);
- ``after``: greedy, after policy-only adaptation (``models.adapt.adapt``) with the service's defaults
  (``app.config.Settings``: iterations, learning rate, batch size, checkpoint interval);
- ``ranking``: the ranking baseline (``models.evaluate.ranking``, 949 squares per image; on the first
  ``--ranking-images`` test images only: it costs 0.15 s an image on one thread);
- ``template``: template matching (``models.experiments.baselines.template_matching``, 5 exemplars x 5 scales).

Prints and writes JSON: the machine, the settings, every row, and per class (patch) / per class and
background (others) the mean and std over seeds (``models.experiments.report.summarize``), CorLoc and
seconds alike; also OrdAcc (prototype anchor) on the test images: how well the frozen embedding -- the
adaptation's reward -- orders boxes of the new kind.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

from app.config import Settings
from models.adapt import AdaptConfig, adapt
from models.bundle import load_bundle
from models.core.metrics import corloc
from models.data.cmnist import BACKGROUNDS
from models.data.glyphs import split_fonts
from models.data.types import exemplar_crops
from models.evaluate import evaluate_corloc, ordacc_all, ranking
from models.experiments.baselines import TEMPLATE_SCALES, template_matching
from models.experiments.datasets import GlyphKind
from models.experiments.provenance import cpu_model  # noqa: E402
from models.experiments.report import mean_std, summarize
from models.features import prototype_of

METHODS = ("before", "before_best16", "after", "ranking", "template")


def service_adapt_config(n_images: int, seed: int) -> AdaptConfig:
    """The ``AdaptConfig`` the worker builds for a job with the service's defaults (``worker/jobs.py``)."""
    f = Settings.model_fields
    return AdaptConfig(iterations=f["default_iterations"].default, lr=f["default_learning_rate"].default,
                       seed=seed, checkpoint_every=f["checkpoint_every"].default,
                       batch_size=min(f["adapt_batch_size"].default, n_images))


def timed(fn):  # noqa: ANN001, ANN201
    t0 = time.perf_counter()
    out = fn()
    return out, round(time.perf_counter() - t0, 2)


def run_row(bundle, char: str, background: str, seed: int, n_test: int, a: argparse.Namespace) -> dict:  # noqa: ANN001
    kind = GlyphKind(char, background)
    ex = kind.draw(bundle, "exemplars", a.exemplars, seed)
    unl = kind.draw(bundle, "unlabeled", a.unlabeled, seed, after=a.exemplars)
    test = kind.draw(bundle, "test", n_test, seed)
    proto = prototype_of(bundle, ex)
    base = bundle.new_agent()
    row: dict = {"seed": seed, "glyph": char, "background": background, "target": f"{char} {background}",
                 "n_test": n_test}
    row["ordacc_proto"] = ordacc_all(bundle, test, ("proto",), seed=seed)["proto"]  # the reward's quality here
    (row["corloc_before"], _), row["seconds_before"] = timed(lambda: evaluate_corloc(bundle, base, test, proto))
    (row["corloc_before_best16"], _), row["seconds_before_best16"] = timed(
        lambda: evaluate_corloc(bundle, base, test, proto, seed=seed, samples=15))
    k = min(a.ranking_images, n_test)
    boxes, row["seconds_ranking"] = timed(lambda: ranking(bundle, test.subset(torch.arange(k)), proto))
    row["corloc_ranking"] = corloc(boxes, test.boxes[:k])
    boxes, row["seconds_template"] = timed(lambda: template_matching(test.images, exemplar_crops(ex), TEMPLATE_SCALES))
    row["corloc_template"] = corloc(boxes, test.boxes)
    cfg = service_adapt_config(len(unl), seed)
    res, row["seconds_adapt"] = timed(lambda: adapt(bundle, proto, unl.images, cfg, device="cpu"))
    adapted = bundle.new_agent(res.agent_state)
    (row["corloc_after"], _), row["seconds_after"] = timed(lambda: evaluate_corloc(bundle, adapted, test, proto))
    row["adapt_mean_reward"] = round(res.mean_reward, 3)
    return row


def seconds_summary(rows: list[dict], group: str) -> dict:
    """Per group: the mean and std over rows of each ``seconds_*`` key."""
    keys = [k for k in rows[0] if k.startswith("seconds_")]
    return {str(g): {k: mean_std([r[k] for r in rows if r[group] == g], 2) for k in keys}
            for g in dict.fromkeys(r[group] for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", default="bundles/mnist-digit4.pt")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--classes", nargs="*", default=["A", "K", "W", "e", "#", "@"], help="on the patch background")
    p.add_argument("--other-classes", nargs="*", default=["K"], help="on the other backgrounds")
    p.add_argument("--other-backgrounds", nargs="*", default=[b for b in BACKGROUNDS if b != "patch"])
    p.add_argument("--other-seeds", type=int, nargs="*", default=[0, 1])
    p.add_argument("--exemplars", type=int, default=5)
    p.add_argument("--unlabeled", type=int, default=64)
    p.add_argument("--n-test", type=int, default=200)
    p.add_argument("--other-n-test", type=int, default=100, help="test images per row on the other backgrounds")
    p.add_argument("--ranking-images", type=int, default=50,
                   help="the first this many test images are scored by the ranking baseline (0.15 s each, one thread)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/new_kinds.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    bundle = load_bundle(a.bundle, "cpu")
    t0 = time.perf_counter()
    jobs = [(c, "patch", s, a.n_test) for s in a.seeds for c in a.classes]
    jobs += [(c, bg, s, a.other_n_test) for bg in a.other_backgrounds for s in a.other_seeds for c in a.other_classes]
    rows = []
    for c, bg, s, n_test in jobs:
        rows.append(run_row(bundle, c, bg, s, n_test, a))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    patch = [r for r in rows if r["background"] == "patch"]
    other = [r for r in rows if r["background"] != "patch"]
    result = {
        "command": " ".join(sys.argv),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": platform.python_version()},
        "bundle": a.bundle, "adapt": vars(service_adapt_config(a.unlabeled, 0)) | {"seed": "row's seed"},
        "sizes": {"exemplars": a.exemplars, "unlabeled": a.unlabeled, "test_patch": a.n_test,
                  "test_other": a.other_n_test, "ranking_images": a.ranking_images},
        "template_scales": TEMPLATE_SCALES,
        "test_fonts": [Path(f).name if f else "PIL default" for f in split_fonts("test")],
        "rows": rows,
        "summary_patch": summarize(patch, "glyph") if patch else {},
        "summary_other": summarize(other, "target") if other else {},
        "seconds_patch": seconds_summary(patch, "glyph") if patch else {},
        "seconds_other": seconds_summary(other, "target") if other else {},
        "total_seconds": round(time.perf_counter() - t0, 1),
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("summary_patch", "summary_other", "total_seconds")}, indent=2))


if __name__ == "__main__":
    main()
