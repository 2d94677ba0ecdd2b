"""Weight-space interpolation between a photo job's start and its adapted policy (issue 11, validation first).

WiSE-FT (Wortsman et al., CVPR 2022) serves ``(1 - a) * start + a * adapted``: on distribution shift the
interpolated weights often beat both ends, and they stay nearer the start where fine-tuning drifted. Here, per
photo job (the same jobs as ``photo_union_val.py``: ``photo-mammals``, a held-out class, 64 unlabeled images, the
service's defaults, the guard observing and stopping early):

- ``before``: the starting policy (the bundle's head and prototype, nearest answer);
- ``after``: the last checkpoint alone (repaired head and prototype, as ``activate=true`` served it before pairing);
- ``paired``: the last checkpoint paired with its start (what ``activate=true`` serves today on photos);
- ``wise_a``: the agent ``lerp(start, last, a)`` on the repaired head; ``wise_base_a``: the same agent on the bundle's
  head and prototype; ``wise_head_a``: agent and head both interpolated, the prototype made with that head;
- ``wise_paired_a``: ``wise_a`` paired with the start, as localize pairs a checkpoint;
- ``swa``: the mean of every checkpoint's agent (start included) on the repaired head;
- ``medoid``: per image, the box of {start, each checkpoint} with the highest mean IoU with the others
  (``models.companion.consensus``, what ``QLOC_PAIR_RULE=consensus`` serves);
- ``auto_wise_{a}[_paired]_{rule}``: what ``activate=auto`` would serve if the job's checkpoints were stored as
  ``wise_{a}`` (or ``wise_paired_{a}``): a guard on the job's own probes and labeled examples scores the interpolated
  agents, decides with the labeled rule ``rule`` (``beyond_noise``, the default, or ``agree``), and the interpolated
  checkpoint it activates is served (the start where it activates none); ``..._activated``: how many jobs activated.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/photo_wise_val.py --seeds 0 1 --classes birds fish fruit
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from photo_union_val import job_parser, photo_job

from app.config import Settings
from models.bundle import Reward, Start, load_bundle
from models.companion import consensus, start_companion
from models.core.metrics import corloc
from models.data.photos import load_manifest
from models.experiments.datasets import PhotoKind
from models.features import features_of, prototype_of
from models.guard import LABELED_RULES, Guard
from models.inference import Localizer

ALPHAS = (0.25, 0.5, 0.75)
GUARDED_ALPHAS = (0.5,)


def lerp(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], t: float) -> dict[str, torch.Tensor]:
    return {k: torch.lerp(a[k].float(), b[k].float(), t).to(a[k].dtype) if a[k].is_floating_point() else b[k]
            for k in a}


def wise_guard(bundle, prototype: torch.Tensor, setup, seed: int, wise: dict[int, dict], pair: bool) -> Guard:
    """A guard on the job's own probes and labeled examples (split as its guard split them), the start scored with
    the bundle's head, the interpolated checkpoints ``wise`` with the repaired one (paired with the start when
    ``pair``), as the job's guard scores its checkpoints."""
    g = Guard(bundle, prototype, setup.guard.probes, torch.Generator().manual_seed(seed * 7919 + 4),
              counts=setup.guard.counts)
    g.start(None)
    if setup.repair is not None and setup.repair.kept:
        g.use_reward(setup.repair.bundle, setup.repair.prototype)
        if pair:
            g.pair_with(start_companion(Localizer(bundle, bundle.device), Start(prototype)))
    for i, w in wise.items():
        g.observe(i, w)
    return g


def run(bundle, kind: PhotoKind, seed: int, settings: Settings, n_val: int, split: str) -> dict:
    t0 = time.perf_counter()
    ex, _, proto, setup, states = photo_job(bundle, kind, seed, settings, "agree")  # the guard scores paired
    val = kind.draw(bundle, split, n_val, seed)
    last = max(states)
    s0 = {k: v.detach().cpu() for k, v in bundle.agent_state.items()}
    base_loc, rep_loc = Localizer(bundle, "cpu"), Localizer(setup.bundle, "cpu")
    feats = features_of(bundle, val.images)

    def boxes(loc: Localizer, prototype: torch.Tensor, state: dict | None) -> torch.Tensor:
        return loc.run_features(feats, prototype, loc.agent(state)).boxes[-1]

    start = boxes(base_loc, proto, None)
    row = {"target": kind.describe(), "seed": seed, "repair_kept": setup.reward, "last": last,
           "checkpoints": sorted(states), "before": corloc(start, val.boxes),
           "after": corloc(boxes(rep_loc, setup.prototype, states[last]), val.boxes)}
    kept = setup.repair is not None and setup.repair.kept
    paired = base_loc.with_reward(Reward(setup.repair.head, setup.prototype, False, Start(proto))) if kept else rep_loc
    row["paired"] = corloc(boxes(paired, setup.prototype, states[last]), val.boxes)
    base_head = {k: v.detach().cpu() for k, v in bundle.embedder.head.state_dict().items()}
    for a in ALPHAS:
        wa = lerp(s0, states[last], a)
        row[f"wise_{a}"] = corloc(boxes(rep_loc, setup.prototype, wa), val.boxes)
        row[f"wise_base_{a}"] = corloc(boxes(base_loc, proto, wa), val.boxes)
        row[f"wise_paired_{a}"] = corloc(boxes(paired, setup.prototype, wa), val.boxes)
        if kept:
            hb = bundle.with_head(lerp(base_head, setup.repair.head, a))
            row[f"wise_head_{a}"] = corloc(boxes(Localizer(hb, "cpu"), prototype_of(hb, ex), wa), val.boxes)
        else:
            row[f"wise_head_{a}"] = row[f"wise_base_{a}"]
    every = [s0, *(states[i] for i in sorted(states))]
    swa = {k: torch.stack([s[k].float() for s in every]).mean(0).to(s0[k].dtype) if s0[k].is_floating_point()
           else s0[k] for k in s0}
    row["swa"] = corloc(boxes(rep_loc, setup.prototype, swa), val.boxes)
    answers = torch.stack([start, *(boxes(rep_loc, setup.prototype, states[i]) for i in sorted(states))])
    row["medoid"] = corloc(answers[consensus(answers), torch.arange(answers.shape[1])], val.boxes)
    for a in GUARDED_ALPHAS:
        wise = {i: lerp(s0, states[i], a) for i in sorted(states)}
        for pair in (False, True) if kept else (False,):
            g = wise_guard(bundle, proto, setup, seed, wise, pair)
            for rule in LABELED_RULES:
                d = g.decide("auto", labeled_rule=rule)
                name = f"auto_wise_{a}{'_paired' if pair else ''}_{rule}"
                it = d["activate"]
                row[name] = row["before"] if it is None else corloc(boxes(g.served(it), setup.prototype, wise[it]),
                                                                    val.boxes)
                row[f"{name}_activated"] = int(it is not None)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def main() -> None:
    p = job_parser(__doc__)
    p.add_argument("--merge", nargs="+", help="summarize these outputs' rows instead of running")
    a = p.parse_args()
    if a.merge:
        rows = [r for f in a.merge for r in json.loads(Path(f).read_text())["rows"]]
    else:
        torch.set_num_threads(1)
        bundle = load_bundle("bundles/photo-mammals.pt", "cpu")
        manifest = load_manifest()
        rows = [run(bundle, PhotoKind(c, manifest), seed, Settings(), a.n_val, a.split)
                for seed in a.seeds for c in a.classes]
    skip = ("target", "seed", "repair_kept", "last", "checkpoints", "seconds")
    keys = [k for k in rows[0] if k not in skip and not k.endswith("_activated")]
    summary = {k: {"mean": round(sum(r[k] for r in rows) / len(rows), 2),
                   "mean_gain": round(sum(r[k] - r["before"] for r in rows) / len(rows), 2),
                   "worst_gain": round(min(r[k] - r["before"] for r in rows), 2),
                   "below_1": sum(r[k] - r["before"] < -1 for r in rows),
                   **({"activated": sum(r.get(f"{k}_activated", 0) for r in rows)}
                      if f"{k}_activated" in rows[0] else {})} for k in keys}
    print(json.dumps({"command": " ".join(["python", *sys.argv]), "rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
