"""Guarded adaptation, target by target: what a user gets with the service's default job (``activate=auto``)
against the starting policy, policy-only adaptation (the final checkpoint, what ``activate=true`` gives),
template matching and the ranking baseline, with the probes' own scores beside the test CorLoc.

Each target: 5 exemplar crops (``--exemplars``) and 64 unlabeled images (disjoint draws of the train split,
the service's default job size), 200 test images (the test split). The job runs as the worker runs it:
256 synthetic probes (``QLOC_SYNTHETIC_PROBES``, ``models.guard.synthetic_probes``), the service's defaults
(200 iterations, lr 1e-3, batch 32, a checkpoint every 25), every checkpoint scored, early stop,
``decide("auto")``. One JSON object on stdout. Checkpoints adapted on a kept repair are scored as localize
serves them, refined (``models.refine``); ``corloc_after_policy_unrefined`` is the last one without it.
``--labeled``: the exemplar images (whole, with their boxes) are also the set's labeled examples, as when a
client makes the set from whole images with ``boxes`` (the first probes; on RGB bundles they must confirm a
checkpoint beyond their noise before it is activated; each row also reports the rule before, ``agree``).
``--choice`` runs each job a second time with the reward chosen on the probes (``models.repair``), on the
same reward repair (a job whose choice is the embedding is the same job, not run twice).

    python benchmarks/guarded_adaptation.py --suite digits --seeds 0 1 2 > runs/guard-digits.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import torch

from app.config import Settings
from models.adapt import AdaptConfig, adapt
from models.bundle import load_bundle
from models.core.metrics import corloc, spearman
from models.data.cmnist import BACKGROUNDS
from models.data.types import exemplar_crops
from models.evaluate import evaluate_corloc, ranking
from models.experiments.baselines import template_matching
from models.experiments.datasets import CMnistKind, GlyphKind, PhotoKind
from models.experiments.report import summarize
from models.features import prototype_of
from models.repair import CANDIDATES, RepairConfig, guarded_setup

SUITES = {
    "digits": ("mnist-digit4", [CMnistKind(d, "patch") for d in (0, 1, 2, 3, 5, 6, 7, 8, 9)]),
    "backgrounds": ("mnist-digit4", [CMnistKind(2, bg) for bg in ("patch", "clutter", "impulse", "gaussian")]),
    "glyphs": ("mnist-digit4", [GlyphKind(c, "patch") for c in ("A", "K", "R", "e", "#", "&", "@", "?")]),
    # Characters no choice of this project ever looked at (bundle, guard rule, probe count, repair): a check that
    # the glyph results hold on kinds of objects outside the ones they were chosen on.
    "unseen-glyphs": ("mnist-general", [GlyphKind(c, "patch") for c in ("Ω", "λ", "§", "€", "ß", "π", "£", "ψ")]),
}


def photo_suite(classes: list[str]) -> tuple[str, list]:
    from models.data.photos import load_manifest

    manifest = load_manifest()
    return "photo-mammals", [PhotoKind(c, manifest) for c in classes]


def run_job(bundle, proto, setup, unl, test, settings: Settings, seed: int, every_checkpoint: bool = True) -> dict:
    """Adapt as the worker does on ``setup`` (its reward, its guard) -> decision, test CorLoc per checkpoint (with
    ``every_checkpoint=False``: of the last one and those a decision activates)."""
    guard = setup.guard
    bundle, proto = setup.bundle, setup.prototype
    states = {}

    def on_checkpoint(state: dict) -> None:
        states[state["iteration"]] = state["agent"]
        guard.observe(state["iteration"], state["agent"])

    cfg = AdaptConfig(iterations=settings.default_iterations, lr=settings.default_learning_rate, seed=seed,
                      batch_size=min(settings.adapt_batch_size, len(unl)), checkpoint_every=settings.checkpoint_every)
    t1 = time.perf_counter()
    adapt(bundle, proto, unl.images, cfg, device=bundle.device, on_checkpoint=on_checkpoint,
          should_stop=lambda: guard.should_stop, scorer=setup.scorer)
    adapt_s = time.perf_counter() - t1
    d = guard.decide("auto")
    d_best = guard.decide("auto", pick="best")  # the rule before pick="confirmed", on the same records
    d_agree = guard.decide("auto", labeled_rule="agree")  # the labeled rule before "beyond_noise" (RGB bundles)
    last = max(states)
    scored = states if every_checkpoint else {last, *(x["activate"] for x in (d, d_best, d_agree))} - {None}
    per_ckpt = {it: evaluate_corloc(bundle, bundle.new_agent(s), test, proto)[0] for it, s in states.items()
                if it in scored}
    unrefined = (evaluate_corloc(replace(bundle, refine=False), bundle.new_agent(states[last]), test, proto)[0]
                 if bundle.refine else per_ckpt[last])  # what the last checkpoint gives without models.refine
    return {"decision": d, "decision_pick_best": d_best, "decision_labeled_agree": d_agree, "per_ckpt": per_ckpt,
            "last": last, "last_unrefined": unrefined, "refined": bundle.refine, "adapt_seconds": round(adapt_s, 2)}


def run_target(bundle, kind, seed: int, settings: Settings, n_test: int, n_ranking: int, template: bool = True,
               repair: RepairConfig | None = None, choice: bool = False, labeled: bool = False,
               split: str = "test", exemplars: int = 5, every_checkpoint: bool = True) -> dict:
    t0 = time.perf_counter()
    ex = kind.draw(bundle, "exemplars", exemplars, seed)
    unl = kind.draw(bundle, "unlabeled", 64, seed, after=exemplars)
    test = kind.draw(bundle, split, n_test, seed)  # "val": a held-out part of the train split, never test
    proto = prototype_of(bundle, ex)
    setup = guarded_setup(bundle, proto, exemplar_crops(ex), unl.images, None, synthetic=settings.synthetic_probes,
                          generator_seed=seed, repair=repair, labeled=ex if labeled else None)
    guard, rep = setup.guard, setup.repair
    job = run_job(bundle, proto, setup, unl, test, settings, seed, every_checkpoint)
    d, per_ckpt, last = job["decision"], job["per_ckpt"], job["last"]
    job_s = time.perf_counter() - t0
    before = evaluate_corloc(bundle, bundle.new_agent(None), test, proto)[0]
    crops = exemplar_crops(ex)
    k = min(n_ranking, len(test))
    t2 = time.perf_counter()
    tm = corloc(template_matching(test.images, crops), test.boxes) if template else None
    tm_s = time.perf_counter() - t2
    row = {"target": kind.describe(), "seed": seed, **kind.meta(),
           "corloc_before": before, "corloc_after_policy": per_ckpt[last],
           "corloc_after_policy_unrefined": job["last_unrefined"], "refined": job["refined"],
           "corloc_after_guard": per_ckpt[d["activate"]] if d["activate"] is not None else before,
           "corloc_after_guard_pick_best": (per_ckpt[job["decision_pick_best"]["activate"]]
                                            if job["decision_pick_best"]["activate"] is not None else before),
           "corloc_after_guard_labeled_agree": (per_ckpt[job["decision_labeled_agree"]["activate"]]
                                                if job["decision_labeled_agree"]["activate"] is not None else before),
           "corloc_template": tm,
           "corloc_ranking": corloc(ranking(bundle, test.subset(torch.arange(k)), proto), test.boxes[:k]),
           "corloc_probe_before": guard.base["select"]["corloc"],
           "corloc_probe_best": (d["validation"]["best"] or guard.base)["select"]["corloc"],
           "verdict": d["verdict"], "activated": d["activate"], "stopped_early": d["validation"]["stopped_early"],
           "activated_pick_best": job["decision_pick_best"]["activate"],
           "activated_labeled_agree": job["decision_labeled_agree"]["activate"],
           "last_iteration": last, "faithfulness_spearman": guard.faithfulness["spearman"],
           "probe_labeled_before": guard.base.get("labeled"),  # the set's labeled examples (--labeled), if any
           "checkpoints": [{"iteration": c["iteration"], "probe_select": c["select"]["corloc"],
                            "probe_held": c["held"]["corloc"], "test": per_ckpt.get(c["iteration"]),
                            **{k: c[k] for k in ("gain", "noise", "held_gain", "held_noise", "labeled",
                                                 "labeled_gain", "labeled_noise") if k in c}}
                           for c in guard.checkpoints],
           "reward": setup.reward, "repair": rep.record if rep is not None else None,
           "adapt_seconds": job["adapt_seconds"], "job_seconds": round(job_s, 2), "template_seconds": round(tm_s, 2)}
    if choice:  # the same job with the reward chosen on the probes (models.repair), on the same repair
        t3 = time.perf_counter()
        ch = guarded_setup(bundle, proto, crops, unl.images, None, synthetic=settings.synthetic_probes,
                           generator_seed=seed, repair=repair, choice=True, repaired=rep,
                           labeled=ex if labeled else None)
        if ch.choice.chosen == "embedding":  # the same reward, probes and guard: the same job
            cj, cd = job, d
        else:
            cj = run_job(bundle, proto, ch, unl, test, settings, seed, every_checkpoint)
            cd = cj["decision"]
        row.update({"reward_chosen": ch.choice.chosen, "reward_choice": ch.choice.record,
                    "corloc_after_policy_choice": cj["per_ckpt"][cj["last"]],
                    "corloc_after_guard_choice": (cj["per_ckpt"][cd["activate"]] if cd["activate"] is not None
                                                  else before),
                    "verdict_choice": cd["verdict"], "activated_choice": cd["activate"],
                    "choice_extra_seconds": round(time.perf_counter() - t3, 2)})
    if tm is None:  # not run: left out, so the summary's means stay numbers
        del row["corloc_template"]
    print(json.dumps({k: v for k, v in row.items() if k != "checkpoints"}), file=sys.stderr, flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--suite", choices=(*SUITES, "photos"), required=True)
    p.add_argument("--classes", nargs="+", default=["birds", "fish", "fruit", "vegetables", "flowers"],
                   help="photo classes (--suite photos)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--n-test", type=int, default=200)
    p.add_argument("--ranking-images", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repair", action="store_true", help="reward repair before the policy (models.repair)")
    p.add_argument("--repair-epochs", type=int, default=RepairConfig.epochs)
    p.add_argument("--choice", action="store_true",
                   help="also run each job with the reward chosen on the probes (models.repair), on the same repair")
    p.add_argument("--device", default="cpu")
    p.add_argument("--kinds", nargs="+", help="only these targets of the suite (their describe() contains one)")
    p.add_argument("--background", choices=BACKGROUNDS,
                   help="the glyph suites on this background instead of the patches (e.g. clutter)")
    p.add_argument("--no-template", action="store_true",
                   help="skip template matching (full-resolution NCC of 224-px photos takes minutes per image set)")
    p.add_argument("--bundle", help="a bundle file instead of the suite's shipped one (e.g. bundles/mnist-general.pt)")
    p.add_argument("--split", choices=("test", "val"), default="test",
                   help="evaluate on the test split, or on val (model selection: never the test images)")
    p.add_argument("--labeled", action="store_true",
                   help="the exemplar images with their boxes are also the set's labeled examples (see above)")
    p.add_argument("--decided-only", action="store_true",
                   help="score on the test images only the last checkpoint and those a decision activates (the "
                        "others' test CorLoc is null): the same decisions, about a fifth less time per photo job")
    p.add_argument("--exemplars", type=int, default=5,
                   help="exemplar images (crops; with --labeled also the labeled examples): a set created from that "
                        "many boxed images")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    name, kinds = photo_suite(a.classes) if a.suite == "photos" else SUITES[a.suite]
    if a.background:
        if not all(isinstance(k, GlyphKind) for k in kinds):
            p.error("--background applies to the glyph suites")
        kinds = [replace(k, background=a.background) for k in kinds]
    if a.kinds:
        kinds = [k for k in kinds if any(s in k.describe() for s in a.kinds)]
    if a.bundle:
        name = a.bundle
    bundle = load_bundle(a.bundle or f"bundles/{name}.pt", a.device)
    repair = RepairConfig(epochs=a.repair_epochs) if a.repair else None
    settings = Settings()
    t0 = time.perf_counter()
    rows = [run_target(bundle, kind, seed, settings, a.n_test, a.ranking_images, not a.no_template, repair, a.choice,
                       a.labeled, a.split, a.exemplars, not a.decided_only)
            for seed in a.seeds for kind in kinds]
    gains = torch.tensor([[r["corloc_probe_best"] - r["corloc_probe_before"],
                           r["corloc_after_guard"] - r["corloc_before"]] for r in rows], dtype=torch.float64)
    scored = [c for r in rows for c in r["checkpoints"] if c["test"] is not None]
    ckpt_probe = torch.tensor([c["probe_select"] for c in scored], dtype=torch.float64)
    ckpt_test = torch.tensor([c["test"] for c in scored], dtype=torch.float64)
    worst = min(r["corloc_after_guard"] - r["corloc_before"] for r in rows)
    worst_pick_best = min(r["corloc_after_guard_pick_best"] - r["corloc_before"] for r in rows)
    worst_agree = min(r["corloc_after_guard_labeled_agree"] - r["corloc_before"] for r in rows)
    if a.choice:
        worst_choice = min(r["corloc_after_guard_choice"] - r["corloc_before"] for r in rows)
    out = {"suite": a.suite, "bundle": name, "seeds": a.seeds, "command": " ".join(["python", *sys.argv]),
           "wall_seconds": round(time.perf_counter() - t0, 1), "rows": rows,
           "summary": summarize(rows, "target"),
           "worst_guarded_change": round(worst, 2),
           "worst_guarded_change_pick_best": round(worst_pick_best, 2),
           "worst_guarded_change_labeled_agree": round(worst_agree, 2),
           "probe_vs_test": {
               "spearman_checkpoints": round(float(spearman(ckpt_probe[None], ckpt_test[None])[0]), 3),
               "spearman_gains": round(float(spearman(gains[None, :, 0], gains[None, :, 1])[0]), 3)
               if len(rows) > 2 else None}}
    if a.choice:
        out["worst_guarded_change_choice"] = round(worst_choice, 2)
        out["rewards_chosen"] = {n: sum(r["reward_chosen"] == n for r in rows) for n in CANDIDATES}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
