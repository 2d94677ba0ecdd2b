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

**Rewards chosen on the probes** (the second half of this module): the learned embedding distance is one
candidate reward among others that need no training on the target, and an adaptation job adapts the policy on
the one that orders boxes most faithfully on its probes.

Each candidate is a *scorer* (``models.rollout.Scorer``): a distance of a box to the exemplars, lower = more
alike, that ``BoxEnv`` turns into the reward ``dist_before - dist``. The candidates:

- ``embedding``: the embedding distance to the prototype under the job's head (the bundle's, or the repaired one):
  today's reward;
- ``ncc``: ``1 - `` the mean normalized cross-correlation of the box's pixels with the exemplar crops
  (``models.core.templates.box_ncc``: each box read once, resampled to 16 x 16, against 16 x 16 templates); the
  env is then given the batch's pixels;
- ``features``: ``1 - `` the cosine of the box's RoI-pooled frozen backbone features (the RoIAlign the embedder
  runs every step anyway) with the mean of the exemplar crops' RoI features (each crop on its exemplar canvas, as
  its embedding is made).

The choice (``choose_reward``): each candidate's faithfulness -- OrdAcc and Spearman rho of distance against IoU,
on the same sampled box pairs (``scorer_faithfulness``) -- on the job's selection probes (the ones reward repair
chose its epoch on, never the guard's); the most faithful by ``-rho`` is chosen, but another candidate replaces
the current reward only when its ``-rho`` is larger by more than ``margin``.

Serving never changes: localize answers with the agent, and where it ranks boxes (the nearest answer, best-of-N)
it uses the embedding distance under the checkpoint's head (the bundle's, or the repaired one) -- a checkpoint
adapted on ``ncc`` or ``features`` is served with that head and prototype like any other.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from models.bundle import Bundle, Start
from models.companion import feature_distances, start_companion
from models.core.metrics import spearman
from models.core.ordinal import sample_pairs
from models.core.templates import box_ncc, make_templates
from models.data.types import LabeledImages
from models.evaluate import ranking, ranking_metrics, training_candidates
from models.features import features_of, with_features
from models.guard import Guard, GuardConfig, synthetic_probes
from models.inference import Localizer, exemplar_canvas, normalize
from models.nets.embedding import RoIEmbedder
from models.rollout import BoxEnv, EmbeddingDistance, Scorer
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


REFINE_RGB = False
"""Whether a kept repair also refines the answers (``models.refine``) of RGB (photo) bundles. Off: on the photo
held-out classes (5 classes x 3 seeds, 2026-11-27, BENCHMARKS.md "Refined answers") refinement changed the photos'
CorLoc by 0.0 on average (-12.5 to +6.5 per run) but raised the guard's probe scores: every job said ``improved``,
the set's labeled examples agreed, and 3 of 15 guarded runs ended more than a point below their start (birds -10.0
and -1.5, fruit -3.5; without refinement, none of 15). Grayscale (cMNIST-style) bundles refine: there no guarded
run of 63 ended below its start, and glyphs gained 6 points from it."""


def refines(bundle: Bundle) -> bool:
    """Whether a repaired copy of ``bundle`` refines its answers (``REFINE_RGB`` for RGB bundles)."""
    return bundle.config.input.channels == 1 or REFINE_RGB


def faithfulness(bundle: Bundle, prototype: Tensor, probes: LabeledImages, seed: int = 0) -> dict[str, float]:
    """How well the distance to ``prototype`` orders boxes by IoU on ``probes``: OrdAcc (%) and Spearman."""
    m = ranking_metrics(bundle, probes, prototype, seed=seed, candidates=training_candidates(bundle))
    return {"ordacc": round(float(m["ordacc"]), 2), "spearman": round(float(m["spearman"]), 4)}


def repair_reward(bundle: Bundle, crops: list[Tensor], train: LabeledImages, val: LabeledImages,
                  cfg: RepairConfig | None = None, *, should_stop: Callable[[], bool] | None = None) -> Repair:
    """Train a copy of ``bundle``'s head on the probes ``train``, choose its epoch and decide on ``val``.

    ``crops``: the exemplar crops ``[C, h, w]`` in [0, 1] (the set's); ``train`` / ``val``: labeled probes at
    the bundle's input size, disjoint. Returns the ``Repair`` (the repaired copy only if kept). ``should_stop``:
    asked before every training batch (``models.train.embedding.Interrupted`` when it says so)."""
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
                              val_exemplars=exemplars, should_stop=should_stop)
    new_proto = Localizer(repaired, repaired.device).prototype(crops).to(repaired.device)
    after = faithfulness(repaired, new_proto, val, cfg.seed)
    kept = after["ordacc"] - before["ordacc"] > cfg.min_gain and after["spearman"] < before["spearman"]
    record = {"kept": kept, "before": before, "after": after, "best_epoch": summary["best_epoch"],
              "epochs": cfg.epochs, "train_probes": len(train), "val_probes": len(val),
              "seconds": round(time.perf_counter() - t0, 2)}
    if kept:  # its answers are refined on the head that now orders the client's boxes (models.refine)
        return Repair(True, replace(repaired, refine=refines(bundle)), new_proto.cpu(), record)
    return Repair(False, bundle, proto.cpu(), record)


# --- rewards chosen on the probes

CANDIDATES = ("embedding", "ncc", "features")
DEFAULT_MARGIN = 0.05
"""Spearman points (of ``-rho``) by which another candidate must beat the current reward to replace it."""
NCC_JITTER = 0.0
"""How the NCC reward reads a box: 0 = the box alone. ``box_ncc``'s jittered reads (the best of 27 shifted and
scaled boxes, what the calibration uses to forgive an answer a few pixels off) order box pairs somewhat better
(glyph 'K' probes: Spearman -0.59 vs -0.43) but make an adaptation iteration 3x slower (BENCHMARKS.md, "Rewards
chosen on the probes"), and the backbone features were still more faithful there."""


class EmbeddingScorer(EmbeddingDistance):
    """Candidate (a): the embedding distance to ``prototype [D]`` under the bundle's head (in an env: the env's
    prototypes, as the default scorer)."""

    def __init__(self, prototype: Tensor):
        self.prototype = prototype

    def box_distances(self, embedder: RoIEmbedder, feats: Tensor, boxes: Tensor, images01: Tensor | None) -> Tensor:
        """Distances of ``boxes [n, K, 4]`` on ``feats [n, C, h, w]`` -> ``[n, K]``."""
        return (embedder.embed(feats, boxes.to(feats.device)) - self.prototype.to(feats.device)).norm(dim=-1)


class NCCScorer:
    """Candidate (b): ``1 - mean NCC`` of the box's pixels with the exemplar templates (``models.calibration``)."""

    name, pixels, embedding = "ncc", True, False

    def __init__(self, crops: list[Tensor], jitter: float = NCC_JITTER):
        self.templates, self.jitter = make_templates(crops), jitter  # [E, C, 16, 16]

    def distances(self, images01: Tensor, boxes: Tensor) -> Tensor:
        """``boxes [n, K, 4]`` in the pixels of ``images01 [n, C, S, S]`` -> ``[n, K]`` float32 in [0, 2]: one
        ``roi_align`` and one matrix product for every box and template (``box_ncc``)."""
        ncc = box_ncc(images01, boxes, self.templates, jitter=self.jitter)  # [n, K, E] float64
        return (1.0 - ncc.mean(-1)).float()

    def env_distance(self, env: BoxEnv, roi: Tensor, emb: Tensor | None) -> Tensor:
        b = env.images01.shape[0]
        return self.distances(env.images01, env.boxes.view(b, env.episodes, 4)).view(-1).to(env.boxes.device)

    def box_distances(self, embedder: RoIEmbedder, feats: Tensor, boxes: Tensor, images01: Tensor | None) -> Tensor:
        if images01 is None:
            raise ValueError("the 'ncc' scorer needs the images' pixels")
        return self.distances(images01, boxes)


class FeatureScorer:
    """Candidate (c): ``1 - cos`` of the box's RoI-pooled backbone features with the exemplars' mean RoI feature."""

    name, pixels, embedding = "features", False, False

    def __init__(self, reference: Tensor):
        self.reference = reference.flatten()  # [C * s * s]

    @classmethod
    def from_crops(cls, bundle: Bundle, crops: list[Tensor]) -> FeatureScorer:
        """The mean RoI feature of the crops, each pasted on its exemplar canvas (``exemplar_canvas``)."""
        with torch.no_grad():
            canvases, boxes = exemplar_canvas(crops, bundle.config.input)
            emb = bundle.embedder.eval()
            feats = emb.features(normalize(canvases.to(bundle.device), bundle.config.input))
            return cls(emb.roi(feats, boxes.to(bundle.device)[:, None])[:, 0].mean(0))

    def _distance(self, roi: Tensor) -> Tensor:
        """``roi [..., C, s, s]`` -> ``[...]``."""
        return feature_distances(roi, self.reference)

    def env_distance(self, env: BoxEnv, roi: Tensor, emb: Tensor | None) -> Tensor:
        return self._distance(roi)

    def box_distances(self, embedder: RoIEmbedder, feats: Tensor, boxes: Tensor, images01: Tensor | None) -> Tensor:
        return self._distance(embedder.roi(feats, boxes))


Candidate = EmbeddingScorer | NCCScorer | FeatureScorer


def candidate_scorers(bundle: Bundle, prototype: Tensor, crops: list[Tensor],
                      names: tuple[str, ...] = CANDIDATES) -> dict[str, Candidate]:
    """The candidates ``names`` for ``bundle`` (its head: the bundle's, or the repaired one) and ``prototype``."""
    make = {"embedding": lambda: EmbeddingScorer(prototype), "ncc": lambda: NCCScorer(crops),
            "features": lambda: FeatureScorer.from_crops(bundle, crops)}
    unknown = set(names) - set(make)
    if unknown:
        raise ValueError(f"unknown reward candidates {sorted(unknown)}; known: {CANDIDATES}")
    return {n: make[n]() for n in names}


def scorer_faithfulness(bundle: Bundle, scorer: Candidate, probes: LabeledImages, seed: int = 0, pairs: int = 16,
                        candidates: Tensor | None = None, chunk: int = 64) -> dict[str, float]:
    """How well ``scorer``'s distance orders boxes by IoU on ``probes``: OrdAcc (%) and Spearman rho (negative
    is good), on the box pairs ``models.evaluate.ranking_metrics`` samples (same ``seed``: the same pairs for
    every scorer; for the embedding scorer, the same numbers as ``models.repair.faithfulness``)."""
    with torch.no_grad():
        emb = bundle.embedder.eval()
        gen = torch.Generator().manual_seed(seed)
        cands = training_candidates(bundle) if candidates is None else candidates
        p = sample_pairs(probes.boxes, cands, pairs, generator=gen)
        boxes = torch.cat([p.pos, p.neg], 1)  # [N, 2P, 4]
        feats = probes.feats if probes.feats is not None else features_of(bundle, probes.images)
        images = probes.images if getattr(scorer, "pixels", False) else None
        d = torch.cat([scorer.box_distances(emb, feats[i:i + chunk], boxes[i:i + chunk],
                                            None if images is None else images[i:i + chunk].to(feats.device)).cpu()
                       for i in range(0, len(feats), chunk)])
        d_pos, d_neg = d[:, :pairs], d[:, pairs:]
        ious = torch.cat([p.pos_iou, p.neg_iou], 1)
        rho = spearman(d.double(), ious.double())
        return {"ordacc": round(float((d_pos < d_neg).float().mean() * 100), 2),
                "spearman": round(float(rho.mean()), 4)}


@dataclass
class RewardChoice:
    """The reward a job adapts on, chosen on probes, and what every candidate scored there."""

    chosen: str
    scorer: Candidate
    current: str
    """The candidate that stands unless beaten by ``margin``: ``embedding`` (the bundle's or the repaired head)."""
    faithfulness: dict[str, dict[str, float]]
    margin: float
    probes: int

    @property
    def record(self) -> dict[str, Any]:
        return {"chosen": self.chosen, "current": self.current, "candidates": self.faithfulness,
                "rule": f"-spearman highest; another than {self.current!r} only if higher by more than {self.margin}",
                "margin": self.margin, "probes": self.probes}


def choose_reward(bundle: Bundle, scorers: dict[str, Candidate], probes: LabeledImages, *,
                  current: str = "embedding", margin: float = DEFAULT_MARGIN, seed: int = 0) -> RewardChoice:
    """Score every candidate on ``probes`` (``scorer_faithfulness``) and choose: the highest ``-spearman``, but
    ``current`` stays unless another beats it by more than ``margin`` (ties: the order of ``scorers``)."""
    if current not in scorers:
        raise ValueError(f"the current reward {current!r} must be one of the candidates {sorted(scorers)}")
    if probes.feats is None:
        probes = replace(probes, feats=features_of(bundle, probes.images))  # the backbone once for all candidates
    faith = {name: scorer_faithfulness(bundle, s, probes, seed) for name, s in scorers.items()}
    best = max(scorers, key=lambda n: (-faith[n]["spearman"], n == current))
    chosen = best if -faith[best]["spearman"] > -faith[current]["spearman"] + margin else current
    return RewardChoice(chosen, scorers[chosen], current, faith, margin, len(probes))


@dataclass
class Guarded:
    """What an adaptation job runs with: the reward (the bundle's own, or repaired) and the guard that decides."""

    bundle: Bundle
    """Adapt and serve with this bundle (the input one, or the repaired copy)."""
    prototype: Tensor
    guard: Guard
    repair: Repair | None
    """``None`` when repair was not asked for, or the job has fewer than ``MIN_TRAIN_PROBES`` synthetic probes."""
    choice: RewardChoice | None = None
    """The reward chosen on the probes (``models.repair``); ``None`` when the choice is off."""
    start: Start | None = None
    """The starting policy the checkpoints are paired with (``guarded_setup``'s ``start``, where the repair was
    kept; ``None``: served alone): they carry it (format 4), and the guard scored them paired."""

    @property
    def reward(self) -> str:
        """The head the job's embedding reward and its checkpoints use (what localize serves them with):
        ``"repaired head"`` or ``"bundle head"``. The policy adapts on it unless ``scorer`` says otherwise."""
        return "repaired head" if self.repair is not None and self.repair.kept else "bundle head"

    @property
    def scorer(self) -> Scorer | None:
        """The distance the policy adapts on when the choice picked another than the embedding, else ``None``."""
        if self.choice is None or self.choice.chosen == "embedding":
            return None
        return self.choice.scorer

    @property
    def record(self) -> dict[str, Any]:
        """What the job reports (``validation``): ``reward`` (the head), ``repair``, and ``reward_choice``: the
        candidate chosen (``chosen``), each candidate's OrdAcc / Spearman on the selection probes, the rule."""
        return {"reward": self.reward, "repair": None if self.repair is None else self.repair.record,
                "reward_choice": None if self.choice is None else self.choice.record}


def guarded_setup(bundle: Bundle, prototype: Tensor, crops: list[Tensor], images01: Tensor,
                  agent_state: dict[str, Tensor] | None, *, synthetic: int, generator_seed: int,
                  labeled: LabeledImages | None = None, repair: RepairConfig | None = None,
                  guard_cfg: GuardConfig | None = None, choice: bool = False, choice_margin: float = DEFAULT_MARGIN,
                  repaired: Repair | None = None, start: Start | None = None, probe_style: str = "rect",
                  should_stop: Callable[[], bool] | None = None) -> Guarded:
    """The reward and the guard of one adaptation job on ``images01 [N, C, S, S]``, the starting policy scored.

    With ``repair``: the head learns on ``synthetic`` probes (the starting policy's answers erased), its epoch
    chosen and its change decided on ``synthetic // 2`` others (``repair_reward``). The guard's probes are
    drawn afterwards, a third set: ``labeled`` examples plus ``synthetic`` pasted crops, erased where the
    kept reward's ranking finds the object (a starting policy that misses it would leave the client's own
    object beside the pasted one, and the probe would call a right answer wrong). Every draw is seeded by
    ``generator_seed``, so a resumed job rebuilds the same reward and probes.

    With ``choice``: the reward the policy adapts on is chosen among ``CANDIDATES`` on the
    ``synthetic // 2`` selection probes repair decides on (drawn for it when repair is off): the embedding
    distance under the kept head stays unless another candidate's ``-spearman`` is higher by more than
    ``choice_margin``; then the guard's probes are erased where that candidate's ranking finds the object, and the
    guard reports its faithfulness. The guard decides on its own probes as without the choice. ``repaired``:
    a ``Repair`` already made by this call's arguments (benchmarks comparing settings on one repair). ``start``: the
    starting policy as it is served (``bundle``'s head if the start has none of its own), to pair the checkpoints
    with where the repair is kept (``Guarded.start``): the guard then scores them paired, as localize serves them.
    ``should_stop``: asked during repair's training (``models.train.embedding.Interrupted`` when it says so)."""
    def gen(k: int) -> torch.Generator:
        return torch.Generator().manual_seed(generator_seed * 7919 + k)

    rep, erase, val = None, None, None
    if repair is not None and synthetic >= MIN_TRAIN_PROBES:
        val = synthetic_probes(bundle, prototype, crops, images01, agent_state, max(2, synthetic // 2), gen(2),
                               style=probe_style)
        if repaired is not None:
            rep = repaired
        else:
            train = synthetic_probes(bundle, prototype, crops, images01, agent_state, synthetic, gen(1),
                                     style=probe_style)
            rep = repair_reward(bundle, crops, train, val, replace(repair, seed=generator_seed),
                                should_stop=should_stop)
        if rep.kept:
            erase = ranking(rep.bundle, LabeledImages(images01, torch.zeros(len(images01), 4)), rep.prototype)
    kept = rep is not None and rep.kept
    cur_bundle, cur_proto = (rep.bundle, rep.prototype) if kept else (bundle, prototype)
    chosen = None
    if choice and synthetic >= 2:
        if val is None:  # the same draw repair would decide on
            val = synthetic_probes(bundle, prototype, crops, images01, agent_state, max(2, synthetic // 2), gen(2),
                                   style=probe_style)
        chosen = choose_reward(cur_bundle, candidate_scorers(cur_bundle, cur_proto, crops), val,
                               margin=choice_margin, seed=generator_seed)
        if chosen.chosen != "embedding":
            erase = ranking(cur_bundle, LabeledImages(images01, torch.zeros(len(images01), 4)), None,
                            scorer=chosen.scorer)
    parts = [labeled] if labeled is not None and len(labeled) else []
    if synthetic > 0:
        parts.append(synthetic_probes(bundle, prototype, crops, images01, agent_state, synthetic, gen(3), erase,
                                      style=probe_style))
    probes = LabeledImages(torch.cat([p.images for p in parts]), torch.cat([p.boxes for p in parts]))
    counts = {"labeled": len(labeled) if labeled is not None else 0, "synthetic": synthetic}
    guard = Guard(bundle, prototype, probes, gen(4), cfg=guard_cfg or GuardConfig(), counts=counts)
    guard.start(agent_state)  # with the bundle's own head: what the client is served before the job
    if kept:
        guard.use_reward(rep.bundle, rep.prototype)
        if start is not None:  # the checkpoints as localize will serve them: paired with the start
            guard.pair_with(start_companion(Localizer(bundle, bundle.device), start))
    if chosen is not None and chosen.chosen != "embedding":  # "reward unreliable" is then about the chosen one
        guard.faithfulness = scorer_faithfulness(guard.bundle, chosen.scorer,
                                                 LabeledImages(probes.images, probes.boxes, guard.feats))
    return Guarded(cur_bundle, cur_proto, guard, rep, chosen, start if kept else None)


def probe_style(mode: str, bundle: Bundle) -> str:
    """The probe style (``models.data.probes.PROBE_STYLES``) of a job on ``bundle`` under ``QLOC_PROBE_STYLE``
    (``photos``: ``soft`` for RGB bundles, ``rect`` for grayscale ones; else the style named)."""
    if mode == "photos":
        return "soft" if bundle.config.input.channels == 3 else "rect"
    return mode


def pairs_start(mode: str, bundle: Bundle) -> bool:
    """Whether an adaptation job on ``bundle`` pairs its checkpoints with its start (``QLOC_PAIR_START``: ``photos``,
    RGB bundles only; ``always``; ``never``), where its own reward repair is kept (``guarded_setup``'s ``start``:
    paired with an unrepaired start, the rule would judge by one head twice)."""
    return mode == "always" or (mode == "photos" and bundle.config.input.channels == 3)
