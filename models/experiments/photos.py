"""The photo protocol, in the paper's cross-class style: train stages 1-2 on one class of the offline
photos (``models.data.photos``), then localize every other class before and after test-time adaptation.

Data discipline (splits are by *source file*, see ``models.data.photos``): stage 1-2 training images come
from the training class's ``train`` split, model selection from its ``val`` split (never test). For a
target class, the 5 exemplar crops and the unlabeled adaptation images are drawn from that class's
``train`` split (two different draws), the test images from its ``test`` split, so no object photo and
no background of a test image was ever seen, not even unlabeled. Small classes have only 1-2 test
source photos (fish: 2); each generated image still differs (background crop, scale, position, flip,
colour jitter), but their per-class numbers say more about those few photos than about the class.

The backbone is frozen, so each image's feature map is computed once per set (``photo_set`` carries it
in ``LabeledImages.feats``) and reused by every stage and metric: the shared trainers
(``models.train``) and metrics (``models.evaluate``) use carried features instead of re-running the
backbone (~3.5 s per 32 images on one CPU thread, against ~0.35 s for a whole head step). Adaptation
goes through ``models.adapt.adapt``, as the service runs it, so its wall time includes its own backbone
pass. This module holds the protocol only: its data draws, setups and the transfer table.
"""

from __future__ import annotations

import hashlib
import json
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
from models.data.multi import photos_multi
from models.data.photos import PasteParams, generate
from models.data.types import LabeledImages
from models.evaluate import evaluate_corloc, localize_boxes, ranking, ranking_metrics, rect_candidates
from models.experiments.baselines import finetune
from models.features import prototype_of, with_features
from models.policy import PolicyConfig
from models.presets import photo_config
from models.train.agent import AgentTrainConfig, train_agent
from models.train.embedding import EmbeddingTrainConfig, train_embedding

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
            return torch.load(path, weights_only=True).to(bundle.device)
        out = make()
        self.root.mkdir(parents=True, exist_ok=True)
        torch.save(out.cpu(), path)
        return out


DISTRACTOR_OBJECT_SIDE = (0.25, 0.45)
"""Long side of each cut-out when distractors are pasted (``PhotoTrainSetup.distractors``): the single-object
range (0.25-0.6) capped so that the object and a distractor fit side by side (2 x 101 px at 224)."""


def photo_set(bundle: Bundle, manifest: dict[str, Any], class_name: str, split: str, n: int, seed: int,
              crops: bool = False, cache: FeatureCache | None = None, distractors: int = 0) -> LabeledImages:
    """``n`` generated photos of ``class_name`` (``split`` files only) carrying their backbone features;
    ``crops`` also carries each ground-truth crop's exemplar-canvas features (for prototypes).

    ``distractors > 0``: each image also holds ``0..distractors`` cut-outs of other classes beside the object
    (``models.data.multi.photos_multi`` with one instance), so that the box to find depends on the query."""
    size = bundle.config.input.size
    key = f"{class_name}-{split}-{n}-{seed}-{size}"
    if distractors > 0:
        m = photos_multi(manifest, class_name, split, n, seed=seed, size=size, min_instances=1, max_instances=1,
                         distractors=(0, distractors), params=PasteParams(object_side=DISTRACTOR_OBJECT_SIDE))
        b = LabeledImages(m.images, torch.cat(m.boxes))
        key += f"-d{distractors}"
    else:
        b = generate(manifest, class_name, split, n, seed=seed, size=size)
    disk = cache or FeatureCache(None)
    return with_features(bundle, LabeledImages(b.images, b.boxes), crops=crops, batch=32,
                         cache=lambda kind, make: disk.get(bundle, key if kind == "images" else f"{key}-{kind}", make))


# ---------------------------------------------------------------- the protocol

@dataclass
class PhotoTrainSetup:
    """Stages 1-2 on one class (or several, comma-separated: a general bundle, ``n_train`` / ``n_val`` /
    ``exemplars`` per class); the defaults are the benchmark's (tuned on validation only)."""

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
    distractors: int = 0
    """Cut-outs of other classes pasted beside the object in every training and validation image, ``0..distractors``
    each (``photo_set``). Without them the only object of an image is the answer, and an agent learns to find
    *an* object whatever the query (on real photos its box did not change with the exemplars)."""
    agent_restarts: int = 3
    """Stage 2 runs this many times (seeds ``seed + 1000 * r``); the run with the best validation CorLoc is
    kept. One run's result depends a lot on its seed (val CorLoc 61-94 % over three seeds)."""


def class_names(class_name: str) -> list[str]:
    """``"mammals"`` or several classes ``"mammals,birds,fish"`` (a general bundle: ``LabeledImages.concat``)."""
    names = [n.strip() for n in class_name.split(",") if n.strip()]
    if not names:
        raise ValueError("no photo class given")
    return names


def photo_model_config(setup: PhotoTrainSetup) -> ModelConfig:
    """The preset ``photo_config`` with the setup's input size and prototype input."""
    return photo_config(size=setup.size, use_prototype=setup.use_prototype)


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
    bundle.to(device)
    c = setup.class_name
    names = class_names(c)

    def drawn(split: str, n: int, draw_seed: int, crops: bool = False) -> LabeledImages:
        parts = [photo_set(bundle, manifest, name, split, n, draw_seed, crops=crops, cache=cache,
                           distractors=setup.distractors) for name in names]
        return parts[0] if len(parts) == 1 else LabeledImages.concat(parts)

    train = drawn("train", setup.n_train, seed, crops=True)
    val = drawn("val", setup.n_val, seed)
    val_ex = drawn("val", setup.exemplars, seed + 500, crops=True)
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
                f"train split, validation {setup.n_val} + {setup.exemplars} exemplars from the val split"
                + (" (each, per class; each image anchored on its own class's exemplars)" if len(names) > 1 else ""),
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
                device=bundle.device)
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
