"""``qloc photo-train`` / ``qloc photo-reproduce``: the options of the photo protocol
(``models.experiments.photos``) and the files its commands write."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor

from models.adapt import AdaptConfig
from models.bundle import Bundle, load_bundle, save_bundle
from models.data import photo_cache_dir
from models.data.photos import load_manifest
from models.experiments.photos import (
    PHOTO_CLASSES,
    FeatureCache,
    PhotoTrainSetup,
    PhotoTransferSetup,
    photo_transfer,
    train_photo_bundle,
)
from models.experiments.provenance import command_line, device_name, environment, relative
from models.experiments.report import summarize
from models.experiments.speed import measure_speed
from models.inference import resolve_device
from models.plots import search_paths, training_curves
from models.train.embedding import EMBEDDING_ANCHORS


def add_photo_arguments(sp: Any, reproduce: bool) -> None:
    """The options of ``qloc photo-train`` / ``qloc photo-reproduce`` (defaults = the benchmark's)."""

    d = PhotoTrainSetup()
    sp.add_argument("--cache", default=str(photo_cache_dir()), help="photo cache holding manifest.json (fetch-photos)")
    sp.add_argument("--feature-cache", help="keep backbone features here between runs (tuning only)")
    sp.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (on a shared 2-core VM one thread ran ~10x faster than two)")
    sp.add_argument("--class", dest="class_name", default=d.class_name,
                    help="the training class, or several comma-separated (a general bundle)")
    sp.add_argument("--size", type=int, default=d.size, help="network input side (multiple of 16)")
    sp.add_argument("--n-train", type=int, default=d.n_train)
    sp.add_argument("--n-val", type=int, default=d.n_val)
    sp.add_argument("--anchor", default=d.anchor, choices=EMBEDDING_ANCHORS)
    sp.add_argument("--distractors", type=int, default=d.distractors,
                    help="paste 0..N cut-outs of other classes beside the object in each training image")
    sp.add_argument("--epochs", type=int, default=d.embedding.epochs)
    sp.add_argument("--batch-size", type=int, default=d.embedding.batch_size, help="stage-1 images per step")
    sp.add_argument("--pairs", type=int, default=d.embedding.pairs_per_image, help="stage-1 box pairs per image")
    sp.add_argument("--lr", type=float, default=d.embedding.lr, help="stage-1 learning rate")
    sp.add_argument("--class-weight", type=float, default=d.embedding.class_weight,
                    help="stage-1 cross-kind term (several classes): each box nearer its own class's exemplars")
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
                        use_prototype=a.use_prototype, agent_restarts=a.agent_restarts,
                        distractors=a.distractors)
    e = s.embedding
    e.epochs, e.batch_size, e.pairs_per_image, e.lr = a.epochs, a.batch_size, a.pairs, a.lr
    e.class_weight = a.class_weight
    e.eval_every = max(1, min(e.eval_every, a.epochs))
    g = s.agent
    g.iterations, g.batch_size, g.lr = a.agent_iterations, a.agent_batch_size, a.agent_lr
    g.entropy_coef, g.episodes = a.entropy_coef, a.agent_episodes
    g.eval_every = max(1, min(g.eval_every, a.agent_iterations))
    return s


def _printer(prefix: str) -> Callable[[str, dict], None]:

    def log(stage: str, rec: dict) -> None:
        vals = {k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()}
        print(f"{prefix}{stage} {json.dumps(vals)}", file=sys.stderr, flush=True)
    return log


def photo_train_command(a: Any) -> dict:
    """``qloc photo-train``: stages 1-2 on one class -> the bundle (float16) and a JSON beside it."""

    manifest = load_manifest(a.cache)
    out = Path(a.out)
    setup = _setup_from_args(a)
    t0 = time.perf_counter()
    bundle = train_photo_bundle(a.name or out.stem, manifest, setup, a.seed, FeatureCache(a.feature_cache),
                                log=_printer(""), device=resolve_device(a.device))
    bundle.provenance["command"] = command_line("photo-train", a)
    sha = save_bundle(out, bundle, half=True)
    training_curves(bundle.provenance["history"], out.with_suffix(".curves.png"))
    info = {"bundle": str(out), "sha256": sha, "bytes": out.stat().st_size, "name": bundle.name,
            "command": bundle.provenance["command"], "environment": environment(),
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

    manifest = load_manifest(a.cache)
    out_dir = Path(a.out)
    cache = FeatureCache(a.feature_cache)
    t_start = time.perf_counter()
    rows: list[dict] = []
    train_info: dict[str, Any] = {}
    speed_input: tuple[Bundle, Tensor, Tensor] | None = None
    for seed in a.seeds:
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
                                 "reused": None if reused is None else relative(str(reused))}
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
    result = {"command": command_line("photo-reproduce", a),
              "environment": {**environment(), "device": device_name(resolve_device(a.device))},
              "wall_seconds": round(time.perf_counter() - t_start, 1), "train_class": a.class_name,
              "seeds": a.seeds, "train": train_info, "rows": rows,
              "summary": summarize(rows, "class", leave_out=a.class_name, mean_key="mean_new_classes"),
              "speed": speed}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").write_text(json.dumps(result, indent=2) + "\n")
    return {"summary": result["summary"], "speed": speed, "wall_seconds": result["wall_seconds"],
            "metrics": str(out_dir / "metrics.json")}
