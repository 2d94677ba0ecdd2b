"""Several instances per image (issue 13): AP50 and recall at K of ``models.instances.find_instances`` against
the ranking baseline and a sliding window at equal compute.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/multi_instance.py --out runs/multi_instance.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/multi_instance.py --variant photo --out runs/multi_photo.json

**Data** (``models.data.multi``). ``cmnist``: 84x84 canvases with 1-4 instances of the query digit and 0-3
distractor digits (gray patches around them), the shipped ``mnist-digit4`` bundle, query digits ``--digits``
(4: the bundle's own; the others are new to it). ``photo``: 1-4 cut-outs of the query class and 0-3 of other
classes on a background photo, the shipped ``photo-mammals`` bundle, ``--classes`` (needs ``qloc
fetch-photos``). Test images from the test split (MNIST's test file; the photo test files), ``--n`` per query
and seed for each of ``--seeds``; the prototype is the mean embedding of 5 exemplar crops of the train split
(on photos pasted at the multi-instance object sizes).

**Methods**, each up to ``K`` boxes per image, best first, for K in ``--ks``:

- ``qloc``: the agent's usual answer, then ``find_instances`` (coarse windows ranked, greedy episodes from the
  best, NMS);
- ``ranking@evals``: ranking + NMS over dense squares (``ranking_candidates_within``) at qloc's head evaluations
  per image (the answer's included);
- ``ranking@evals+steps``: the same at qloc's head evaluations plus its agent steps (an agent step, one small
  RoI + GRU call, costs less than a head evaluation: a budget in the baseline's favour);
- ``ranking-full``: ranking + NMS over the usual ranking candidates (cMNIST: ``ranking_candidates``, 949 squares;
  photos: ``rect_candidates(sides=7)``, as in the photo benchmark);
- ``sliding@evals``: windows of the exemplars' mean size on an even grid of qloc's head evaluations, + NMS.

At K = 1 qloc is the usual answer (no instance search), so the budgets are its answer's evaluations only.

**Selection on validation only.** Each method's NMS IoU (for qloc ``InstanceConfig.nms_iou``, which also
separates its start windows) is chosen per K from ``--nms-grid`` by the mean AP50 over the queries on the
validation split (train-file digits disjoint from training's; the photo val files), ``--n-val`` images per
query, generator seed 100; K = 1 needs no NMS. Test images never select anything.

**Metrics** (``models.core.metrics.detection_metrics``, COCO's AP at IoU 0.5 with ``maxDets = K``): per query and
seed; the table shows the bundle's own query and the mean over the new queries, mean +- std over seeds, and
the wall time per image on this machine (one thread: the backbone pass + the method), and evaluations per
image. Prints a markdown table; ``--out`` gets the JSON (settings, selections, every row, the summary).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.bundle import load_bundle  # noqa: E402
from models.core.metrics import detection_metrics  # noqa: E402
from models.data.multi import MULTI_OBJECT_SIDE, MultiBatch, cmnist_multi, photos_multi  # noqa: E402
from models.data.photos import PasteParams, generate, load_manifest  # noqa: E402
from models.data.photos import crops as photo_crops  # noqa: E402
from models.data.types import exemplar_crops  # noqa: E402
from models.evaluate import ranking_candidates, rect_candidates  # noqa: E402
from models.experiments.baselines import (  # noqa: E402
    Detections,
    box_distances,
    nms_detections,
    ranking_candidates_within,
    sliding_windows,
)
from models.experiments.cmnist import cmnist  # noqa: E402
from models.experiments.provenance import cpu_model  # noqa: E402
from models.experiments.report import mean_std  # noqa: E402
from models.inference import Localizer, normalize  # noqa: E402
from models.instances import InstanceConfig, coarse_windows, find_instances  # noqa: E402

METHODS = ("qloc", "ranking@evals", "ranking@evals+steps", "ranking-full", "sliding@evals")
VAL_SEED = 100


@dataclass
class Scene:
    """One query's images: the ground truth, the backbone's features (and their time), the prototype."""

    query: int | str
    seed: int
    batch: MultiBatch
    feats: Tensor
    backbone_s: float
    prototype: Tensor
    window: tuple[float, float]


def timed(fn: Callable):  # noqa: ANN201
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


class Setup:
    """The variant's bundle, data and exemplars."""

    def __init__(self, a: argparse.Namespace):
        self.variant = a.variant
        if a.variant == "cmnist":
            self.loc = Localizer(load_bundle(ROOT / (a.bundle or "bundles/mnist-digit4.pt")), "cpu")
            self.queries: list = a.digits
            self.own = 4
        else:
            self.loc = Localizer(load_bundle(ROOT / (a.bundle or "bundles/photo-mammals.pt")), "cpu")
            self.manifest = load_manifest(a.photos)
            self.queries = a.classes
            self.own = "mammals"
        self.agent = self.loc.agent()
        self.protos: dict = {}
        self.windows: dict = {}
        for q in self.queries:
            crops = self._exemplars(q)
            self.protos[q] = self.loc.prototype(crops)
            self.windows[q] = (statistics.fmean(c.shape[-1] for c in crops),  # (w, h): the sliding window
                               statistics.fmean(c.shape[-2] for c in crops))

    def _exemplars(self, q) -> list[Tensor]:  # noqa: ANN001
        if self.variant == "cmnist":
            return exemplar_crops(cmnist(q, "train", 5, "patch", 1000))
        size = self.loc.spec.size
        return photo_crops(generate(self.manifest, q, "train", 5, seed=1000, size=size,
                                    params=PasteParams(object_side=MULTI_OBJECT_SIDE)))

    def scene(self, q, split: str, n: int, seed: int) -> Scene:  # noqa: ANN001
        if self.variant == "cmnist":
            batch = cmnist_multi(q, split, n, seed)
        else:
            batch = photos_multi(self.manifest, q, split, n, seed, size=self.loc.spec.size)
        with torch.inference_mode():
            feats, s = timed(lambda: self.loc.embedder.features(normalize(batch.images, self.loc.spec)))
        return Scene(q, seed, batch, feats, s, self.protos[q], self.windows[q])

    @property
    def full_candidates(self) -> Tensor:
        b = self.loc.bundle
        if self.variant == "cmnist":
            return ranking_candidates(b)
        return rect_candidates(b, sides=7, stride=b.config.input.size // 10)


@dataclass
class Run:
    """One method on one scene at one NMS IoU: detections for the largest K, seconds (method only, backbone
    apart), head evaluations per image."""

    det: Detections
    seconds: float
    evaluations: int


class Methods:
    """Every method on a scene. Scorings are shared across NMS thresholds and K: top-K NMS of a larger K starts
    with the smaller K's boxes (and so does ``find_instances``), so the largest K is run once and cut."""

    def __init__(self, setup: Setup, kmax: int, cfg: InstanceConfig):
        self.s, self.kmax, self.cfg = setup, kmax, cfg
        loc = setup.loc
        env = loc.bundle.config.env
        # Head evaluations of the usual answer: its final box, or every visited box when the episode embeds
        # them (an agent that reads the prototype, or the nearest-box answer).
        self.answer_evals = env.steps + 1 if (loc.default_nearest or setup.agent.cfg.use_prototype) else 1
        episodes = min(cfg.starts, len(coarse_windows(loc.spec.size, env.min_side, cfg)))
        self.steps = {1: env.steps, kmax: env.steps * (1 + episodes)}  # agent steps per image

    def answer(self, sc: Scene) -> Run:
        """The agent's usual answer (greedy episode) -> a K = 1 run."""
        with torch.inference_mode():
            ro, t = timed(lambda: self.s.loc.run_features(sc.feats, sc.prototype, self.s.agent))
        ones = torch.ones(len(sc.feats), 1, dtype=torch.bool)
        return Run(Detections(ro.boxes[-1][:, None], ro.distances[-1][:, None], ones, 0), t, self.answer_evals)

    def qloc(self, sc: Scene, answer: Run, iou: float) -> Run:
        loc, cfg = self.s.loc, replace(self.cfg, nms_iou=iou)
        with torch.inference_mode():
            inst, t = timed(lambda: find_instances(loc.embedder, self.s.agent, sc.feats, sc.prototype,
                                                   loc.bundle.config.env, loc.spec.size, self.kmax,
                                                   answer.det.boxes[:, 0], answer.det.distances[:, 0], cfg))
        det = Detections(inst.boxes, inst.distances, inst.valid, inst.evaluations)
        return Run(det, answer.seconds + t, self.answer_evals + inst.evaluations)

    def baselines(self, sc: Scene, evals: int, steps: int, ious: dict[str, set[float]], k: int) -> dict:
        """The baselines at qloc's ``evals`` head evaluations (and ``steps`` agent steps) per image, NMS at each
        of ``ious[name]`` -> ``{name: {iou: Run}}``."""
        bundle, size = self.s.loc.bundle, self.s.loc.spec.size
        cands = {"ranking@evals": ranking_candidates_within(bundle, evals),
                 "ranking@evals+steps": ranking_candidates_within(bundle, evals + steps),
                 "ranking-full": self.s.full_candidates,
                 "sliding@evals": sliding_windows(size, sc.window, evals)}
        out: dict = {}
        for name, boxes in cands.items():
            with torch.inference_mode():
                dist, t = timed(lambda b=boxes: box_distances(bundle, sc.feats, b, sc.prototype))
            out[name] = {}
            for iou in sorted(ious[name]):
                det, t_nms = timed(lambda b=boxes, d=dist, i=iou: nms_detections(b, d, k, i))
                out[name][iou] = Run(det, t + t_nms, len(boxes))
        return out


def run_scene(m: Methods, sc: Scene, ious: dict[str, set[float]], k1: bool) -> dict:
    """Every method on one scene -> ``{method: {iou: Run}}`` at the largest K for the IoUs asked for, and with
    ``k1`` also ``{"k1": {method: Run}}``: at K = 1 qloc is the usual answer, the budgeted baselines get its
    evaluations, and there is nothing to suppress."""
    answer = m.answer(sc)
    out: dict = {"qloc": {iou: m.qloc(sc, answer, iou) for iou in sorted(ious["qloc"])}}
    evals = next(iter(out["qloc"].values())).evaluations if out["qloc"] else m.qloc(sc, answer, 0.5).evaluations
    out.update(m.baselines(sc, evals, m.steps[m.kmax], ious, m.kmax))
    if k1:
        out["k1"] = {"qloc": answer}
        out["k1"].update({name: next(iter(r.values())) for name, r in
                          m.baselines(sc, m.answer_evals, m.steps[1], {n: {0.5} for n in METHODS}, 1).items()})
    return out


def metrics_at(run: Run, gt: list[Tensor], k: int) -> dict[str, float]:
    d = run.det
    scores = (-d.distances[:, :k]).masked_fill(~d.valid[:, :k], -torch.inf)
    return detection_metrics(d.boxes[:, :k].cpu(), scores.cpu(), gt, k)


def select_ious(setup: Setup, m: Methods, a: argparse.Namespace, ks: list[int]) -> tuple[dict, dict]:
    """-> ({method: {K: iou}}, validation AP50 {method: {K: {iou: mean over queries}}})."""
    grid = set(a.nms_grid)
    val: dict = {name: {k: {iou: [] for iou in grid} for k in ks if k > 1} for name in METHODS}
    for q in setup.queries:
        sc = setup.scene(q, "val", a.n_val, VAL_SEED)
        runs = run_scene(m, sc, {name: grid for name in METHODS}, k1=False)
        for name in METHODS:
            for k in ks:
                if k > 1:
                    for iou in grid:
                        val[name][k][iou].append(metrics_at(runs[name][iou], sc.batch.boxes, k)["ap50"])
    chosen: dict = {name: {} for name in METHODS}
    scores: dict = {name: {} for name in METHODS}
    for name in METHODS:
        for k in ks:
            if k > 1:
                means = {iou: statistics.fmean(v) for iou, v in val[name][k].items()}
                chosen[name][k] = max(sorted(means), key=lambda i: means[i])  # ties: the lowest IoU
                scores[name][k] = {str(iou): round(v, 4) for iou, v in sorted(means.items())}
    return chosen, scores


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=("cmnist", "photo"), default="cmnist")
    p.add_argument("--bundle", default=None, help="default: bundles/mnist-digit4.pt (cmnist), photo-mammals.pt (photo)")
    p.add_argument("--digits", type=int, nargs="+", default=[4, 2, 7, 9], help="cmnist queries (4: the bundle's)")
    p.add_argument("--classes", nargs="+", default=["mammals", "birds", "fruit"], help="photo queries")
    p.add_argument("--photos", default=None, help="the photo cache (default: data/photos)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="test generator seeds")
    p.add_argument("--n", type=int, default=None, help="test images per query and seed (default 40 cmnist, 20 photo)")
    p.add_argument("--n-val", type=int, default=None, help="validation images per query (default: --n)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--nms-grid", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4, 0.5])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    a.n = a.n or (40 if a.variant == "cmnist" else 20)
    a.n_val = a.n_val or a.n
    torch.set_num_threads(a.threads)
    t_start = time.perf_counter()
    setup = Setup(a)
    ks = sorted(set(a.ks))
    m = Methods(setup, max(ks), InstanceConfig())
    chosen, val_scores = select_ious(setup, m, a, ks) if max(ks) > 1 else ({n: {} for n in METHODS}, {})
    print(f"validation (mean AP50 over queries, per NMS IoU): {json.dumps(val_scores)}", flush=True)
    print(f"chosen NMS IoU: {json.dumps(chosen)}", flush=True)
    rows = []
    for seed in a.seeds:
        for q in setup.queries:
            sc = setup.scene(q, "test", a.n, seed)
            runs = run_scene(m, sc, {name: set(chosen[name].values()) for name in METHODS}, k1=1 in ks)
            for name in METHODS:
                for k in ks:
                    run = runs["k1"][name] if k == 1 else runs[name][chosen[name][k]]
                    met = metrics_at(run, sc.batch.boxes, k)
                    rows.append({"method": name, "k": k, "query": q, "seed": seed, "images": a.n,
                                 "instances": int(sc.batch.counts.sum()), "ap50": met["ap50"],
                                 "recall_at_k": met["recall_at_k"],
                                 "evaluations": run.evaluations,
                                 "ms_per_image": (sc.backbone_s + run.seconds) / a.n * 1000,
                                 "nms_iou": None if k == 1 else chosen[name][k]})
            print(f"seed {seed} query {q}: done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    summary = summarize(rows, setup.own, ks)
    table = markdown(summary, setup.own)
    print(table)
    result = {"benchmark": "multi_instance", "variant": a.variant, "command": " ".join(sys.argv),
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_model(), "threads": a.threads, "torch": torch.__version__},
              "settings": {k: v for k, v in vars(a).items() if k != "out"},
              "instance_config": vars(m.cfg) if hasattr(m.cfg, "__dict__") else str(m.cfg),
              "validation_ap50": val_scores, "nms_iou": chosen, "summary": summary, "table": table, "rows": rows,
              "wall_seconds": round(time.perf_counter() - t_start, 1)}
    print(f"wall time: {result['wall_seconds']} s")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1, default=str) + "\n")


def summarize(rows: list[dict], own, ks: list[int]) -> list[dict]:  # noqa: ANN001
    """Per method and K: the bundle's own query and the mean over the new ones (each seed's mean over the queries,
    then mean and std over seeds) of AP50 and recall@K; evaluations and ms per image (means over rows)."""
    out = []
    for name in METHODS:
        for k in ks:
            rs = [r for r in rows if r["method"] == name and r["k"] == k]
            seeds = sorted({r["seed"] for r in rs})
            entry: dict = {"method": name, "k": k, "evaluations": statistics.fmean(r["evaluations"] for r in rs),
                           "ms_per_image": round(statistics.fmean(r["ms_per_image"] for r in rs), 1),
                           "nms_iou": rs[0]["nms_iou"]}
            for group, keep in (("own", lambda r: r["query"] == own), ("new", lambda r: r["query"] != own)):
                sel = [r for r in rs if keep(r)]
                if not sel:
                    continue
                for metric in ("ap50", "recall_at_k"):
                    per_seed = [statistics.fmean(r[metric] for r in sel if r["seed"] == s) for s in seeds]
                    entry[f"{metric}_{group}"] = mean_std(per_seed)
            out.append(entry)
    return out


def markdown(summary: list[dict], own) -> str:  # noqa: ANN001
    def ms(d: dict | None) -> str:
        return "–" if d is None else f"{d['mean']:.3f} ± {d['std']:.3f}"

    lines = [f"| method | K | AP50 ({own}) | recall@K ({own}) | AP50 (new) | recall@K (new) | head evals / image "
             "| ms / image | NMS IoU |", "|---|---|---|---|---|---|---|---|---|"]
    for e in summary:
        lines.append(f"| {e['method']} | {e['k']} | {ms(e.get('ap50_own'))} | {ms(e.get('recall_at_k_own'))} | "
                     f"{ms(e.get('ap50_new'))} | {ms(e.get('recall_at_k_new'))} | {e['evaluations']:.0f} | "
                     f"{e['ms_per_image']:.1f} | {e['nms_iou'] if e['nms_iou'] is not None else '–'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
