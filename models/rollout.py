"""The box environment, vectorized over the batch, and one agent episode in it (time-major).

All images step together: boxes are a ``[B, 4]`` tensor and each step is one RoIAlign + head call
on the cached feature map, so the backbone runs once per image per episode.

The distance the reward is made of comes from a *scorer* (``models.repair``): by default the embedding
distance to the prototype (the paper's reward, and what serving uses); adaptation may train on another
(normalized cross-correlation with the exemplar crops, cosine of frozen backbone features) chosen on probes.
Whichever scorer, the reward is ``dist_before - dist``.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch import Tensor
from torch.distributions import Categorical

from models.config import EnvConfig
from models.core.actions import apply_actions
from models.core.boxes import full_image_boxes, paired_iou
from models.nets.agent import Agent
from models.nets.embedding import RoIEmbedder

REWARDS = ("embedding", "iou", "iou_sign")


class Scorer(Protocol):
    """What ``BoxEnv`` measures its distance with (``models.repair`` has the implementations)."""

    name: str
    pixels: bool
    """Needs the images' pixels: the env is then given ``images01``."""
    embedding: bool
    """Reads the head's embeddings (else the env skips the head unless the agent reads the prototype)."""

    def env_distance(self, env: BoxEnv, roi: Tensor, emb: Tensor | None) -> Tensor:
        """Distance ``[B*E]`` of the env's current boxes (``env.boxes``), lower = more like the exemplars, from
        their RoI features ``roi [B*E, C, s, s]`` and embeddings ``emb [B*E, D]`` (``None`` unless ``embedding``)."""
        ...


class EmbeddingDistance:
    """The paper's distance: ``||embedding(box) - prototype||`` with the env's prototypes (the default scorer)."""

    name, pixels, embedding = "embedding", False, True

    def env_distance(self, env: BoxEnv, roi: Tensor, emb: Tensor | None) -> Tensor:
        return (emb - env.prototypes).norm(dim=-1)


EMBEDDING = EmbeddingDistance()


class Rollout(NamedTuple):
    """One episode for ``B`` images, ``T`` steps; every field is time-major."""

    boxes: Tensor       # [T+1, B, 4], boxes[0] is the whole image (or the episode's start window)
    actions: Tensor     # [T, B]
    log_probs: Tensor   # [T, B] (carry the agent's gradient)
    entropies: Tensor   # [T, B]
    rewards: Tensor     # [T, B]
    distances: Tensor   # [T+1, B] distance of boxes[t] to the exemplars (the scorer's; by default the embedding's)
    kl: Tensor | None = None  # [T, B] KL(agent || reference) at the visited states, when a reference is given


class BoxEnv:
    """Boxes on ``B`` images at once; ``observe`` gives RoI features, embeddings and distances.

    ``scorer`` (default: the embedding distance) gives the distances, hence the ``"embedding"`` reward
    ``dist_before - dist``; one that needs pixels (``scorer.pixels``) is given the images ``images01
    [B, C, S, S]`` (input size, [0, 1]). ``embeddings=False`` skips the head when the scorer does not read it
    (the embeddings are then ``None``)."""

    def __init__(self, embedder: RoIEmbedder, feats: Tensor, prototypes: Tensor, cfg: EnvConfig,
                 size: tuple[float, float], reward: str = "embedding", gt_boxes: Tensor | None = None,
                 episodes: int = 1, starts: Tensor | None = None, scorer: Scorer | None = None,
                 images01: Tensor | None = None, embeddings: bool = True):
        self.scorer = EMBEDDING if scorer is None else scorer
        if self.scorer.pixels and (images01 is None or len(images01) != feats.shape[0]):
            raise ValueError(f"the {self.scorer.name!r} scorer needs the images' pixels, one per feature map")
        self.images01 = images01 if self.scorer.pixels else None
        self.embeddings = embeddings or self.scorer.embedding
        if reward not in REWARDS:
            raise ValueError(f"reward must be one of {REWARDS}, got {reward!r}")
        if reward != "embedding" and gt_boxes is None:
            raise ValueError(f"the {reward!r} reward needs ground-truth boxes")
        if episodes < 1:
            raise ValueError(f"episodes must be >= 1, got {episodes}")
        # ``episodes`` boxes per image share its feature map: episode j of image i is row i * episodes + j.
        self.embedder, self.feats, self.episodes = embedder, feats, episodes  # [B, C, h, w]
        self.prototypes = prototypes.repeat_interleave(episodes, 0) if episodes > 1 else prototypes  # [B*E, D]
        self.cfg, self.width, self.height = cfg, float(size[0]), float(size[1])
        self.reward_kind = reward
        self.gt_boxes = gt_boxes.repeat_interleave(episodes, 0) if gt_boxes is not None and episodes > 1 else gt_boxes
        n = feats.shape[0] * episodes
        if starts is None:
            self.boxes = full_image_boxes(n, self.width, self.height, device=feats.device)
        elif starts.shape != (n, 4):
            raise ValueError(f"starts must be [B * episodes, 4] = [{n}, 4], got {list(starts.shape)}")
        else:  # episodes from given windows (several instances): image-major, as the rows
            self.boxes = starts.to(feats.device, torch.float32)

    def observe(self, embed: bool = True) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """-> (RoI features ``[B*E, C, s, s]``, embeddings ``[B*E, D]``, distances ``[B*E]``) of the current boxes,
        without gradients.

        With ``embed=False`` only the RoI features (the head is skipped; embeddings and distances are None);
        the distances are the scorer's.
        """
        with torch.no_grad():  # a block, not a decorator: mutmut leaves decorated functions unmutated
            b, e = self.feats.shape[0], self.episodes
            roi = self.embedder.roi(self.feats, self.boxes.view(b, e, 4)).flatten(0, 1)  # [B*E, C, s, s]
            if not embed:
                return roi, None, None
            emb = self.embedder.embed_roi(roi[:, None])[:, 0] if self.embeddings else None
            return roi, emb, self.scorer.env_distance(self, roi, emb)

    def step(self, actions: Tensor, dist_before: Tensor | None, embed: bool = True
             ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
        """Apply ``actions [B]`` -> (roi, embeddings, distances, rewards ``[B]``) after the move.

        With ``embed=False`` the head is skipped and embeddings, distances and rewards are None.
        """
        before = self.boxes
        self.boxes = apply_actions(before, actions, self.width, self.height, self.cfg.alpha,
                                   self.cfg.min_side, self.cfg.resize)
        roi, emb, dist = self.observe(embed)
        if not embed:
            return roi, None, None, None
        if self.reward_kind == "embedding":
            reward = dist_before - dist
        else:
            gain = paired_iou(self.boxes, self.gt_boxes) - paired_iou(before, self.gt_boxes)
            reward = gain if self.reward_kind == "iou" else torch.sign(gain)
        return roi, emb, dist, reward


def select_actions(logits: Tensor, deterministic: bool | Tensor, generator: torch.Generator | None) -> Tensor:
    """Greedy (argmax) or sampled actions from ``logits [B, A]`` -> ``[B]``; ``deterministic`` may be a
    ``[B]`` mask (greedy rows, sampled rows).

    Sampling draws on the generator's device (training and adaptation keep one CPU generator), so
    the random stream, and a checkpoint's saved generator state, are the same on CPU and CUDA.
    """
    if isinstance(deterministic, bool) and deterministic:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float(), dim=-1)
    if generator is not None and generator.device != probs.device:
        sampled = torch.multinomial(probs.to(generator.device), 1, generator=generator).squeeze(1).to(logits.device)
    else:
        sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    if isinstance(deterministic, Tensor):
        return torch.where(deterministic, logits.argmax(dim=-1), sampled)
    return sampled


class Steer(Protocol):
    """What ``rollout`` moves the boxes with when nothing reads the embeddings along the way: ``steer``'s signature."""

    def __call__(self, embedder: RoIEmbedder, agent: Agent, feats: Tensor, boxes: Tensor, cfg: EnvConfig,
                 size: tuple[float, float], deterministic: bool | Tensor = True,
                 generator: torch.Generator | None = None) -> tuple[Tensor, Tensor, Tensor]: ...


def steer(embedder: RoIEmbedder, agent: Agent, feats: Tensor, boxes: Tensor, cfg: EnvConfig,
          size: tuple[float, float], deterministic: bool | Tensor = True,
          generator: torch.Generator | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The moves of an episode whose boxes nobody embeds along the way: ``cfg.steps`` actions from ``boxes
    [B*E, 4]`` (``E`` episodes per feature map of ``feats [B, C, h, w]``, image-major rows) -> (boxes
    ``[T+1, B*E, 4]``, actions ``[T, B*E]``, logits ``[T, B*E, A]``).

    Tensors in, tensors out, no state kept: what inference runs at every batch size, and what
    ``models.compiled`` compiles for the one-image request (the same function, so the same moves).
    """
    n, b = boxes.shape[0], feats.shape[0]
    h = agent.initial_state(n, device=feats.device)
    path, actions, step_logits = [boxes], [], []
    for _ in range(cfg.steps):  # a loop over time; the batch moves as one tensor
        roi = embedder.roi(feats, boxes.view(b, n // b, 4)).flatten(0, 1)  # [B*E, C, s, s]
        logits, h = agent(roi, h)
        a = select_actions(logits, deterministic, generator)
        boxes = apply_actions(boxes, a, size[0], size[1], cfg.alpha, cfg.min_side, cfg.resize)
        path.append(boxes)
        actions.append(a)
        step_logits.append(logits)
    return torch.stack(path), torch.stack(actions), torch.stack(step_logits)


def rollout(embedder: RoIEmbedder, agent: Agent, feats: Tensor, prototypes: Tensor, cfg: EnvConfig,
            size: tuple[float, float], *, deterministic: bool | Tensor = False,
            generator: torch.Generator | None = None, reward: str = "embedding",
            gt_boxes: Tensor | None = None, rewards: bool = True, episodes: int = 1,
            reference: Agent | None = None, starts: Tensor | None = None, scorer: Scorer | None = None,
            images01: Tensor | None = None, steerer: Steer | None = None) -> Rollout:
    """Run ``cfg.steps`` actions from the whole image (or from ``starts``) on every image of ``feats [B, C, h, w]``.

    ``prototypes`` is ``[B, D]`` (or ``[D]``, shared). The agent's gradient flows through
    ``log_probs`` and ``entropies``; the frozen embedder is run without gradient.
    ``rewards=False`` (inference) embeds only the final box when the agent does not look at the
    prototype: ``rewards`` are then zeros and ``distances`` NaN but for the last step.
    ``episodes`` runs that many episodes per image on its one feature map; the rollout's rows are
    then ``B * episodes``, image-major, and ``deterministic`` may be a ``[B * episodes]`` mask.
    ``reference`` (a frozen agent) adds ``kl``: KL(agent || reference) of the action distributions at
    every visited state, differentiable in the agent (adaptation's trust region).
    ``starts`` (``[B * episodes, 4]``, input pixels, image-major) starts each episode from its own window
    instead of the whole image (``models.instances``).
    ``scorer`` (``models.repair``; default the embedding distance) measures the distances and so the
    ``"embedding"`` reward; one that needs pixels is given ``images01 [B, C, S, S]`` (input size, [0, 1]).
    ``steerer`` replaces ``steer`` where the episode needs nothing but its moves (inference without rewards,
    by an agent that does not read the prototype): ``models.compiled`` gives a compiled one.
    """
    # Every step's embedding is needed for the rewards, or as input of an agent that reads the prototype.
    embed = rewards or agent.cfg.use_prototype
    if prototypes.dim() == 1:
        prototypes = prototypes.expand(feats.shape[0], -1)
    env = BoxEnv(embedder, feats, prototypes, cfg, size, reward, gt_boxes, episodes, starts, scorer, images01,
                 embeddings=agent.cfg.use_prototype)
    prototypes = env.prototypes
    b = feats.shape[0] * episodes
    # Without gradient nor reference (inference), log-probabilities and entropies come from one log-softmax
    # over every step's logits after the loop: the same numbers, without building a distribution at every
    # step (a fixed cost that batch 1 feels).
    track = torch.is_grad_enabled() or reference is not None
    if not embed and not track:  # inference: the moves alone, then only the final box is embedded (its score)
        boxes_t, actions_t, logits_t = (steer if steerer is None else steerer)(
            embedder, agent, feats, env.boxes, cfg, (env.width, env.height), deterministic, generator)
        env.boxes = boxes_t[-1]
        return Rollout(boxes_t, actions_t, *_log_probs_entropies(logits_t, actions_t),
                       *_final_distance_only(env, cfg.steps))
    roi, emb, dist = env.observe(embed)
    h = agent.initial_state(b, device=feats.device)
    h_ref = None if reference is None else reference.initial_state(b, device=feats.device)
    boxes, dists = [env.boxes], [dist]
    actions, log_probs, entropies, step_rewards, kls, step_logits = [], [], [], [], [], []
    for _ in range(cfg.steps):  # a loop over time; the batch moves as one tensor
        offset = None if emb is None else emb - prototypes
        logits, h = agent(roi, h, offset)
        a = select_actions(logits.detach(), deterministic, generator)
        if track:
            dist_t = Categorical(logits=logits)
            if reference is not None:
                with torch.no_grad():
                    ref_logits, h_ref = reference(roi, h_ref, offset)
                kls.append(torch.distributions.kl_divergence(dist_t, Categorical(logits=ref_logits)))
            log_probs.append(dist_t.log_prob(a))
            entropies.append(dist_t.entropy())
        else:
            step_logits.append(logits)
        roi, emb, dist, r = env.step(a, dist, embed)
        actions.append(a)
        step_rewards.append(r)
        boxes.append(env.boxes)
        dists.append(dist)
    if track:
        log_probs_t, entropies_t = torch.stack(log_probs), torch.stack(entropies)
    else:
        log_probs_t, entropies_t = _log_probs_entropies(torch.stack(step_logits), torch.stack(actions))
    if not embed:
        rewards_t, dists_t = _final_distance_only(env, cfg.steps)
    else:
        dists_t, rewards_t = torch.stack(dists), torch.stack(step_rewards)
    return Rollout(torch.stack(boxes), torch.stack(actions), log_probs_t, entropies_t, rewards_t, dists_t,
                   torch.stack(kls) if kls else None)


def _log_probs_entropies(logits: Tensor, actions: Tensor) -> tuple[Tensor, Tensor]:
    """Every step's logits ``[T, B, A]`` and actions ``[T, B]`` -> (log-probabilities, entropies) ``[T, B]``, from one
    log-softmax (inference: no distribution built at every step)."""
    logp = logits.log_softmax(-1)  # [T, B, A]
    return logp.gather(2, actions[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


def _final_distance_only(env: BoxEnv, steps: int) -> tuple[Tensor, Tensor]:
    """(rewards ``[T, N]`` zeros, distances ``[T+1, N]`` NaN but the last) of an episode that embedded only its
    final box, ``env.boxes`` (its distance is the score)."""
    n, device = env.boxes.shape[0], env.boxes.device
    dists = torch.full((steps + 1, n), float("nan"), device=device)
    dists[-1] = env.observe()[2]
    return torch.zeros(steps, n, device=device), dists


def search(embedder: RoIEmbedder, agent: Agent, feats: Tensor, prototypes: Tensor, cfg: EnvConfig,
           size: tuple[float, float], samples: int, generator: torch.Generator | None = None,
           nearest: bool = False) -> Rollout:
    """Best of ``1 + samples`` episodes per image: the greedy one and ``samples`` sampled ones, all
    batched on the one feature map; each image keeps the episode whose final box is nearest the
    prototype (the score needs no label) -> a ``Rollout`` of ``B`` rows. Ties keep the greedy episode.

    ``nearest`` looks at every box the episodes visit after step 1, not only the final ones: the
    image's answer is the visited box nearest the prototype, and its episode is returned as if it had
    stopped there (the later steps repeat that box and its distance). An agent trained for a fixed
    ``T`` tends to walk past the object on classes it was not trained on; this answer costs nothing
    more than embedding every step's box, which an agent that reads the prototype does anyway.
    """
    if samples < 0:
        raise ValueError(f"samples must be >= 0, got {samples}")
    if samples == 0 and not nearest:
        return rollout(embedder, agent, feats, prototypes, cfg, size, deterministic=True, rewards=False)
    b, e = feats.shape[0], samples + 1
    greedy = torch.arange(b * e, device=feats.device) % e == 0
    ro = rollout(embedder, agent, feats, prototypes, cfg, size, deterministic=greedy if samples else True,
                 generator=generator, rewards=nearest, episodes=e)
    steps = ro.distances.shape[0] - 1
    image = torch.arange(b, device=feats.device)
    if nearest:  # over (step >= 1, episode), step-major: ties keep the earlier step, then the greedy episode
        k = ro.distances[1:].view(steps, b, e).permute(1, 0, 2).reshape(b, steps * e).argmin(dim=1)  # [B]
        stop, pick = k // e + 1, k % e + image * e
    else:
        stop, pick = None, ro.distances[-1].view(b, e).argmin(dim=1) + image * e  # [B] rows
    out = Rollout(*(None if field is None else field[:, pick] for field in ro))
    if stop is None:
        return out
    after = torch.arange(steps + 1, device=feats.device)[:, None] > stop[None]  # [T+1, B]: steps past the stop
    boxes = torch.where(after[..., None], out.boxes[stop, image][None], out.boxes)
    dists = torch.where(after, out.distances[stop, image][None], out.distances)
    return out._replace(boxes=boxes, distances=dists)
