"""The guard of an adaptation: the starting policy and every checkpoint are scored on labeled probes
(``models.data.probes``, and the set's labeled examples), so a job can tell -- without asking the user
for anything -- whether adapting made its answers better, and activate a checkpoint only then.

The probes are split once, at random: the *selection* half chooses the best checkpoint and decides;
the *held-out* half is not used to choose, so it can confirm the choice without flattering it. A
checkpoint is activated under ``activate=auto`` only when its selection CorLoc beats the start by more
than twice the standard error of the paired difference (each probe scored by both policies, and at
least one probe), *and* its held-out CorLoc beats the start's by as much (twice the standard error there):
chosen on one half, confirmed on the other. On photos, pasted crops favour policies that test images do
not (BENCHMARKS.md): confirmation at one standard error still let a worse checkpoint through, and on real
photographs even this rule did -- so for RGB bundles the set's labeled examples must confirm it as well
(``GuardConfig.synthetic_confirms``): without them, a photo job reports its verdict and activates nothing.
Since the eighth session of 2026-11-27 they must confirm it the way the probes do, beyond their own noise
(``GuardConfig.labeled_rule``): "at least as many right" let through photo jobs that ended 7.5 and 1.5 points below
their start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from models.bundle import Bundle
from models.companion import Companion
from models.core.boxes import paired_iou
from models.data.probes import PROBE_STYLES, erase_boxes, fill_boxes, paste_probes
from models.data.types import LabeledImages
from models.evaluate import ranking_metrics, training_candidates
from models.features import features_of
from models.inference import Localizer
from models.nets.agent import Agent

VERDICTS = ("improved", "no better", "worse", "reward unreliable")
PICKS = ("best", "confirmed")
PROBE_SCALE = (0.6, 1.2)
"""Pasted crops' long side, as a factor of the bundle's ``exemplar_size`` (the scale its agent sees objects)."""
ACTIVATE_MODES = ("auto", "true", "false")
LABELED_RULES = ("beyond_noise", "agree")


def synthetic_probes(bundle: Bundle, prototype: Tensor, crops: list[Tensor], images01: Tensor,
                     agent_state: dict[str, Tensor] | None, n: int, generator: torch.Generator,
                     erase: Tensor | None = None, style: str = "rect") -> LabeledImages:
    """``n`` probes from a job's exemplar ``crops`` and unlabeled ``images01 [N, C, S, S]``: where the starting
    policy answers in each image (or the boxes ``erase [N, 4]``: where a better reward finds the object) is
    covered with the same region of another image (so a probe holds one object, the pasted one, as far as
    that policy can tell), then a crop is pasted at a random place and scale (``PROBE_SCALE``) with soft
    edges (``models.data.probes``; ``style``: ``PROBE_STYLES``, ``rect``: as described, ``soft``: the answer
    covered by a smooth fill from around it, the crop pasted as its inscribed ellipse)."""
    with torch.no_grad():
        if style not in PROBE_STYLES:
            raise ValueError(f"probe style must be one of {PROBE_STYLES}, got {style!r}")
        if erase is None:
            loc = Localizer(bundle, bundle.device)
            erase = torch.cat([loc.run(images01[i:i + 256], prototype, loc.agent(agent_state)).boxes[-1].cpu()
                               for i in range(0, len(images01), 256)])
        backgrounds = erase_boxes(images01, erase, generator) if style == "rect" else fill_boxes(images01, erase)
        return paste_probes(crops, backgrounds, n, object_side=bundle.config.input.exemplar_size, scale=PROBE_SCALE,
                            generator=generator, shape="rect" if style == "rect" else "ellipse")


@dataclass
class GuardConfig:
    select_fraction: float = 0.5
    """Share of the probes that choose and decide; the rest are held out and only report."""
    patience: int = 2
    """Stop early after this many checkpoints in a row below the best so far by more than the noise (0: never)."""
    min_faithfulness: float = 0.3
    """The reward is called unreliable when -Spearman(distance to the prototype, IoU) on the probes is
    below this: the embedding barely orders boxes by overlap, so the reward cannot be trusted."""
    pick: str = "confirmed"
    """Which checkpoint ``activate=auto`` may take. ``best``: the best on the selection half, activated only if
    the held-out half confirms it. ``confirmed`` (the default since 2026-11-27): if that one is not confirmed,
    the best on the selection half among those the held-out half confirms (each still above the noise on both
    halves). Measured against ``best`` on the same jobs (``Guard.decide(pick=...)``;
    benchmarks/guarded_adaptation.py): the two differ in 3 of 75 jobs, each time ``confirmed`` higher (new kinds
    of objects, new digits), and never on photos (BENCHMARKS.md, "A general cMNIST bundle", the never-worse check)."""
    synthetic_confirms: bool | None = None
    """Whether pasted (synthetic) probes may confirm an improvement on their own for ``activate=auto``. ``None``:
    for grayscale bundles only (``SYNTHETIC_CONFIRMS_FOR_GRAY``). Otherwise the job activates only when the set's
    labeled examples (real boxes, the first probes) confirm it (``labeled_rule``)."""
    labeled_rule: str = "beyond_noise"
    """How the set's labeled examples confirm a checkpoint where pasted probes may not on their own (RGB bundles).
    ``beyond_noise`` (the default since 2026-11-27's eighth session): its CorLoc on them beats the start's by more
    than twice the standard error of the paired difference, as on the probes -- with 5 labeled examples, 3 more of
    them right and none lost; with 20, 4 more. ``agree`` (the rule before): at least as many right as the start.
    On photos with 5 labeled examples ``agree`` let through jobs that ended up to 7.5 points below their start,
    and no rule on 5 examples told those from real gains (BENCHMARKS.md, "Labeled examples beyond their noise"):
    with this rule no measured photo job activated, with 5 labeled examples or with 20 (never worse, no gain)."""


SYNTHETIC_CONFIRMS_FOR_GRAY = True
"""Pasted probes confirm improvements on their own for grayscale (cMNIST-style) bundles only, where a pasted crop
looks like the images the client sends. On real photographs, with the photo bundle, checkpoints that pasted probes
called better (confirmed on their held-out half) were far worse on the photos: -56 / -33 / -50 points on three of
eight classes (BENCHMARKS.md, real photographs); so an RGB bundle's job needs the set's labeled examples. Served by
consensus (a format-5 start) too: on a held-out photo class a consensus checkpoint the probes confirmed was 8 points
below its start (BENCHMARKS.md, "Consensus of a job's checkpoints")."""


@dataclass
class Guard:
    """Scores policies on ``probes`` with the set's ``prototype`` and keeps the job's record."""

    bundle: Bundle
    prototype: Tensor
    probes: LabeledImages
    generator: torch.Generator
    cfg: GuardConfig = field(default_factory=GuardConfig)
    counts: dict[str, int] = field(default_factory=dict)
    """Where the probes came from (e.g. ``{"labeled": 3, "synthetic": 128}``), reported with them."""

    def __post_init__(self) -> None:
        n = len(self.probes)
        if n < 2:
            raise ValueError(f"the guard needs at least 2 probes, got {n}")
        perm = torch.randperm(n, generator=self.generator)
        k = min(n - 1, max(1, round(n * self.cfg.select_fraction)))
        self.select, self.held = perm[:k].sort().values, perm[k:].sort().values
        self.labeled = torch.arange(min(n, int(self.counts.get("labeled", 0))))  # labeled examples come first
        self.loc = Localizer(self.bundle, self.bundle.device)
        self.feats = features_of(self.bundle, self.probes.images)  # the backbone once; every policy reuses it
        rank = ranking_metrics(self.bundle, LabeledImages(self.probes.images, self.probes.boxes, self.feats),
                               self.prototype, seed=0, candidates=training_candidates(self.bundle))
        self.faithfulness = {"ordacc": round(rank["ordacc"], 2), "spearman": round(rank["spearman"], 4)}
        self.base: dict[str, Any] | None = None
        self.checkpoints: list[dict[str, Any]] = []
        self._base_hits: Tensor | None = None
        self._best: tuple[float, float, int] | None = None  # (select corloc, select iou, index)
        self._falling = 0
        self._voters: list[Agent] | None = None  # the consensus rule's earlier checkpoints (``pair_with``)
        self._scored_by: dict[int, Localizer] = {}

    def served(self, iteration: int) -> Localizer:
        """The localizer checkpoint ``iteration`` was scored with, as localize serves it (its head, paired with the
        start, and under the consensus rule with the checkpoints observed before it)."""
        return self._scored_by[iteration]

    def use_reward(self, bundle: Bundle, prototype: Tensor) -> None:
        """Score the checkpoints observed from now on with ``bundle``'s head and ``prototype`` (a repaired
        reward, ``models.repair``: the backbone, hence the cached features, is the same). The starting policy
        keeps the score it had with the original head; the faithfulness reported becomes the new reward's."""
        self.bundle, self.prototype = bundle, prototype
        self.loc = Localizer(bundle, bundle.device)
        self._voters = None
        rank = ranking_metrics(bundle, LabeledImages(self.probes.images, self.probes.boxes, self.feats), prototype,
                               seed=0, candidates=training_candidates(bundle))
        self.faithfulness = {"ordacc": round(rank["ordacc"], 2), "spearman": round(rank["spearman"], 4)}

    def pair_with(self, companion: Companion | None) -> None:
        """Score the checkpoints observed from now on as localize serves a paired checkpoint: each probe's answer the
        checkpoint's only where both heads prefer it, else ``companion``'s, the job's start as it is served
        (``models.companion.Companion.agree``; ``None``: alone). A companion with ``members`` (the consensus rule,
        format 5) scores each checkpoint in the consensus of the start, the checkpoints observed before it and
        itself, as its file will carry them. Call it after ``use_reward``, which resets it."""
        self.loc = Localizer(self.bundle, self.bundle.device, companion=companion)
        self._voters = None if companion is None or companion.members is None else []

    def _hits(self, agent_state: dict[str, Tensor] | None) -> tuple[Tensor, Tensor]:
        """-> (hit ``[n]`` bool: IoU >= 0.5, IoU ``[n]``) of the greedy answer, as localize serves it."""
        with torch.no_grad():
            agent = self.loc.agent(agent_state)
            boxes = torch.cat([self.loc.run_features(self.feats[i:i + 64], self.prototype, agent).boxes[-1].cpu()
                               for i in range(0, len(self.feats), 64)])
            iou = paired_iou(boxes, self.probes.boxes)
            return iou >= 0.5, iou

    def _summary(self, hits: Tensor, iou: Tensor, idx: Tensor) -> dict[str, float]:
        return {"corloc": round(float(hits[idx].float().mean() * 100), 2),
                "mean_iou": round(float(iou[idx].mean()), 4), "n": len(idx)}

    def _noise(self, hits: Tensor, idx: Tensor | None = None, k: float = 2.0) -> float:
        """``k`` standard errors of the paired CorLoc difference against the start on the probes ``idx``
        (default: the selection half), in points, and at least one probe's worth."""
        idx = self.select if idx is None else idx
        d = (hits[idx].float() - self._base_hits[idx].float())
        n = len(d)
        se = float(d.std(unbiased=True)) / math.sqrt(n) if n > 1 else 1.0
        return round(max(k * se, 1.0 / n) * 100, 2)

    def start(self, agent_state: dict[str, Tensor] | None) -> dict[str, Any]:
        """Score the starting policy -> its record."""
        hits, iou = self._hits(agent_state)
        self._base_hits = hits
        self.base = {"select": self._summary(hits, iou, self.select), "held": self._summary(hits, iou, self.held)}
        if len(self.labeled):
            self.base["labeled"] = self._summary(hits, iou, self.labeled)
        return self.base

    def observe(self, iteration: int, agent_state: dict[str, Tensor]) -> dict[str, Any]:
        """Score a checkpoint -> its record (``select``, ``held``, ``gain``, ``noise``)."""
        if self.base is None:
            raise RuntimeError("call start() with the starting policy first")
        if self._voters is not None:  # the consensus rule: the checkpoints observed before this one vote
            c = self.loc.companion
            self.loc = Localizer(self.bundle, self.bundle.device, companion=replace(c, members=tuple(self._voters)))
        hits, iou = self._hits(agent_state)
        self._scored_by[iteration] = self.loc
        if self._voters is not None:
            self._voters.append(self.loc.agent(agent_state))
        rec = {"iteration": iteration, "select": self._summary(hits, iou, self.select),
               "held": self._summary(hits, iou, self.held)}
        rec["gain"] = round(rec["select"]["corloc"] - self.base["select"]["corloc"], 2)
        rec["noise"] = self._noise(hits)
        rec["held_gain"] = round(rec["held"]["corloc"] - self.base["held"]["corloc"], 2)
        rec["held_noise"] = self._noise(hits, self.held)
        if len(self.labeled):
            rec["labeled"] = self._summary(hits, iou, self.labeled)
            rec["labeled_gain"] = round(rec["labeled"]["corloc"] - self.base["labeled"]["corloc"], 2)
            rec["labeled_noise"] = self._noise(hits, self.labeled)
        self.checkpoints.append(rec)
        key = (rec["select"]["corloc"], rec["select"]["mean_iou"])
        if self._best is None or key > self._best[:2]:
            self._best = (*key, len(self.checkpoints) - 1)
            self._falling = 0
        elif rec["select"]["corloc"] < self._best[0] - rec["noise"]:
            self._falling += 1
        else:
            self._falling = 0
        return rec

    @property
    def should_stop(self) -> bool:
        """Probes kept falling for ``patience`` checkpoints in a row (never with ``patience`` 0)."""
        return self.cfg.patience > 0 and self._falling >= self.cfg.patience

    @property
    def best(self) -> dict[str, Any] | None:
        return None if self._best is None else self.checkpoints[self._best[2]]

    def decide(self, mode: str = "auto", *, pick: str | None = None, labeled_rule: str | None = None,
               synthetic_confirms: bool | None = None) -> dict[str, Any]:
        """The job's verdict and what to activate -> ``{"verdict", "message", "activate": iteration | None,
        "validation": {...}}``. ``mode``: ``auto`` (the best checkpoint, only if it beats the start), ``true``
        (the last checkpoint, whatever the probes say), ``false`` (none). ``pick``: ``GuardConfig.pick`` for
        this call, ``labeled_rule``: ``GuardConfig.labeled_rule`` and ``synthetic_confirms``:
        ``GuardConfig.synthetic_confirms`` (``None``: the config's)."""
        if mode not in ACTIVATE_MODES:
            raise ValueError(f"activate must be one of {ACTIVATE_MODES}, got {mode!r}")
        pick = self.cfg.pick if pick is None else pick
        if pick not in PICKS:
            raise ValueError(f"pick must be one of {PICKS}, got {pick!r}")
        labeled_rule = self.cfg.labeled_rule if labeled_rule is None else labeled_rule
        if labeled_rule not in LABELED_RULES:
            raise ValueError(f"labeled_rule must be one of {LABELED_RULES}, got {labeled_rule!r}")
        best, last = self.best, (self.checkpoints[-1] if self.checkpoints else None)
        base = self.base or {}

        def beats(c: dict[str, Any]) -> bool:  # chosen on the selection half, confirmed on the held-out half
            return c["gain"] > c["noise"] and c["held_gain"] > c["held_noise"]

        improved = best is not None and beats(best)
        if not improved and pick == "confirmed":
            passing = [c for c in self.checkpoints if beats(c)]
            if passing:
                best = max(passing, key=lambda c: (c["select"]["corloc"], c["select"]["mean_iou"]))
                improved = True
        unreliable = -self.faithfulness["spearman"] < self.cfg.min_faithfulness
        if improved:
            verdict = "improved"
            message = (f"probe CorLoc {base['select']['corloc']} -> {best['select']['corloc']} at iteration "
                       f"{best['iteration']} (noise {best['noise']}), confirmed on held-out probes "
                       f"{base['held']['corloc']} -> {best['held']['corloc']} (noise {best['held_noise']})")
        elif unreliable:
            verdict = "reward unreliable"
            message = (f"the embedding barely orders boxes by overlap on the probes (Spearman "
                       f"{self.faithfulness['spearman']}): adaptation's reward cannot be trusted for these "
                       "objects, and no checkpoint beat the starting policy")
        elif last is not None and last["gain"] < -last["noise"]:
            verdict = "worse"
            message = (f"adapting lowered probe CorLoc {base['select']['corloc']} -> {last['select']['corloc']}; "
                       "the starting policy is better")
        else:
            verdict = "no better"
            message = "no checkpoint beat the starting policy on the probes by more than their noise"
        if synthetic_confirms is None:
            synthetic_confirms = self.cfg.synthetic_confirms
        trusted = (synthetic_confirms if synthetic_confirms is not None
                   else SYNTHETIC_CONFIRMS_FOR_GRAY and self.bundle.config.input.channels == 1)
        labeled_ok = len(self.labeled) > 0 and best is not None and (
            best["labeled_gain"] >= 0 if labeled_rule == "agree" else best["labeled_gain"] > best["labeled_noise"])
        confirmed = improved and (trusted or labeled_ok)
        if improved and not confirmed:
            beyond = (f" by more than their noise ({best['labeled_noise']})"
                      if labeled_rule == "beyond_noise" and len(self.labeled) else "")
            message += ("; not activated: pasted probes alone do not predict real photos for this bundle, and "
                        + (f"the set's labeled examples do not confirm it{beyond} (CorLoc "
                           f"{base['labeled']['corloc']} -> {best['labeled']['corloc']} on {len(self.labeled)}; "
                           "more labeled examples make a smaller gain count)" if len(self.labeled) else
                           "the set has no labeled examples to confirm it on (create the set from whole images "
                           "with `boxes`)")
                        + "; activate a checkpoint yourself to use it")
        if mode == "auto":
            activate = best["iteration"] if confirmed else None
        elif mode == "true":
            activate = last["iteration"] if last is not None else None
        else:
            activate = None
        validation = {"probes": {**self.counts, "select": len(self.select), "held": len(self.held),
                                 "synthetic_confirms": trusted, "labeled_rule": labeled_rule},
                      "faithfulness": self.faithfulness, "base": self.base, "best": best,
                      "checkpoints": self.checkpoints, "stopped_early": self.should_stop}
        return {"verdict": verdict, "message": message, "activate": activate, "validation": validation}
