"""Real photographs (issue 15): per-class CorLoc of the shipped photo bundle and its baselines on the real-photo
benchmark (``models.data.realphotos``: whole photographs, one hand-drawn box each; ``qloc fetch-real-photos``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/real_photos.py --out runs/real_photos.json

**Data.** For each class, the exemplar crops are the boxes of that class's ``exemplar`` photos, cut from the
original photos (as a client would send them); the ``val`` and the ``test`` photos are evaluated separately.
Nothing here is chosen on the test half (nor on val: every setting below is fixed beforehand).

**Methods** (boxes compared with the hand-drawn box in the photo's own pixels; CorLoc = IoU >= 0.5):

- ``greedy`` / ``nearest`` / ``best16``: ``Localizer`` on the shipped bundle (``--bundle``, default
  ``bundles/photo-mammals.pt``): the greedy episode's last box (``nearest=False``), the visited box nearest the
  prototype (``nearest=True``, the bundle's default), and the best-of-16 search (``samples=15``, answer mode
  the bundle's default, as localize serves it);
- ``instances``: the several-instances search (``max_instances=4``, ``models.instances``), its first instance
  (the closest candidate): the "starting windows" candidate of the issue;
- ``adapted_greedy`` / ``adapted_nearest``: the policy adapted (``models.adapt.adapt`` with the photo preset's
  adaptation config, ``PhotoTransferSetup.adapt``: 100 iterations, lr 3e-4, entropy 0.1) on the class's
  unlabeled val + test photos (preprocessed to the bundle's input), one run per ``--seeds``;
- ``guarded``: an adaptation job as ``worker/jobs.py`` runs it with the service defaults (``app.config.Settings``:
  reward repair, 128 synthetic probes, 200 iterations, lr 1e-3, a checkpoint every 25, early stop, then
  ``Guard.decide("auto")``) on the same unlabeled photos: the verdict, the checkpoint it activates, and the
  CorLoc a user gets (the activated checkpoint served with its reward head, nearest answer; the starting policy
  when nothing is activated); ``guarded_last`` is the job's last checkpoint alone (what ``activate=true`` gave
  before ``QLOC_PAIR_START``); ``guarded_paired``: that checkpoint paired with the starting policy
  (``Localizer.with_reward`` with the job's ``Start``: what ``activate=true`` serves on a photo bundle's job whose
  repair was kept, by ``QLOC_PAIR_RULE``: the two heads' agreement, or with ``consensus`` the consensus of the start
  and the job's checkpoints; the checkpoint alone where it was not); ``guarded_unanimous``: the same pair where the
  frozen backbone features must prefer the checkpoint's box too (``Companion(judge=..., agree=True)``, the judge
  ``models.repair.FeatureScorer``'s reference from the exemplar crops; not served; the consensus rule ignores a
  judge); one run per ``--guard-seeds``;
- ``template``: template matching (``models.experiments.baselines.template_matching``, NCC) at the bundle's input
  size (each photo resized to 224 x 224 as the agent sees it): the exemplar crops cut from their photos resized
  the same way, at long sides ``TEMPLATE_FRACTIONS`` x 224 (a fixed geometric range: the default scales are
  relative to each crop's own size, which means nothing across photos of different resolutions);
- ``ranking``: ``models.evaluate.ranking`` over the photo benchmark's candidates (``rect_candidates(sides=7,
  stride=22)``: 1,787 rectangles); ``ranking_eq``: the same over the finest such grid within the instance
  search's head evaluations per image (its coarse windows, its episodes and the answer's).

**Latency**: ms per image, batch 1, one thread, from the decoded photo (PIL, its own size) to the box, the
resize to the input included; the median over the class's val + test photos (``preprocess_ms``: the resize
alone). Adaptation is timed per run (``adapt_seconds``, ``job_seconds``); the adapted agents localize as fast
as the base one.

Prints one JSON line per class and method (``val`` / ``test``: ``n``, ``corloc``, ``mean_iou``, per-image
``iou``; seeded methods: the mean over seeds and each seed's), then the summary (per method and split: CorLoc
over images, mean CorLoc over classes, mean IoU, median latency) as the last line; ``--out`` gets everything,
and a markdown table goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.config import Settings  # noqa: E402
from models.adapt import AdaptConfig, adapt  # noqa: E402
from models.bundle import Bundle, Start, load_bundle  # noqa: E402
from models.core.boxes import paired_iou  # noqa: E402
from models.data import realphotos  # noqa: E402
from models.data.types import LabeledImages  # noqa: E402
from models.evaluate import ranking, rect_candidates  # noqa: E402
from models.experiments.baselines import template_matching  # noqa: E402
from models.experiments.photos import PhotoTransferSetup  # noqa: E402
from models.guard import GuardConfig  # noqa: E402
from models.inference import Localizer, pil_to_tensor, preprocess  # noqa: E402
from models.instances import InstanceConfig, coarse_windows  # noqa: E402
from models.repair import FeatureScorer, RepairConfig, guarded_setup, pairs_start, probe_style  # noqa: E402

TEMPLATE_FRACTIONS = tuple(round(0.15 * (0.9 / 0.15) ** (i / 6), 4) for i in range(7))
"""Template long sides as fractions of the input side: 0.15 ... 0.9, geometric (7 scales), fixed beforehand to
span the benchmark's object sizes (LABELING.md: boxes from 4 % to 98 % of the image, median about a third)."""
ANSWER_METHODS = ("greedy", "nearest", "best16", "instances")
BASELINES = ("template", "ranking", "ranking_eq")
SEEDED = ("adapted_greedy", "adapted_nearest", "guarded", "guarded_synthetic", "guarded_last", "guarded_paired",
          "guarded_unanimous")
METHODS = ANSWER_METHODS + SEEDED + BASELINES


@dataclass
class Options:
    seeds: tuple[int, ...] = (0, 1, 2)
    """Seeds of the policy-only adaptation (photo preset config)."""
    guard_seeds: tuple[int, ...] = (0,)
    """Seeds of the guarded job (service defaults); () to skip it."""
    adapt: AdaptConfig = field(default_factory=lambda: PhotoTransferSetup("any").adapt)
    samples: int = 15
    max_instances: int = 4
    template: bool = True
    template_fractions: tuple[float, ...] = TEMPLATE_FRACTIONS
    ranking: bool = True
    ranking_sides: int = 7
    labeled: bool = False
    """The guarded job gets the exemplar photos with their boxes as the set's labeled examples (a set created from
    whole images with ``boxes``); otherwise none (a set of crops)."""
    wise: tuple[float, ...] = ()
    """Weight interpolation (``benchmarks/photo_wise_val.py``): for each ``a``, the guarded job's checkpoints as
    ``lerp(start, checkpoint, a)``, scored by a guard on the job's probes: ``guarded_wise_{a}`` what ``activate=auto``
    would serve (labeled rule ``beyond_noise``), ``guarded_wise_{a}_agree`` with ``agree``, ``wise_{a}_last`` the
    last one (``activate=true``)."""
    max_images: int | None = None
    """Only the first this many photos of each split (a quick check); None: all."""
    splits: tuple[str, ...] = ("val", "test")


# ---------------------------------------------------------------- helpers


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def _scale(boxes: Tensor, scales: Tensor) -> Tensor:
    """Input-pixel boxes ``[N, 4]`` -> the photos' pixels (``scales [N, 2]`` from ``preprocess``)."""
    return boxes.cpu() * torch.cat([scales, scales], dim=1)


def _metrics(pred: Tensor, photos: list[realphotos.RealPhoto]) -> dict[str, Any]:
    gt = torch.tensor([p.box for p in photos], dtype=torch.float32)
    iou = paired_iou(pred.float(), gt)
    return {"n": len(photos), "corloc": round(float((iou >= 0.5).float().mean() * 100), 2),
            "mean_iou": round(float(iou.mean()), 4), "iou": [round(float(v), 3) for v in iou]}


def _seeded(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-seed split metrics -> their mean, with each seed's."""
    return {"n": per_seed[0]["n"], "corloc": round(statistics.fmean(m["corloc"] for m in per_seed), 2),
            "mean_iou": round(statistics.fmean(m["mean_iou"] for m in per_seed), 4),
            "corloc_seeds": [m["corloc"] for m in per_seed], "mean_iou_seeds": [m["mean_iou"] for m in per_seed],
            "iou": [m["iou"] for m in per_seed]}


def exemplar_crops(photos: list[realphotos.RealPhoto], channels: int, fill: tuple[float, ...]) -> list[Tensor]:
    """The exemplar photos' boxes cut from the original photos -> crops ``[C, h, w]`` in [0, 1]."""
    return [pil_to_tensor(p.image.crop(tuple(round(v) for v in p.box)), channels, fill) for p in photos]


def input_crops(bundle: Bundle, photos: list[realphotos.RealPhoto]) -> list[Tensor]:
    """The exemplar boxes cut from their photos resized to the input (``preprocess``): templates in the geometry
    the images to search are in."""
    batch, scales = preprocess([p.image for p in photos], bundle.config.input)
    out = []
    for img, p, (sx, sy) in zip(batch, photos, scales.tolist(), strict=True):
        x1, y1, x2, y2 = p.box
        size = bundle.config.input.size
        a, b = min(size - 2, int(x1 / sx)), min(size - 2, int(y1 / sy))
        c, d = max(a + 2, round(x2 / sx)), max(b + 2, round(y2 / sy))
        out.append(img[:, b:d, a:c].clone())
    return out


def instance_evaluations(bundle: Bundle, cfg: InstanceConfig | None = None) -> int:
    """Head evaluations per image of the instance search: its coarse windows, its episodes' boxes and the
    answer's episode (every visited box is embedded for the nearest answer)."""
    cfg = cfg or InstanceConfig()
    env, size = bundle.config.env, bundle.config.input.size
    steps = env.steps + 1
    return len(coarse_windows(size, env.min_side, cfg)) + cfg.starts * steps + steps


def candidates_within(bundle: Bundle, budget: int) -> tuple[Tensor, dict[str, int]]:
    """``rect_candidates`` on the grid (sides, stride) giving the most boxes within ``budget``."""
    best, key = None, None
    size = bundle.config.input.size
    for sides in range(2, 11):
        for stride in range(4, size // 2 + 1, 2):
            c = rect_candidates(bundle, sides=sides, stride=stride)
            if len(c) <= budget and (key is None or len(c) > key[0]):
                best, key = c, (len(c), sides, stride)
    if best is None:
        raise ValueError(f"no rect_candidates grid within {budget} boxes")
    return best, {"boxes": key[0], "sides": key[1], "stride": key[2]}


def run_job(bundle: Bundle, prototype: Tensor, crops: list[Tensor], images01: Tensor, seed: int,
            settings: Settings, labeled: LabeledImages | None = None) -> dict[str, Any]:
    """An adaptation job as ``worker/jobs.py`` runs it (its reward, probes, guard, checkpoints, early stop) ->
    the decision, the states of the checkpoints, and the bundle / prototype they are served with."""
    t0 = time.perf_counter()
    repair = RepairConfig(epochs=settings.repair_epochs) if settings.reward_repair else None
    pair = (Start(prototype, consensus=() if settings.pair_rule == "consensus" else None)  # as worker/jobs.py pairs
            if pairs_start(settings.pair_start, bundle) else None)
    setup = guarded_setup(bundle, prototype, crops, images01, None, synthetic=settings.synthetic_probes,
                          generator_seed=seed, repair=repair, labeled=labeled,
                          guard_cfg=GuardConfig(patience=settings.early_stop_patience), choice=settings.reward_choice,
                          start=pair, probe_style=probe_style(settings.probe_style, bundle))
    guard, states = setup.guard, {}

    def on_checkpoint(state: dict) -> None:
        states[int(state["iteration"])] = state["agent"]
        guard.observe(int(state["iteration"]), state["agent"])

    cfg = AdaptConfig(iterations=settings.default_iterations, lr=settings.default_learning_rate, seed=seed,
                      batch_size=min(settings.adapt_batch_size, len(images01)),
                      checkpoint_every=settings.checkpoint_every)
    res = adapt(setup.bundle, setup.prototype, images01, cfg, device=bundle.device, on_checkpoint=on_checkpoint,
                should_stop=lambda: guard.should_stop, scorer=setup.scorer)
    if res.iteration not in states and res.iteration > 0:  # stopped early: the worker saves the final state
        on_checkpoint({"iteration": res.iteration, "agent": res.agent_state})
    d = guard.decide("auto")
    # what activate=auto would take if pasted probes confirmed on their own, as on grayscale bundles
    d_synthetic = guard.decide("auto", synthetic_confirms=True)
    return {"decision": d, "decision_synthetic": d_synthetic, "states": states, "setup": setup,
            "seconds": round(time.perf_counter() - t0, 2)}


# ---------------------------------------------------------------- one class


def evaluate_class(loc: Localizer, cls: str, opts: Options | None = None,
                   log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every method on class ``cls`` -> one row per method (``val`` / ``test`` metrics, latency, extras)."""
    opts = opts or Options()
    say = log or (lambda s: None)
    bundle, spec = loc.bundle, loc.spec
    ex = realphotos.load("exemplar", cls)
    data = {s: realphotos.load(s, cls)[:opts.max_images] for s in opts.splits}
    crops = exemplar_crops(ex, spec.channels, spec.fill)
    proto = loc.prototype(crops)
    agent = loc.agent(None)
    templates = input_crops(bundle, ex)
    full_cands = rect_candidates(bundle, sides=opts.ranking_sides, stride=spec.size // 10)
    eq_cands, eq_grid = candidates_within(bundle, instance_evaluations(bundle))
    zero = torch.zeros(1, 4)

    def answer(pil, **kw):
        batch, scales = preprocess([pil], spec)
        loc_ = loc.localize_batch(batch, scales, proto, agent, **kw)[0]
        return loc_.instances[0].box if kw.get("max_instances", 1) > 1 and loc_.instances else loc_.box

    def ranked(cands: Tensor) -> Callable:
        def run(pil):
            batch, scales = preprocess([pil], spec)
            return _scale(ranking(bundle, LabeledImages(batch, zero), proto, cands, batch=1), scales)[0].tolist()
        return run

    def templated(pil):
        batch, scales = preprocess([pil], spec)
        box = template_matching(batch, templates, opts.template_fractions, ref_side=float(spec.size))
        return _scale(box, scales)[0].tolist()

    single: dict[str, Callable] = {
        "greedy": lambda pil: answer(pil, nearest=False),
        "nearest": lambda pil: answer(pil, nearest=True),
        "best16": lambda pil: answer(pil, samples=opts.samples),
        "instances": lambda pil: answer(pil, max_instances=opts.max_instances),
    }
    if opts.template:
        single["template"] = templated
    if opts.ranking:
        single["ranking"] = ranked(full_cands)
        single["ranking_eq"] = ranked(eq_cands)
    # warm-up (first calls allocate), then one image at a time
    warm = data[opts.splits[0]][0].image
    for fn in single.values():
        fn(warm)
    boxes: dict[str, dict[str, list]] = {m: {s: [] for s in data} for m in single}
    lat: dict[str, list[float]] = {m: [] for m in single}
    pre_ms = []
    for s, photos in data.items():
        for p in photos:
            t0 = time.perf_counter()
            preprocess([p.image], spec)
            pre_ms.append(_ms(t0))
            for m, fn in single.items():
                t0 = time.perf_counter()
                box = fn(p.image)
                lat[m].append(_ms(t0))
                boxes[m][s].append(box)
    extras = {"ranking": {"candidates": len(full_cands)}, "ranking_eq": {"candidates": len(eq_cands), "grid": eq_grid},
              "template": {"templates": len(templates), "fractions": list(opts.template_fractions),
                           "at": f"input size {spec.size}"},
              "instances": {"evaluations": instance_evaluations(bundle)}}
    rows = []
    for m in single:
        row = {"class": cls, "method": m}
        row.update({s: _metrics(torch.tensor(boxes[m][s]), data[s]) for s in data})
        row["latency_ms"] = round(statistics.median(lat[m]), 2)
        row["preprocess_ms"] = round(statistics.median(pre_ms), 2)
        row.update(extras.get(m, {}))
        rows.append(row)
        say(f"{cls:10s} {m:16s} " + "  ".join(f"{s} {row[s]['corloc']:5.1f}" for s in data)
            + f"  {row['latency_ms']:.0f} ms")

    # adaptation on the class's unlabeled val + test photos
    unl = [p.image for s in ("val", "test") for p in realphotos.load(s, cls)][:None if opts.max_images is None
                                                                               else 2 * opts.max_images]
    images01, _ = preprocess(unl, spec)
    prepped = {s: preprocess([p.image for p in photos], spec) for s, photos in data.items()}

    def evaluate_agent(state, nearest: bool | None, served: Localizer | None = None, prototype=None):
        lc = served or loc
        ag = lc.agent(state)
        pr = proto if prototype is None else prototype
        return {s: _metrics(torch.tensor([r.box for r in lc.localize_batch(b, k, pr, ag, nearest=nearest)]),
                            data[s]) for s, (b, k) in prepped.items()}

    per = {"adapted_greedy": [], "adapted_nearest": []}
    secs = []
    for seed in opts.seeds:
        t0 = time.perf_counter()
        res = adapt(bundle, proto, images01, replace(opts.adapt, seed=seed), device=bundle.device)
        secs.append(round(time.perf_counter() - t0, 2))
        per["adapted_greedy"].append(evaluate_agent(res.agent_state, False))
        per["adapted_nearest"].append(evaluate_agent(res.agent_state, True))
    if opts.seeds:
        for m, runs in per.items():
            row = {"class": cls, "method": m, "seeds": list(opts.seeds)}
            row.update({s: _seeded([r[s] for r in runs]) for s in data})
            row.update({"adapt_seconds": secs, "unlabeled": len(images01), "config": asdict(opts.adapt)})
            rows.append(row)
            say(f"{cls:10s} {m:16s} " + "  ".join(f"{s} {row[s]['corloc']:5.1f}" for s in data)
                + f"  adapt {statistics.fmean(secs):.0f} s")

    guarded, synthetic, last, paired, unanimous, info = [], [], [], [], [], []
    wise_runs: dict[str, list] = {f"{m}{a}{t}": [] for a in opts.wise
                                  for m, t in (("guarded_wise_", ""), ("guarded_wise_", "_agree"), ("wise_", "_last"))}
    settings = Settings()
    labeled = None
    if opts.labeled:
        batch, scales = preprocess([p.image for p in ex], spec)
        labeled = LabeledImages(batch, torch.tensor([p.box for p in ex], dtype=torch.float32)
                                / torch.cat([scales, scales], dim=1))
    if opts.wise:  # imported here: the tests import this file as a module, without benchmarks/ on the path
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from photo_wise_val import lerp, wise_guard
        s0 = {k: v.detach().cpu() for k, v in bundle.agent_state.items()}  # the start every checkpoint is mixed with
    for seed in opts.guard_seeds:
        job = run_job(bundle, proto, crops, images01, seed, settings, labeled)
        d, setup = job["decision"], job["setup"]
        served = Localizer(setup.bundle, bundle.device)
        it = d["activate"]
        guarded.append(evaluate_agent(job["states"][it], None, setup.guard.served(it), setup.prototype)
                       if it is not None else evaluate_agent(None, None))  # as the guard scored it, as served
        it_s = job["decision_synthetic"]["activate"]
        synthetic.append(evaluate_agent(job["states"][it_s], None, setup.guard.served(it_s), setup.prototype)
                         if it_s is not None else evaluate_agent(None, None))
        last_it = max(job["states"]) if job["states"] else None
        last.append(evaluate_agent(job["states"][last_it], None, served, setup.prototype) if last_it is not None
                    else evaluate_agent(None, None))
        pair = setup.guard.served(last_it) if setup.start is not None and last_it is not None else served
        paired.append(evaluate_agent(job["states"][last_it], None, pair, setup.prototype) if last_it is not None
                      else evaluate_agent(None, None))
        three = pair
        if pair.companion is not None:  # the frozen features must prefer the checkpoint's box too
            judge = FeatureScorer.from_crops(bundle, crops).reference
            three = Localizer(pair.bundle, pair.device, companion=replace(pair.companion, judge=judge))
        unanimous.append(evaluate_agent(job["states"][last_it], None, three, setup.prototype) if last_it is not None
                         else evaluate_agent(None, None))
        for a in opts.wise:
            wise = {i: lerp(s0, st, a) for i, st in sorted(job["states"].items())}
            g = wise_guard(bundle, proto, setup, seed, wise, setup.start is not None)
            for rule, name in (("beyond_noise", f"guarded_wise_{a}"), ("agree", f"guarded_wise_{a}_agree")):
                wi = g.decide("auto", labeled_rule=rule)["activate"]
                wise_runs[name].append(evaluate_agent(wise[wi], None, g.served(wi), setup.prototype)
                                       if wi is not None else evaluate_agent(None, None))
            wise_runs[f"wise_{a}_last"].append(evaluate_agent(wise[last_it], None, g.served(last_it), setup.prototype)
                                               if last_it is not None else evaluate_agent(None, None))
        best = d["validation"]["best"]
        info.append({"seed": seed, "verdict": d["verdict"], "activated": it, "activated_synthetic": it_s,
                     "last_iteration": last_it, "probe_style": probe_style(settings.probe_style, bundle),
                     "reward": setup.reward, "repair_kept": None if setup.repair is None else setup.repair.kept,
                     "repair": None if setup.repair is None else {k: setup.repair.record[k]
                                                                   for k in ("before", "after", "kept")},
                     "probe_before": d["validation"]["base"]["select"]["corloc"],
                     "probe_best": None if best is None else best["select"]["corloc"],
                     "stopped_early": d["validation"]["stopped_early"], "job_seconds": job["seconds"]})
    if opts.guard_seeds:
        for m, runs in (("guarded", guarded), ("guarded_synthetic", synthetic), ("guarded_last", last),
                        ("guarded_paired", paired),
                        ("guarded_unanimous", unanimous), *wise_runs.items()):
            row = {"class": cls, "method": m, "seeds": list(opts.guard_seeds)}
            row.update({s: _seeded([r[s] for r in runs]) for s in data})
            row["jobs"] = info
            rows.append(row)
            say(f"{cls:10s} {m:16s} " + "  ".join(f"{s} {row[s]['corloc']:5.1f}" for s in data)
                + "  " + ", ".join(f"{i['verdict']} (activated {i['activated']})" for i in info))
    return rows


# ---------------------------------------------------------------- summary and table


def summarize(rows: list[dict], splits: tuple[str, ...]) -> dict[str, Any]:
    """Per method and split: CorLoc over all images (pooled; seeded: each seed pooled, then mean and std), the
    mean of the per-class CorLoc, the mean IoU over images, the median of the per-class latencies."""
    out: dict[str, Any] = {}
    for m in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == m]
        entry: dict[str, Any] = {}
        for s in splits:
            per_class = {r["class"]: r[s]["corloc"] for r in mine}
            if "corloc_seeds" in mine[0][s]:
                k = len(mine[0][s]["corloc_seeds"])
                pooled = [[v for r in mine for v in r[s]["iou"][i]] for i in range(k)]
            else:
                pooled = [[v for r in mine for v in r[s]["iou"]]]
            img = [100 * statistics.fmean(v >= 0.5 for v in ious) for ious in pooled]
            miou = [statistics.fmean(ious) for ious in pooled]
            entry[s] = {"n": len(pooled[0]), "corloc_images": round(statistics.fmean(img), 2),
                        "corloc_images_std": round(statistics.stdev(img), 2) if len(img) > 1 else 0.0,
                        "corloc_classes": round(statistics.fmean(per_class.values()), 2),
                        "mean_iou": round(statistics.fmean(miou), 4),
                        "classes_below_50": sorted(c for c, v in per_class.items() if v < 50)}
        if "latency_ms" in mine[0]:
            entry["latency_ms"] = round(statistics.median(r["latency_ms"] for r in mine), 2)
        out[m] = entry
    return out


def table(rows: list[dict], summary: dict, splits: tuple[str, ...]) -> str:
    methods = [m for m in METHODS if m in summary]
    classes = list(dict.fromkeys(r["class"] for r in rows))
    cell = {(r["class"], r["method"]): r for r in rows}
    lines = ["| class (val / test n) | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for c in classes:
        n = " / ".join(str(cell[(c, methods[0])][s]["n"]) for s in splits)
        vals = [" / ".join(f"{cell[(c, m)][s]['corloc']:.0f}" for s in splits) for m in methods]
        lines.append(f"| {c} ({n}) | " + " | ".join(vals) + " |")
    for key, name in (("corloc_images", "all images"), ("corloc_classes", "mean of classes")):
        lines.append(f"| **{name}** | " + " | ".join(" / ".join(f"{summary[m][s][key]:.1f}" for s in splits)
                                                     for m in methods) + " |")
    lines.append("| mean IoU | " + " | ".join(" / ".join(f"{summary[m][s]['mean_iou']:.2f}" for s in splits)
                                              for m in methods) + " |")
    lines.append("| latency ms (median) | " + " | ".join(
        f"{summary[m]['latency_ms']:.0f}" if "latency_ms" in summary[m] else "–" for m in methods) + " |")
    return "\n".join(lines)


def merge(paths: list[str], out_path: str | None) -> int:
    """The ``--out`` files of runs on disjoint classes (e.g. two processes) -> one file, summary recomputed."""
    parts = [json.loads(Path(f).read_text()) for f in paths]
    rows = [r for part in parts for r in part["rows"]]
    order = {c: i for i, c in enumerate(realphotos.classes())}
    rows.sort(key=lambda r: (order.get(r["class"], len(order)), METHODS.index(r["method"])))
    splits = tuple(parts[0]["options"]["splits"])
    summary = summarize(rows, splits)
    out = {**parts[0], "command": [part["command"] for part in parts], "merged_from": paths,
           "wall_seconds": [part["wall_seconds"] for part in parts], "summary": summary, "rows": rows,
           "images": {c: v for part in parts for c, v in part["images"].items()}}
    print(json.dumps({"summary": summary}), flush=True)
    print(table(rows, summary, splits), file=sys.stderr)
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(out, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default="bundles/photo-mammals.pt")
    p.add_argument("--classes", nargs="+", help="default: every class")
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2], help="policy-only adaptation seeds")
    p.add_argument("--guard-seeds", type=int, nargs="*", default=[0], help="guarded job seeds (none: skip)")
    p.add_argument("--labeled", action="store_true", help="the exemplar photos with their boxes as labeled examples")
    p.add_argument("--wise", type=float, nargs="*", default=[], help="weight interpolation factors (see Options)")
    p.add_argument("--max-images", type=int, help="only the first N photos of each split (a quick check)")
    p.add_argument("--no-template", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="write everything as JSON here (e.g. runs/real_photos.json)")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="instead of running: merge the --out files of runs on disjoint classes into --out")
    a = p.parse_args(argv)
    if a.merge:
        return merge(a.merge, a.out)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    missing = realphotos.verify()
    if missing:
        print(f"{len(missing)} real photos missing or changed: run `qloc fetch-real-photos` first", file=sys.stderr)
        return 1
    bundle = load_bundle(a.bundle, "cpu")
    loc = Localizer(bundle, "cpu")
    opts = Options(seeds=tuple(a.seeds), guard_seeds=tuple(a.guard_seeds), max_images=a.max_images,
                   labeled=a.labeled, wise=tuple(a.wise),
                   template=not a.no_template)
    t0 = time.perf_counter()
    rows = []
    for cls in a.classes or realphotos.classes():
        t1 = time.perf_counter()
        for row in evaluate_class(loc, cls, opts, log=lambda s: print(s, file=sys.stderr, flush=True)):
            rows.append(row)
            print(json.dumps(row), flush=True)
        print(f"{cls}: {time.perf_counter() - t1:.0f} s", file=sys.stderr, flush=True)
    summary = summarize(rows, opts.splits)
    wall = round(time.perf_counter() - t0, 1)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").is_file() else ""
    out = {"benchmark": "real photos (issue 15)", "bundle": a.bundle, "command": " ".join(["python", *sys.argv]),
           "date": datetime.date.today().isoformat(), "wall_seconds": wall,
           "machine": {"cpu": cpu, "cores": os.cpu_count(), "threads": a.threads, "torch": torch.__version__,
                       "gpu": torch.cuda.is_available()},
           "options": {**asdict(opts), "settings": Settings().model_dump(include={
               "synthetic_probes", "reward_repair", "reward_choice", "repair_epochs", "default_iterations",
               "default_learning_rate", "checkpoint_every", "adapt_batch_size", "early_stop_patience", "pair_start",
               "probe_style"})},
           "images": {c: {s: [ph.file_name for ph in realphotos.load(s, c)[:a.max_images]] for s in opts.splits}
                      for c in dict.fromkeys(r["class"] for r in rows)},
           "summary": summary, "rows": rows}
    print(json.dumps({"summary": summary, "wall_seconds": wall}), flush=True)
    print(table(rows, summary, opts.splits), file=sys.stderr)
    print(f"wall {wall} s", file=sys.stderr)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
