"""Reward repair at test time: the projection head learns to order boxes on the client's own images.

The reward of adaptation is the embedding distance to the exemplars' prototype. On objects the bundle
was not trained on, that distance may not order boxes by their overlap with the object (BENCHMARKS.md,
new kinds: OrdAcc ~75 on glyphs against ~97 on digits), and a policy adapted on it gets worse. Repair
trains the projection head alone -- never the backbone -- with stage 1's ordinal loss
(``models.train.embedding.train_embedding``, one call) on probes: the client's exemplar crops pasted into
its own unlabeled images (``models.guard.synthetic_probes``), whose boxes are known. The anchor is the
pasted crops' exemplar embedding (``shuffle_exemplar``), as a prototype is made at serving time.

The change is kept only when probes it did not train on say the ordering improved: OrdAcc up by more
than ``min_gain`` points and Spearman (distance against IoU) more negative. Otherwise the bundle's own
head and prototype stay, and the job adapts the policy on the original reward, guarded as before.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from models.bundle import Bundle
from models.data.types import LabeledImages
from models.evaluate import ranking, ranking_metrics, training_candidates
from models.features import with_features
from models.guard import Guard, GuardConfig, synthetic_probes
from models.inference import Localizer, exemplar_canvas
from models.train.embedding import EmbeddingTrainConfig, train_embedding

MIN_TRAIN_PROBES = 16
"""Fewer training probes than this: no repair (its shuffled-group anchor needs two groups per batch, and so few
probes would not say much)."""


@dataclass
class RepairConfig:
    epochs: int = 30
    lr: float = 1e-3
    batch_size: int = 32
    min_gain: float = 2.0
    """OrdAcc points on the validation probes the repaired head must gain to be kept."""
    seed: int = 0


@dataclass
class Repair:
    kept: bool
    bundle: Bundle
    """The bundle whose head is the repaired one when ``kept`` (a copy; the input bundle is left as it was),
    else the input bundle itself."""
    prototype: Tensor
    """``[D]``: the exemplars' prototype under ``bundle``'s head (as ``Localizer.prototype`` makes it)."""
    record: dict[str, Any]
    """What a job reports: ``before`` / ``after`` (OrdAcc, Spearman on the validation probes), ``kept``,
    ``best_epoch``, ``seconds``."""

    @property
    def head(self) -> dict[str, Tensor] | None:
        """The repaired head's state (on the CPU) when kept, else ``None``."""
        if not self.kept:
            return None
        return {k: v.detach().cpu().clone() for k, v in self.bundle.embedder.head.state_dict().items()}


def faithfulness(bundle: Bundle, prototype: Tensor, probes: LabeledImages, seed: int = 0) -> dict[str, float]:
    """How well the distance to ``prototype`` orders boxes by IoU on ``probes``: OrdAcc (%) and Spearman."""
    m = ranking_metrics(bundle, probes, prototype, seed=seed, candidates=training_candidates(bundle))
    return {"ordacc": round(float(m["ordacc"]), 2), "spearman": round(float(m["spearman"]), 4)}


def repair_reward(bundle: Bundle, crops: list[Tensor], train: LabeledImages, val: LabeledImages,
                  cfg: RepairConfig | None = None) -> Repair:
    """Train a copy of ``bundle``'s head on the probes ``train``, choose its epoch and decide on ``val``.

    ``crops``: the exemplar crops ``[C, h, w]`` in [0, 1] (the set's); ``train`` / ``val``: labeled probes at
    the bundle's input size, disjoint. Returns the ``Repair`` (the repaired copy only if kept)."""
    cfg = cfg or RepairConfig()
    if len(train) < MIN_TRAIN_PROBES or len(val) < 2:
        raise ValueError(f"reward repair needs at least {MIN_TRAIN_PROBES} training probes and 2 validation probes, "
                         f"got {len(train)} and {len(val)}")
    t0 = time.perf_counter()
    loc = Localizer(bundle, bundle.device)
    proto = loc.prototype(crops).to(bundle.device)
    val = with_features(bundle, val)
    before = faithfulness(bundle, proto, val, cfg.seed)
    repaired = copy.deepcopy(bundle)
    canvases, boxes = exemplar_canvas(crops, bundle.config.input)
    exemplars = LabeledImages(canvases, boxes)
    batch = min(cfg.batch_size, len(train))
    ecfg = EmbeddingTrainConfig(epochs=cfg.epochs, batch_size=batch, drop_last=True, lr=cfg.lr,
                                anchor="shuffle_exemplar", group_size=min(5, batch // 2), recon_weight=0.0,
                                head_only=True, eval_every=max(1, cfg.epochs // 6), seed=cfg.seed)
    summary = train_embedding(repaired, with_features(repaired, train, crops=True), val, ecfg,
                              val_exemplars=exemplars)
    new_proto = Localizer(repaired, repaired.device).prototype(crops).to(repaired.device)
    after = faithfulness(repaired, new_proto, val, cfg.seed)
    kept = after["ordacc"] - before["ordacc"] > cfg.min_gain and after["spearman"] < before["spearman"]
    record = {"kept": kept, "before": before, "after": after, "best_epoch": summary["best_epoch"],
              "epochs": cfg.epochs, "train_probes": len(train), "val_probes": len(val),
              "seconds": round(time.perf_counter() - t0, 2)}
    if kept:
        return Repair(True, repaired, new_proto.cpu(), record)
    return Repair(False, bundle, proto.cpu(), record)


@dataclass
class Guarded:
    """What an adaptation job runs with: the reward (the bundle's own, or repaired) and the guard that decides."""

    bundle: Bundle
    """Adapt and serve with this bundle (the input one, or the repaired copy)."""
    prototype: Tensor
    guard: Guard
    repair: Repair | None
    """``None`` when repair was not asked for, or the job has fewer than ``MIN_TRAIN_PROBES`` synthetic probes."""

    @property
    def reward(self) -> str:
        """Which reward the job adapts on: ``"repaired head"`` or ``"bundle head"``."""
        return "repaired head" if self.repair is not None and self.repair.kept else "bundle head"

    @property
    def record(self) -> dict[str, Any]:
        return {"reward": self.reward, "repair": None if self.repair is None else self.repair.record}


def guarded_setup(bundle: Bundle, prototype: Tensor, crops: list[Tensor], images01: Tensor,
                  agent_state: dict[str, Tensor] | None, *, synthetic: int, generator_seed: int,
                  labeled: LabeledImages | None = None, repair: RepairConfig | None = None,
                  guard_cfg: GuardConfig | None = None) -> Guarded:
    """The reward and the guard of one adaptation job on ``images01 [N, C, S, S]``, the starting policy scored.

    With ``repair``: the head learns on ``synthetic`` probes (the starting policy's answers erased), its epoch
    chosen and its change decided on ``synthetic // 2`` others (``repair_reward``). The guard's probes are
    drawn afterwards, a third set: ``labeled`` examples plus ``synthetic`` pasted crops, erased where the
    kept reward's ranking finds the object (a starting policy that misses it would leave the client's own
    object beside the pasted one, and the probe would call a right answer wrong). Every draw is seeded by
    ``generator_seed``, so a resumed job rebuilds the same reward and probes."""
    def gen(k: int) -> torch.Generator:
        return torch.Generator().manual_seed(generator_seed * 7919 + k)

    rep, erase = None, None
    if repair is not None and synthetic >= MIN_TRAIN_PROBES:
        train = synthetic_probes(bundle, prototype, crops, images01, agent_state, synthetic, gen(1))
        val = synthetic_probes(bundle, prototype, crops, images01, agent_state, max(2, synthetic // 2), gen(2))
        rep = repair_reward(bundle, crops, train, val, replace(repair, seed=generator_seed))
        if rep.kept:
            erase = ranking(rep.bundle, LabeledImages(images01, torch.zeros(len(images01), 4)), rep.prototype)
    parts = [labeled] if labeled is not None and len(labeled) else []
    if synthetic > 0:
        parts.append(synthetic_probes(bundle, prototype, crops, images01, agent_state, synthetic, gen(3), erase))
    probes = LabeledImages(torch.cat([p.images for p in parts]), torch.cat([p.boxes for p in parts]))
    counts = {"labeled": len(labeled) if labeled is not None else 0, "synthetic": synthetic}
    guard = Guard(bundle, prototype, probes, gen(4), cfg=guard_cfg or GuardConfig(), counts=counts)
    guard.start(agent_state)  # with the bundle's own head: what the client is served before the job
    if rep is not None and rep.kept:
        guard.use_reward(rep.bundle, rep.prototype)
        return Guarded(rep.bundle, rep.prototype, guard, rep)
    return Guarded(bundle, prototype, guard, rep)
