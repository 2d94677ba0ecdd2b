"""The cMNIST protocols of PAPER.md: train on one digit, transfer to new digits or backgrounds.

Data discipline: training and validation images come from MNIST's training file (disjoint fixed
parts), test images from its test file; exemplars and unlabeled adaptation images of a new digit
come from the training file, disjoint from each other. Model selection looks at validation only;
adaptation runs a fixed budget (it has no labels to select with).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from models.adapt import AdaptConfig, adapt
from models.bundle import Bundle, new_bundle
from models.config import ModelConfig
from models.core.metrics import corloc
from models.data.cmnist import CMnistSpec, generate
from models.data.types import LabeledImages, exemplar_crops
from models.evaluate import evaluate_corloc, ordacc_all, ranking
from models.experiments.baselines import finetune
from models.inference import Localizer
from models.presets import mnist_config
from models.train.agent import AgentTrainConfig, train_agent
from models.train.embedding import EmbeddingTrainConfig, train_embedding


def cmnist(digit: int, split: str, n: int, background: str = "patch", seed: int = 0, offset: int = 0
           ) -> LabeledImages:
    b = generate(CMnistSpec(digit, split, n, background, seed, offset=offset))
    return LabeledImages(b.images, b.boxes)


@dataclass
class TrainSetup:
    digit: int = 4
    background: str = "patch"
    n_train: int = 50
    n_val: int = 200
    exemplars: int = 5
    embedding: EmbeddingTrainConfig = field(default_factory=lambda: EmbeddingTrainConfig(epochs=100, eval_every=20))
    agent: AgentTrainConfig = field(default_factory=lambda: AgentTrainConfig(iterations=300, eval_every=25))


def train_bundle(name: str, setup: TrainSetup, seed: int, device: torch.device,
                 config: ModelConfig | None = None, log: Callable[[str, dict], None] | None = None) -> Bundle:
    """Stages 1 and 2 on ``setup.n_train`` images of one digit -> a trained bundle with provenance."""
    train = cmnist(setup.digit, "train", setup.n_train, setup.background, seed)
    val = cmnist(setup.digit, "val", setup.n_val, setup.background, seed)
    val_ex = cmnist(setup.digit, "val", setup.exemplars, setup.background, seed, offset=setup.n_val)
    bundle = new_bundle(name, config or mnist_config(), seed)
    bundle.to(device)
    t0 = time.perf_counter()
    s1 = train_embedding(bundle, train, val, replace(setup.embedding, seed=seed),
                         on_log=lambda r: log and log("embedding", r))
    t1 = time.perf_counter()
    s2 = train_agent(bundle, train, val, val_ex, replace(setup.agent, seed=seed),
                     on_log=lambda r: log and log("agent", r))
    t2 = time.perf_counter()
    bundle.provenance = {
        "data": f"cMNIST digit {setup.digit}, {setup.background} background, {setup.n_train} training images "
                f"(MNIST train file), validation {setup.n_val} (disjoint part of the train file)",
        "seed": seed, "embedding": {k: v for k, v in s1.items() if k != "history"},
        "agent": {k: v for k, v in s2.items() if k != "history"},
        "seconds": {"embedding": round(t1 - t0, 1), "agent": round(t2 - t1, 1)},
        "history": {"embedding": s1["history"], "agent": s2["history"]},
    }
    return bundle


@dataclass
class TransferSetup:
    digit: int
    background: str = "patch"
    exemplars: int = 5
    unlabeled: int = 500
    test: int = 500
    ranking_images: int = 100
    finetune_iterations: int = 100
    adapt: AdaptConfig = field(default_factory=lambda: AdaptConfig(iterations=100, batch_size=64))
    baselines: bool = True
    sampled: bool = True
    search_samples: int = 15
    """Also report the best-of-(1 + this) search (greedy + sampled episodes, nearest final box kept); 0: off."""


def transfer(bundle: Bundle, setup: TransferSetup, seed: int) -> tuple[dict, dict]:
    """Evaluate ``bundle`` on a new digit / background before and after adaptation -> (metrics, artifacts)."""
    loc = Localizer(bundle, device=bundle.device)
    d, bg = setup.digit, setup.background
    # Exemplars and unlabeled images: one draw of the train file, disjoint slices (offset).
    ex = cmnist(d, "train", setup.exemplars, bg, seed + 1000)
    unl = cmnist(d, "train", setup.unlabeled, bg, seed + 1000, offset=setup.exemplars)
    test = cmnist(d, "test", setup.test, bg, seed)
    proto = loc.prototype(exemplar_crops(ex))
    base = bundle.new_agent()
    m: dict = {"digit": d, "background": bg, "seed": seed}
    acc = ordacc_all(bundle, test, ("proto", "inst"), seed=seed)
    m["ordacc_proto"], m["ordacc_inst"] = acc["proto"], acc["inst"]
    m["corloc_before"], boxes_before = evaluate_corloc(bundle, base, test, proto)
    if setup.sampled:
        m["corloc_before_sampled"], _ = evaluate_corloc(bundle, base, test, proto, deterministic=False, seed=seed)
    n_best = setup.search_samples + 1
    if setup.search_samples > 0:
        m[f"corloc_before_best{n_best}"], _ = evaluate_corloc(bundle, base, test, proto, seed=seed,
                                                             samples=setup.search_samples)
    if setup.baselines:
        k = min(setup.ranking_images, len(test.images))
        m["corloc_ranking"] = corloc(ranking(bundle, test.subset(torch.arange(k)), proto), test.boxes[:k])
        ft = finetune(bundle, ex, proto, setup.finetune_iterations, seed=seed)
        m["corloc_finetune"], _ = evaluate_corloc(bundle, bundle.new_agent(ft), test, proto)
    t0 = time.perf_counter()
    res = adapt(bundle, proto, unl.images, replace(setup.adapt, seed=seed), device=loc.device)
    m["adapt_seconds"] = round(time.perf_counter() - t0, 2)
    adapted = bundle.new_agent(res.agent_state)
    m["corloc_after"], boxes_after = evaluate_corloc(bundle, adapted, test, proto)
    if setup.sampled:
        m["corloc_after_sampled"], _ = evaluate_corloc(bundle, adapted, test, proto, deterministic=False, seed=seed)
    if setup.search_samples > 0:
        m[f"corloc_after_best{n_best}"], _ = evaluate_corloc(bundle, adapted, test, proto, seed=seed,
                                                            samples=setup.search_samples)
    return m, {"test": test, "prototype": proto, "agent_state": res.agent_state,
               "boxes_before": boxes_before, "boxes_after": boxes_after}
