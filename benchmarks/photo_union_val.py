"""Serving the starting policy beside an adapted one on photos (issue 11, validation only): each image answered by
whichever of the two policies' answers the job's (repaired) reward puts nearer the exemplars.

On photo held-out classes a job's last checkpoint on the repaired reward gains about 6 points on average, but some
jobs end below their start, and neither the synthetic probes nor 5 labeled examples tell those apart, so the guard
activates none (BENCHMARKS.md, reward repair). If the repaired reward orders boxes well on the client's images
(held-out probe OrdAcc ~97), picking per image between the two policies' answers by that reward could keep most
of the gain and lose little where the adapted policy is worse. This measures it, per job, on the *val* split:

- ``before``: the starting policy with the bundle's head (what a set answers before any job);
- ``after``: the job's last checkpoint on the repaired head and prototype (``activate=true``);
- ``guard``: what ``activate=auto`` serves (labeled examples: the 5 exemplar images with their boxes; since
  ``QLOC_PAIR_START`` the guard scores the checkpoints paired with the start, and the one it activates is served so);
- ``guard_agree_rule``: what ``activate=auto`` would serve with ``QLOC_LABELED_RULE=agree`` (the labeled examples
  at least as many right as at the start, the rule before 2026-11-27), the checkpoints scored and served paired;
- ``pick_start_rep``: per image, ``before``'s box or ``after``'s, the one nearer the repaired prototype under the
  repaired head; ``served_pick``: the same through ``models.inference.Localizer`` with the start as its
  ``Companion`` (``served_pick_differs``: images where the two differ, float near-ties);
- ``pick_both_rep``: the same between the starting policy's and the adapted policy's episodes both run under the
  repaired head (their nearest visited boxes);
- ``pick_start_base``: ``before``'s or ``after``'s box, by the bundle's own head and prototype;
- ``pick_agree``: ``after``'s box only where both heads prefer it; ``served_pick_agree``: the job's last checkpoint as
  localize serves it (a ``Reward`` carrying its ``Start``, through ``Localizer.with_reward``): with
  ``QLOC_PAIR_RULE=agree`` (the default) the same rule (format 4), with ``consensus`` (format 5) the consensus of the
  start, the job's earlier checkpoints and the last; ``pick_vote``: where two of three judges do (the repaired head,
  the bundle's head, the backbone features below); ``pick_unanimous``: where all three do;
- ``pick_feat``: ``before``'s or ``after``'s box, the one whose RoI-pooled frozen backbone features have the higher
  cosine with the exemplars' mean (``models.repair.FeatureScorer``): a judge neither policy was trained on;
  ``served_pick_feat``: the same through ``Localizer`` with a ``Companion`` carrying that ``judge``;
- ``oracle``: an image counts if either answer is right (what a perfect per-image pick would reach).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/photo_union_val.py --seeds 0 1 --classes birds fish fruit
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from app.config import Settings
from models.adapt import AdaptConfig, adapt
from models.bundle import Reward, Start, load_bundle
from models.companion import Companion
from models.core.boxes import paired_iou as iou_of
from models.core.metrics import corloc
from models.data.photos import load_manifest
from models.data.probes import PROBE_STYLES
from models.data.types import LabeledImages, exemplar_crops
from models.experiments.datasets import PhotoKind
from models.features import features_of, prototype_of
from models.inference import Localizer
from models.repair import FeatureScorer, Guarded, RepairConfig, guarded_setup


def pick(a: torch.Tensor, b: torch.Tensor, da: torch.Tensor, db: torch.Tensor) -> torch.Tensor:
    return torch.where((db < da)[:, None], b, a)


def photo_job(bundle, kind: PhotoKind, seed: int, settings: Settings, pair_rule: str | None,
              probe_style: str = "rect") -> tuple[LabeledImages, LabeledImages, torch.Tensor, Guarded, dict[int, dict]]:
    """An adaptation job on ``kind``'s 64 unlabeled images as the worker runs it (5 exemplars with their boxes as the
    labeled examples; its checkpoints paired with the start by ``pair_rule``, ``None``: alone) -> (exemplars,
    unlabeled images, prototype, the job's setup, each checkpoint's agent state)."""
    ex = kind.draw(bundle, "exemplars", 5, seed)
    unl = kind.draw(bundle, "unlabeled", 64, seed, after=5)
    proto = prototype_of(bundle, ex)
    pair = None if pair_rule is None else Start(proto, consensus=() if pair_rule == "consensus" else None)
    setup = guarded_setup(bundle, proto, exemplar_crops(ex), unl.images, None, synthetic=settings.synthetic_probes,
                          generator_seed=seed, repair=RepairConfig(epochs=settings.repair_epochs), labeled=ex,
                          start=pair, probe_style=probe_style)
    states: dict[int, dict] = {}

    def on_checkpoint(state: dict) -> None:
        states[state["iteration"]] = state["agent"]
        setup.guard.observe(state["iteration"], state["agent"])

    cfg = AdaptConfig(iterations=settings.default_iterations, lr=settings.default_learning_rate, seed=seed,
                      batch_size=min(settings.adapt_batch_size, len(unl)), checkpoint_every=settings.checkpoint_every)
    adapt(setup.bundle, setup.prototype, unl.images, cfg, device=bundle.device, on_checkpoint=on_checkpoint,
          should_stop=lambda: setup.guard.should_stop, scorer=setup.scorer)
    return ex, unl, proto, setup, states


def run(bundle, kind: PhotoKind, seed: int, settings: Settings, n_val: int, split: str = "val",
        probe_style: str = "rect") -> dict:
    t0 = time.perf_counter()
    # as the worker pairs an RGB bundle's job (QLOC_PAIR_RULE: the two heads' agreement, or by consensus)
    ex, unl, proto, setup, states = photo_job(bundle, kind, seed, settings,
                                              settings.pair_rule if settings.pair_start != "never" else None,
                                              probe_style)
    # "test" only once the rule is chosen on val; "adapt": the job's own unlabeled images (what a user who localizes
    # the images the job adapted on gets; the train split's objects, more of them than val's or test's 2-7)
    val = unl if split == "adapt" else kind.draw(bundle, split, n_val, seed)
    decision = setup.guard.decide("auto")
    last = max(states)
    base_loc, rep_loc = Localizer(bundle, "cpu"), Localizer(setup.bundle, "cpu")
    feats = features_of(bundle, val.images)
    start = base_loc.run_features(feats, proto, base_loc.agent(None)).boxes[-1]
    after = rep_loc.run_features(feats, setup.prototype, rep_loc.agent(states[last])).boxes[-1]
    start_rep = rep_loc.run_features(feats, setup.prototype, rep_loc.agent(None)).boxes[-1]

    def served_by(d: dict) -> torch.Tensor:
        if d["activate"] is None:
            return start
        loc = setup.guard.served(d["activate"])
        return loc.run_features(feats, setup.prototype, loc.agent(states[d["activate"]])).boxes[-1]

    guard = served_by(decision)
    # what activate=auto would serve if pasted probes confirmed on their own (as for grayscale bundles)
    synthetic_rule = setup.guard.decide("auto", synthetic_confirms=True)
    guard_synthetic = served_by(synthetic_rule)
    # each checkpoint as served, on these images, beside its probe gains (how well probes predict)
    per_checkpoint = [{"iteration": c["iteration"], "gain": c["gain"], "held_gain": c["held_gain"],
                       "labeled_gain": c.get("labeled_gain"),
                       "corloc": corloc(served_by({"activate": c["iteration"]}), val.boxes)}
                      for c in setup.guard.checkpoints]
    # the rule before the eighth session (labeled examples: at least as many right as at the start), on paired scores
    agree_rule = setup.guard.decide("auto", labeled_rule="agree")
    guard_agree = served_by(agree_rule)
    # the same pick as a Localizer serves it (models.companion.Companion): the start as it was served
    served = Localizer(setup.bundle, "cpu", companion=Companion(base_loc, base_loc.agent(None), proto))
    picked = served.run_features(feats, setup.prototype, served.agent(states[last])).boxes[-1]
    with torch.no_grad():
        d_rep = {k: rep_loc.box_distances(feats, b, setup.prototype) for k, b in
                 (("start", start), ("after", after), ("start_rep", start_rep))}
        d_base = {k: base_loc.box_distances(feats, b, proto) for k, b in (("start", start), ("after", after))}
        fs = FeatureScorer.from_crops(bundle, exemplar_crops(ex))
        d_feat = {k: fs.box_distances(bundle.embedder, feats, b[:, None], None)[:, 0]
                  for k, b in (("start", start), ("after", after))}
    votes = ((d_rep["after"] < d_rep["start"]).int() + (d_base["after"] < d_base["start"]).int()
             + (d_feat["after"] < d_feat["start"]).int())
    hit_s, hit_a = (iou_of(start, val.boxes) >= 0.5), (iou_of(after, val.boxes) >= 0.5)
    # the feature judge's pick as a Localizer serves it (a Companion with a judge)
    judged = Localizer(setup.bundle, "cpu", companion=Companion(base_loc, base_loc.agent(None), proto, fs.reference))
    picked_feat = judged.run_features(feats, setup.prototype, judged.agent(states[last])).boxes[-1]
    chosen = pick(start, after, d_rep["start"], d_rep["after"])  # the rule
    # the two heads' agreement as served (QLOC_PAIR_START): the last checkpoint's reward carrying the job's start
    voters = None if settings.pair_rule != "consensus" else tuple(states[i] for i in sorted(states) if i < last)
    paired = base_loc.with_reward(Reward(setup.repair.head, setup.prototype, setup.bundle.refine,
                                         Start(proto, consensus=voters))
                                  ) if setup.repair is not None and setup.repair.kept else rep_loc
    served_agree = paired.run_features(feats, setup.prototype, paired.agent(states[last])).boxes[-1]
    row = {"target": kind.describe(), "seed": seed, "repair_kept": setup.reward,
           "before": corloc(start, val.boxes), "after": corloc(after, val.boxes), "guard": corloc(guard, val.boxes),
           "guard_agree_rule": corloc(guard_agree, val.boxes), "activated_agree_rule": agree_rule["activate"],
           "guard_synthetic": corloc(guard_synthetic, val.boxes), "activated_synthetic": synthetic_rule["activate"],
           "probe_style": probe_style, "checkpoints": per_checkpoint,
           "pick_start_rep": corloc(chosen, val.boxes),
           "pick_both_rep": corloc(pick(start_rep, after, d_rep["start_rep"], d_rep["after"]), val.boxes),
           "served_pick": corloc(picked, val.boxes),  # differs from pick_start_rep only on float near-ties
           "served_pick_differs": int((picked != chosen).any(-1).sum()),
           "start_rep": corloc(start_rep, val.boxes),
           "pick_start_base": corloc(pick(start, after, d_base["start"], d_base["after"]), val.boxes),
           "pick_agree": corloc(torch.where(((d_rep["after"] < d_rep["start"]) & (d_base["after"] < d_base["start"]))
                                            [:, None], after, start), val.boxes),
           "served_pick_agree": corloc(served_agree, val.boxes),
           "pick_vote": corloc(torch.where((votes >= 2)[:, None], after, start), val.boxes),
           "pick_unanimous": corloc(torch.where((votes == 3)[:, None], after, start), val.boxes),
           "pick_feat": corloc(pick(start, after, d_feat["start"], d_feat["after"]), val.boxes),
           "served_pick_feat": corloc(picked_feat, val.boxes),
           "oracle": round(float((hit_s | hit_a).float().mean() * 100), 2),
           "activated": decision["activate"], "verdict": decision["verdict"], "last": last,
           # per image, for rules tried later on the same jobs without running them again (val only)
           "per_image": {"start_hit": hit_s.tolist(), "after_hit": hit_a.tolist(),
                         **{f"{j}_{k}": [round(v, 6) for v in d[k].tolist()]
                            for j, d in (("rep", d_rep), ("base", d_base), ("feat", d_feat))
                            for k in ("start", "after")}},
           "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps({k: v for k, v in row.items() if k != "per_image"}), file=sys.stderr, flush=True)
    return row


def job_parser(description: str | None, splits: tuple[str, ...] = ("val", "test")) -> argparse.ArgumentParser:
    """The options of a benchmark of photo jobs (``photo_job``): classes, seeds, images per job, the split."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--classes", nargs="+", default=["birds", "fish", "fruit", "vegetables", "flowers"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--n-val", type=int, default=48, help="images evaluated per job")
    p.add_argument("--split", choices=splits, default="val",
                   help="val (where the rule is chosen); test: once, for the rule chosen on val; adapt: the job's "
                        "own 64 unlabeled images (their objects are the train split's, the exemplars' among them)")
    return p


def main() -> None:
    p = job_parser(__doc__, ("val", "test", "adapt"))
    p.add_argument("--probe-style", choices=PROBE_STYLES, default="rect",
                   help="how probes are made (models.data.probes.PROBE_STYLES)")
    a = p.parse_args()
    torch.set_num_threads(1)
    bundle = load_bundle("bundles/photo-mammals.pt", "cpu")
    manifest = load_manifest()
    rows = [run(bundle, PhotoKind(c, manifest), seed, Settings(), a.n_val, a.split, a.probe_style)
            for seed in a.seeds for c in a.classes]
    keys = ("before", "after", "guard", "guard_agree_rule", "guard_synthetic", "pick_start_rep", "served_pick",
            "pick_both_rep", "start_rep",
            "pick_start_base", "pick_agree", "served_pick_agree", "pick_vote", "pick_unanimous", "pick_feat",
            "served_pick_feat", "oracle")
    summary = {k: {"mean": round(sum(r[k] for r in rows) / len(rows), 2),
                   "mean_gain": round(sum(r[k] - r["before"] for r in rows) / len(rows), 2),
                   "worst_gain": round(min(r[k] - r["before"] for r in rows), 2)} for k in keys}
    print(json.dumps({"command": " ".join(["python", *sys.argv]), "rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
