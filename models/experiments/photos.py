"""The photo protocol, in the paper's cross-class style: train stages 1-2 on one class of the offline
photos (``models.data.photos``), then localize every other class before and after test-time adaptation.

Data discipline (splits are by *source file*, see ``models.data.photos``): stage 1-2 training images come
from the training class's ``train`` split, model selection from its ``val`` split (never test). For a
target class, the 5 exemplar crops and the unlabeled adaptation images are drawn from that class's
``train`` split (two different draws), the test images from its ``test`` split, so no object photo and
no background of a test image was ever seen, not even unlabeled. Small classes have only 1-2 test
source photos (fish: 2); each generated image still differs (background crop, scale, position, flip,
colour jitter), but their per-class numbers say more about those few photos than about the class.

The backbone is frozen, so each image's feature map is computed once per set and reused by every
stage and metric here: stage 1 trains the head on cached features (``train_embedding`` re-runs the
backbone at every step: ~3.5 s per 32 images on one CPU thread, against ~0.35 s for a whole head
step), stage 2 and the metrics roll out on cached features. Adaptation goes through
``models.adapt.adapt`` unchanged, so its wall time includes its own backbone pass.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.adapt import AdaptConfig, adapt
from models.bundle import Bundle, new_bundle
from models.config import ModelConfig
from models.core.metrics import corloc
from models.data.photos import generate
from models.data.types import LabeledImages
from models.evaluate import evaluate_corloc, localize_boxes, ranking, ranking_metrics, rect_candidates
from models.experiments.baselines import finetune
from models.features import prototype_of, with_features
from models.inference import Localizer, normalize
from models.policy import PolicyConfig
from models.train.agent import AgentTrainConfig, train_agent
from models.train.embedding import EMBEDDING_ANCHORS, EmbeddingTrainConfig, train_embedding

PHOTO_CLASSES = ("mammals", "birds", "fish", "fruit", "vegetables", "flowers")
"""The classes with enough source photos in every split for the benchmark (insects and trees are too few)."""


# ---------------------------------------------------------------- data with cached features


class FeatureCache:
    """Backbone features on disk, keyed by the backbone config and the data draw (``None`` dir = off).

    Only for repeated tuning runs: the benchmark commands compute everything afresh by default.
    """

    def __init__(self, root: str | Path | None):
        self.root = Path(root) if root else None

    def get(self, bundle: Bundle, key: str, make: Callable[[], Tensor]) -> Tensor:
        """``make()``'s features, from disk when cached, on the embedder's device."""
        if self.root is None:
            return make()
        cfg = bundle.config
        spec = json.dumps([cfg.encoder.kind, cfg.encoder.options, cfg.input.size, cfg.input.exemplar_size,
                           list(cfg.input.mean), list(cfg.input.std)], sort_keys=True, default=str)
        path = self.root / f"{key}-{hashlib.sha256(spec.encode()).hexdigest()[:10]}.pt"
        if path.is_file():
            return torch.load(path, weights_only=True).to(next(bundle.embedder.parameters()).device)
        out = make()
        self.root.mkdir(parents=True, exist_ok=True)
        torch.save(out.cpu(), path)
        return out


def photo_set(bundle: Bundle, manifest: dict[str, Any], class_name: str, split: str, n: int, seed: int,
              crops: bool = False, cache: FeatureCache | None = None) -> LabeledImages:
    """``n`` generated photos of ``class_name`` (``split`` files only) carrying their backbone features;
    ``crops`` also carries each ground-truth crop's exemplar-canvas features (for prototypes)."""
    size = bundle.config.input.size
    b = generate(manifest, class_name, split, n, seed=seed, size=size)
    key = f"{class_name}-{split}-{n}-{seed}-{size}"
    disk = cache or FeatureCache(None)
    return with_features(bundle, LabeledImages(b.images, b.boxes), crops=crops, batch=32,
                         cache=lambda kind, make: disk.get(bundle, key if kind == "images" else f"{key}-{kind}", make))


# ---------------------------------------------------------------- the protocol

@dataclass
class PhotoTrainSetup:
    """Stages 1-2 on one class; the defaults are the benchmark's (tuned on validation only)."""

    class_name: str = "mammals"
    size: int = 224
    n_train: int = 160
    n_val: int = 64
    exemplars: int = 5
    anchor: str = "shuffle_exemplar"
    use_prototype: bool = True
    embedding: EmbeddingTrainConfig = field(default_factory=lambda: EmbeddingTrainConfig(
        epochs=15, batch_size=32, drop_last=True, pairs_per_image=8, lr=1e-3, margin=60.0, triplet_weight=1.0,
        recon_weight=0.0, eval_every=5))
    agent: AgentTrainConfig = field(default_factory=lambda: AgentTrainConfig(
        iterations=400, eval_every=25, lr=3e-3, entropy_coef=0.1, batch_size=64))
    agent_restarts: int = 3
    """Stage 2 runs this many times (seeds ``seed + 1000 * r``); the run with the best validation CorLoc is
    kept. One run's result depends a lot on its seed (val CorLoc 61-94 % over three seeds)."""


def photo_model_config(setup: PhotoTrainSetup) -> ModelConfig:
    from models.presets import photo_config

    cfg = photo_config(size=setup.size)
    cfg.agent.use_prototype = setup.use_prototype
    return cfg


def train_photo_bundle(name: str, manifest: dict[str, Any], setup: PhotoTrainSetup, seed: int,
                       cache: FeatureCache | None = None, log: Callable[[str, dict], None] | None = None,
                       device: str | torch.device = "cpu") -> Bundle:
    """Stages 1 and 2 on ``setup.class_name`` -> a trained bundle with provenance (seconds, val metrics).

    Everything runs on ``device``; the generated images and the boxes stay on the CPU (the random
    streams are CPU generators, so a seed draws the same data and the same box pairs on any device)."""
    if setup.agent_restarts < 1:
        raise ValueError(f"agent_restarts must be >= 1, got {setup.agent_restarts}")
    t0 = time.perf_counter()
    bundle = new_bundle(name, photo_model_config(setup), seed)
    bundle.embedder.to(device)
    c = setup.class_name
    train = photo_set(bundle, manifest, c, "train", setup.n_train, seed, crops=True, cache=cache)
    val = photo_set(bundle, manifest, c, "val", setup.n_val, seed, cache=cache)
    val_ex = photo_set(bundle, manifest, c, "val", setup.exemplars, seed + 500, crops=True, cache=cache)
    t1 = time.perf_counter()
    s1 = train_embedding(bundle, train, val, replace(setup.embedding, anchor=setup.anchor, seed=seed),
                         val_exemplars=val_ex, candidates=rect_candidates(bundle),
                         on_log=lambda r: log and log("embedding", r))
    t2 = time.perf_counter()
    runs = []
    for r in range(setup.agent_restarts):
        cfg = replace(setup.agent, seed=seed + 1000 * r)
        res = train_agent(bundle, train, val, val_ex, cfg,
                          on_log=lambda rec, r=r: log and log("agent", {"restart": r, **rec}))
        runs.append((res, bundle.agent_state))
    chosen = max(range(len(runs)), key=lambda r: runs[r][0]["val/corloc"])  # the first of equals
    s2, bundle.agent_state = runs[chosen]
    t3 = time.perf_counter()
    bundle.provenance = {
        "data": f"offline photos (models.data.photos), class {c}: {setup.n_train} generated training images from the "
                f"train split, validation {setup.n_val} + {setup.exemplars} exemplars from the val split",
        "seed": seed, "setup": _plain_setup(setup),
        "embedding": {k: v for k, v in s1.items() if k != "history"},
        "agent": {**{k: v for k, v in s2.items() if k != "history"}, "restart": chosen,
                  "restarts_val_corloc": [res["val/corloc"] for res, _ in runs]},
        "seconds": {"data_and_backbone": round(t1 - t0, 1), "embedding": round(t2 - t1, 1),
                    "agent": round(t3 - t2, 1)},
        "history": {"embedding": s1["history"], "agent": s2["history"]},
    }
    return bundle


def _plain_setup(setup: Any) -> dict:
    return json.loads(json.dumps(asdict(setup)))


@dataclass
class PhotoTransferSetup:
    class_name: str
    exemplars: int = 5
    unlabeled: int = 64
    test: int = 48
    ranking_images: int = 48
    """The ranking baseline embeds every candidate box (~1.8k per image) on the first this many test images."""
    finetune_iterations: int = 30
    finetune: PolicyConfig = field(default_factory=lambda: PolicyConfig(reward="iou", entropy_coef=0.1))
    adapt: AdaptConfig = field(default_factory=lambda: AdaptConfig(iterations=100, batch_size=32, lr=3e-4,
                                                                   entropy_coef=0.1))
    baselines: bool = True
    search_samples: int = 15
    """Also report the best-of-(1 + this) search; 0: off."""


def photo_transfer(bundle: Bundle, manifest: dict[str, Any], setup: PhotoTransferSetup, seed: int,
                   cache: FeatureCache | None = None) -> tuple[dict, dict]:
    """Evaluate ``bundle`` on ``setup.class_name`` before and after adaptation -> (metrics, artifacts)."""
    c = setup.class_name
    ex = photo_set(bundle, manifest, c, "train", setup.exemplars, seed + 1000, crops=True, cache=cache)
    unl = generate(manifest, c, "train", setup.unlabeled, seed=seed + 2000, size=bundle.config.input.size)
    test = photo_set(bundle, manifest, c, "test", setup.test, seed, cache=cache)
    proto = prototype_of(bundle, ex)
    m: dict[str, Any] = {"class": c, "seed": seed, "n_test": len(test)}
    m.update(ranking_metrics(bundle, test, proto, seed=seed, candidates=rect_candidates(bundle)))
    base = bundle.new_agent()
    traj_before = localize_boxes(bundle, base, test, proto)
    m["corloc_before"] = corloc(traj_before[-1], test.boxes)
    m["corloc_before_nearest"] = evaluate_corloc(bundle, base, test, proto, nearest=True)[0]
    n_best = setup.search_samples + 1
    if setup.search_samples > 0:
        m[f"corloc_before_best{n_best}"] = evaluate_corloc(bundle, base, test, proto, samples=setup.search_samples,
                                                           seed=seed)[0]
    if setup.baselines:
        k = min(setup.ranking_images, len(test))
        cands = rect_candidates(bundle, sides=7, stride=bundle.config.input.size // 10)
        m["corloc_ranking"] = corloc(ranking(bundle, test.subset(torch.arange(k)), proto, cands, batch=1, chunk=1024),
                                     test.boxes[:k])
        m["ranking_images"], m["ranking_candidates"] = k, len(cands)
        # the fine-tune baseline runs the backbone on the exemplar images itself, as it always has
        ft = finetune(bundle, LabeledImages(ex.images, ex.boxes), proto, setup.finetune_iterations, setup.finetune,
                      seed=seed)
        m["corloc_finetune"] = evaluate_corloc(bundle, bundle.new_agent(ft), test, proto)[0]
    t0 = time.perf_counter()
    res = adapt(bundle, proto, unl.images, replace(setup.adapt, seed=seed),
                device=next(bundle.embedder.parameters()).device)
    m["adapt_seconds"] = round(time.perf_counter() - t0, 2)
    adapted = bundle.new_agent(res.agent_state)
    traj_after = localize_boxes(bundle, adapted, test, proto)
    m["corloc_after"] = corloc(traj_after[-1], test.boxes)
    m["corloc_after_nearest"] = evaluate_corloc(bundle, adapted, test, proto, nearest=True)[0]
    if setup.baselines:
        m["corloc_after_ranking_subset"] = corloc(traj_after[-1][:k], test.boxes[:k])
    if setup.search_samples > 0:
        best_after = localize_boxes(bundle, adapted, test, proto, samples=setup.search_samples, seed=seed)[-1]
        m[f"corloc_after_best{n_best}"] = corloc(best_after, test.boxes)
        if setup.baselines:
            m[f"corloc_after_best{n_best}_ranking_subset"] = corloc(best_after[:k], test.boxes[:k])
    return m, {"test": test, "prototype": proto, "agent_state": res.agent_state,
               "trajectory_before": traj_before, "trajectory_after": traj_after}


# ---------------------------------------------------------------- speed

@torch.no_grad()
def measure_speed(bundle: Bundle, images01: Tensor, prototype: Tensor, batch_sizes: tuple[int, ...] = (1, 16),
                  repeats: int = 5, nearest: bool | None = None) -> dict[str, float]:
    """Images/s of a whole greedy localization (backbone once + ``steps`` RoI/head/agent steps) and of
    the backbone alone, measured alternately in the same process (median over ``repeats`` calls, after
    one warm-up each; the CPU is shared, so medians resist the other jobs' bursts). ``nearest``: the answer
    rule (``None``: the bundle's default)."""
    loc = Localizer(bundle, device=next(bundle.embedder.parameters()).device)
    agent = loc.agent()
    out: dict[str, float] = {"threads": torch.get_num_threads()}
    for bs in batch_sizes:
        x = images01[:bs]
        if len(x) < bs:
            raise ValueError(f"measure_speed needs at least {bs} images, got {len(images01)}")
        full, backbone = [], []
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            loc.run(x, prototype, agent, nearest=nearest).boxes[-1].cpu()  # waits for the device, as a client would
            t1 = time.perf_counter()
            loc.embedder.features(normalize(x.to(loc.device), loc.spec)).cpu()
            t2 = time.perf_counter()
            if r:  # the first round warms up
                full.append(t1 - t0)
                backbone.append(t2 - t1)
        out[f"localize_images_per_s_batch{bs}"] = round(bs / statistics.median(full), 2)
        out[f"backbone_images_per_s_batch{bs}"] = round(bs / statistics.median(backbone), 2)
    return out


# ---------------------------------------------------------------- summaries

METRIC_KEYS = ("ordacc", "ordacc_inst", "spearman", "corloc_before", "corloc_after", "corloc_ranking",
               "corloc_after_ranking_subset", "corloc_finetune", "corloc_before_nearest", "corloc_after_nearest",
               "adapt_seconds")
SEARCH_PREFIXES = ("corloc_before_best", "corloc_after_best")


def mean_std(xs: list[float]) -> dict[str, float]:
    return {"mean": round(statistics.fmean(xs), 3), "std": round(statistics.stdev(xs), 3) if len(xs) > 1 else 0.0,
            "n": len(xs)}


def summarize(rows: list[dict], train_class: str) -> dict:
    """Per class mean/std over seeds, and the mean over the *new* classes (each seed's mean, then mean/std)."""
    keys = [k for k in METRIC_KEYS if k in rows[0]] + [k for k in rows[0] if k.startswith(SEARCH_PREFIXES)]
    out: dict = {}
    for c in dict.fromkeys(r["class"] for r in rows):
        sel = [r for r in rows if r["class"] == c]
        out[c] = {k: mean_std([r[k] for r in sel]) for k in keys}
    seeds = sorted({r["seed"] for r in rows})
    new = [r for r in rows if r["class"] != train_class]
    if new:
        out["mean_new_classes"] = {k: mean_std([statistics.fmean([r[k] for r in new if r["seed"] == s])
                                                for s in seeds]) for k in keys}
    return out


# ---------------------------------------------------------------- command line (wired into ``models.cli``)

def add_photo_arguments(sp: Any, reproduce: bool) -> None:
    """The options of ``qloc photo-train`` / ``qloc photo-reproduce`` (defaults = the benchmark's)."""
    from models.data import photo_cache_dir

    d = PhotoTrainSetup()
    sp.add_argument("--cache", default=str(photo_cache_dir()), help="photo cache holding manifest.json (fetch-photos)")
    sp.add_argument("--feature-cache", help="keep backbone features here between runs (tuning only)")
    sp.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (on a shared 2-core VM one thread ran ~10x faster than two)")
    sp.add_argument("--class", dest="class_name", default=d.class_name, help="the training class")
    sp.add_argument("--size", type=int, default=d.size, help="network input side (multiple of 16)")
    sp.add_argument("--n-train", type=int, default=d.n_train)
    sp.add_argument("--n-val", type=int, default=d.n_val)
    sp.add_argument("--anchor", default=d.anchor, choices=EMBEDDING_ANCHORS)
    sp.add_argument("--epochs", type=int, default=d.embedding.epochs)
    sp.add_argument("--batch-size", type=int, default=d.embedding.batch_size, help="stage-1 images per step")
    sp.add_argument("--pairs", type=int, default=d.embedding.pairs_per_image, help="stage-1 box pairs per image")
    sp.add_argument("--lr", type=float, default=d.embedding.lr, help="stage-1 learning rate")
    sp.add_argument("--agent-iterations", type=int, default=d.agent.iterations)
    sp.add_argument("--agent-batch-size", type=int, default=d.agent.batch_size)
    sp.add_argument("--agent-lr", type=float, default=d.agent.lr)
    sp.add_argument("--entropy-coef", type=float, default=d.agent.entropy_coef)
    sp.add_argument("--agent-restarts", type=int, default=d.agent_restarts,
                    help="stage-2 runs per seed; the best by validation CorLoc is kept")
    sp.add_argument("--agent-episodes", type=int, default=d.agent.episodes,
                    help="stage-2 episodes per image and iteration (> 1: per-image baseline)")
    sp.add_argument("--use-prototype", action=argparse.BooleanOptionalAction, default=d.use_prototype,
                    help="feed the agent the direction from the current box's embedding to the prototype")
    if not reproduce:
        sp.add_argument("--name", help="bundle name (default: the output file's stem)")
        sp.add_argument("--out", required=True, help="bundle file to write (float16 weights); a .json goes beside it")
        return
    t = PhotoTransferSetup("")
    sp.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    sp.add_argument("--classes", nargs="+", default=list(PHOTO_CLASSES))
    sp.add_argument("--unlabeled", type=int, default=t.unlabeled)
    sp.add_argument("--n-test", type=int, default=t.test)
    sp.add_argument("--ranking-images", type=int, default=t.ranking_images)
    sp.add_argument("--samples", type=int, default=t.search_samples,
                    help="also report the best-of-(1 + N) search: greedy + N sampled episodes (0: off)")
    sp.add_argument("--finetune-iterations", type=int, default=t.finetune_iterations)
    sp.add_argument("--adapt-iterations", type=int, default=t.adapt.iterations)
    sp.add_argument("--adapt-batch-size", type=int, default=t.adapt.batch_size)
    sp.add_argument("--adapt-lr", type=float, default=t.adapt.lr)
    sp.add_argument("--adapt-kl-coef", type=float, default=t.adapt.kl_coef,
                    help="adaptation's KL(policy || starting policy) weight per step (0: off)")
    sp.add_argument("--adapt-episodes", type=int, default=t.adapt.episodes,
                    help="adaptation episodes per image and iteration (> 1: per-image baseline)")
    sp.add_argument("--speed-repeats", type=int, default=5)
    sp.add_argument("--reuse", help="take seed S's stages 1-2 from REUSE/seedS/bundle.pt (an earlier run's, float16 "
                                    "weights) instead of training; the training options are then ignored")
    sp.add_argument("--out", default="runs/photo")


def _setup_from_args(a: Any) -> PhotoTrainSetup:
    s = PhotoTrainSetup(class_name=a.class_name, size=a.size, n_train=a.n_train, n_val=a.n_val, anchor=a.anchor,
                        use_prototype=a.use_prototype, agent_restarts=a.agent_restarts)
    e = s.embedding
    e.epochs, e.batch_size, e.pairs_per_image, e.lr = a.epochs, a.batch_size, a.pairs, a.lr
    e.eval_every = max(1, min(e.eval_every, a.epochs))
    g = s.agent
    g.iterations, g.batch_size, g.lr = a.agent_iterations, a.agent_batch_size, a.agent_lr
    g.entropy_coef, g.episodes = a.entropy_coef, a.agent_episodes
    g.eval_every = max(1, min(g.eval_every, a.agent_iterations))
    return s


def _command_line(name: str, a: Any) -> str:
    """The command with every option spelled out (defaults included), so it reruns the same way."""
    skip = {"command", "func", "metrics"}
    parts = [f"qloc {name}"]
    for k, v in vars(a).items():
        if k in skip or v is None:
            continue
        flag = "--" + ("class" if k == "class_name" else k.replace("_", "-"))
        if k in ("cache", "feature_cache", "out"):
            v = _relative(v)
        if isinstance(v, bool):
            parts.append(flag if v else f"--no-{flag[2:]}")
        elif isinstance(v, list):
            parts.append(f"{flag} {' '.join(map(str, v))}")
        else:
            parts.append(f"{flag} {v}")
    return " ".join(parts)


def _relative(path: str) -> str:
    """``path`` relative to the working directory when it lies below it (no absolute paths in provenance)."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _environment() -> dict[str, Any]:
    import os
    import platform

    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def _device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type


def _printer(prefix: str) -> Callable[[str, dict], None]:
    import sys

    def log(stage: str, rec: dict) -> None:
        vals = {k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()}
        print(f"{prefix}{stage} {json.dumps(vals)}", file=sys.stderr, flush=True)
    return log


def photo_train_command(a: Any) -> dict:
    """``qloc photo-train``: stages 1-2 on one class -> the bundle (float16) and a JSON beside it."""
    from models.bundle import save_bundle
    from models.data.photos import load_manifest
    from models.inference import resolve_device
    from models.plots import training_curves

    manifest = load_manifest(a.cache)
    out = Path(a.out)
    setup = _setup_from_args(a)
    t0 = time.perf_counter()
    bundle = train_photo_bundle(a.name or out.stem, manifest, setup, a.seed, FeatureCache(a.feature_cache),
                                log=_printer(""), device=resolve_device(a.device))
    bundle.provenance["command"] = _command_line("photo-train", a)
    sha = save_bundle(out, bundle, half=True)
    training_curves(bundle.provenance["history"], out.with_suffix(".curves.png"))
    info = {"bundle": str(out), "sha256": sha, "bytes": out.stat().st_size, "name": bundle.name,
            "command": bundle.provenance["command"], "environment": _environment(),
            "seconds": round(time.perf_counter() - t0, 1), "config": bundle.config.to_dict(),
            "setup": bundle.provenance["setup"], "data": bundle.provenance["data"],
            "metrics": {"val/ordacc": bundle.provenance["embedding"]["val/ordacc"],
                        "best_epoch": bundle.provenance["embedding"]["best_epoch"],
                        "val/corloc": bundle.provenance["agent"]["val/corloc"],
                        "best_iteration": bundle.provenance["agent"]["best_iteration"],
                        "restart": bundle.provenance["agent"]["restart"],
                        "restarts_val_corloc": bundle.provenance["agent"]["restarts_val_corloc"]},
            "stage_seconds": bundle.provenance["seconds"]}
    out.with_suffix(".json").write_text(json.dumps(info, indent=2) + "\n")
    return {k: info[k] for k in ("bundle", "bytes", "metrics", "seconds")}


def photo_reproduce_command(a: Any) -> dict:
    """``qloc photo-reproduce``: for each seed train on one class, transfer to every class; metrics.json,
    search-path PNGs and the speed numbers under ``--out``."""
    from models.bundle import load_bundle, save_bundle
    from models.data.photos import load_manifest
    from models.inference import resolve_device
    from models.plots import search_paths, training_curves

    manifest = load_manifest(a.cache)
    out_dir = Path(a.out)
    cache = FeatureCache(a.feature_cache)
    t_start = time.perf_counter()
    rows: list[dict] = []
    train_info: dict[str, Any] = {}
    speed_input: tuple[Bundle, Tensor, Tensor] | None = None
    for seed in a.seeds:
        torch.manual_seed(seed)
        setup = _setup_from_args(a)
        t0 = time.perf_counter()
        reused = Path(a.reuse) / f"seed{seed}" / "bundle.pt" if a.reuse else None
        if reused is not None:
            bundle = load_bundle(reused, resolve_device(a.device))
            if bundle.provenance.get("seed") != seed or bundle.provenance["setup"]["class_name"] != a.class_name:
                raise ValueError(f"{reused} was not trained on {a.class_name} with seed {seed}")
        else:
            bundle = train_photo_bundle(f"photo-{setup.class_name}", manifest, setup, seed, cache,
                                        log=_printer(f"seed {seed} "), device=resolve_device(a.device))
        prov = bundle.provenance
        train_info[str(seed)] = {"seconds": round(time.perf_counter() - t0, 1), **prov["seconds"],
                                 "val/ordacc": prov["embedding"]["val/ordacc"],
                                 "val/corloc": prov["agent"]["val/corloc"],
                                 "val/corloc_restarts": prov["agent"].get("restarts_val_corloc"),
                                 "reused": None if reused is None else _relative(str(reused))}
        if reused is None:
            save_bundle(out_dir / f"seed{seed}" / "bundle.pt", bundle, half=True)
        training_curves(prov["history"], out_dir / f"seed{seed}" / "curves.png")
        for c in a.classes:
            ts = PhotoTransferSetup(c, unlabeled=a.unlabeled, test=a.n_test, ranking_images=a.ranking_images,
                                    finetune_iterations=a.finetune_iterations, search_samples=a.samples,
                                    adapt=AdaptConfig(iterations=a.adapt_iterations, batch_size=a.adapt_batch_size,
                                                      lr=a.adapt_lr, entropy_coef=a.entropy_coef,
                                                      kl_coef=a.adapt_kl_coef, episodes=a.adapt_episodes))
            m, art = photo_transfer(bundle, manifest, ts, seed, cache)
            rows.append(m)
            _printer(f"seed {seed} ")("transfer", m)
            k = min(12, len(art["test"]))
            for tag in ("before", "after"):
                search_paths(art["test"].images[:k], art[f"trajectory_{tag}"][:, :k].cpu(), art["test"].boxes[:k],
                             out_dir / f"seed{seed}" / f"paths_{c}_{tag}.png", cols=6,
                             title=f"{c} {tag} adaptation: CorLoc {m[f'corloc_{tag}']:.1f} (train {setup.class_name})")
            if speed_input is None:
                speed_input = (bundle, art["test"].images, art["prototype"])
    bs = (1, 16)
    b, imgs, proto = speed_input
    imgs = imgs.repeat((16 + len(imgs) - 1) // len(imgs), 1, 1, 1)
    speed = measure_speed(b, imgs, proto, batch_sizes=bs, repeats=a.speed_repeats)
    adapt_s = [r["adapt_seconds"] for r in rows]
    speed["adapt_seconds_mean"] = round(statistics.fmean(adapt_s), 2)
    result = {"command": _command_line("photo-reproduce", a),
              "environment": {**_environment(), "device": _device_name(resolve_device(a.device))},
              "wall_seconds": round(time.perf_counter() - t_start, 1), "train_class": a.class_name,
              "seeds": a.seeds, "train": train_info, "rows": rows, "summary": summarize(rows, a.class_name),
              "speed": speed}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").write_text(json.dumps(result, indent=2) + "\n")
    return {"summary": result["summary"], "speed": speed, "wall_seconds": result["wall_seconds"],
            "metrics": str(out_dir / "metrics.json")}
