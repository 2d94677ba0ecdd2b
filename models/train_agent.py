"""Stage 2: train the agent with the frozen embedder; also the shared policy-gradient step.

Each iteration splits the training images into groups of ``group_size``; every image is localized
with the prototype of exemplar crops from a *different* group, as at test time. The best
iteration is chosen by CorLoc on the validation split, never on test.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from models.agent import Agent
from models.bundle import Bundle
from models.inference import Localizer, normalize
from models.metrics import corloc
from models.ordinal import group_prototypes
from models.reinforce import reinforce_loss
from models.rollout import rollout
from models.train_embedding import LabeledImages


@dataclass
class PolicyConfig:
    """The REINFORCE settings shared by stage 2, stage 3 and the fine-tune baseline."""

    lr: float = 1e-3
    gamma: float = 0.99
    entropy_coef: float = 0.5
    normalize_advantages: bool = True
    reward: str = "embedding"
    """"embedding" (the paper's transferable reward), or the baselines "iou" / "iou_sign" (need boxes)."""
    kl_coef: float = 0.0
    """Weight of KL(policy || reference policy) per step (adaptation: the starting policy); 0 = off."""
    episodes: int = 1
    """Sampled episodes per image and step, on the image's one feature map; > 1 gives each episode
    the mean return of its image's other episodes as baseline (see ``reinforce_loss``)."""


@dataclass
class AgentTrainConfig(PolicyConfig):
    iterations: int = 400
    group_size: int = 5
    eval_every: int = 25
    seed: int = 0


def policy_step(bundle: Bundle, agent: Agent, opt: torch.optim.Optimizer, feats: Tensor, prototypes: Tensor,
                cfg: PolicyConfig, generator: torch.Generator | None = None, gt_boxes: Tensor | None = None,
                reference: Agent | None = None) -> dict:
    """One sampled episode on ``feats [B, C, h, w]`` and one Adam step on the agent -> stats.

    With ``reference`` and ``cfg.kl_coef > 0`` the loss adds ``kl_coef`` x the mean per-step
    KL(agent || reference) at the visited states."""
    agent.train()
    s = float(bundle.config.input.size)
    ref = reference if cfg.kl_coef > 0 else None
    ro = rollout(bundle.embedder, agent, feats, prototypes, bundle.config.env, (s, s), deterministic=False,
                 generator=generator, reward=cfg.reward, gt_boxes=gt_boxes, reference=ref, episodes=cfg.episodes)
    out = reinforce_loss(ro.log_probs, ro.entropies, ro.rewards, cfg.gamma, cfg.entropy_coef,
                         cfg.normalize_advantages, cfg.episodes)
    loss = out.loss
    stats = {}
    if ro.kl is not None:
        kl = ro.kl.mean()
        loss = loss + cfg.kl_coef * kl
        stats["losses/kl"] = float(kl.detach())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return {"losses/policy": float(out.policy.detach()), "losses/entropy": float(out.entropy.detach()),
            "charts/return": float(out.mean_return), "charts/final_distance": float(ro.distances[-1].mean()),
            **stats}


@torch.no_grad()
def features_of(bundle: Bundle, images01: Tensor, batch: int = 256) -> Tensor:
    """Backbone features of ``images01 [N, C, S, S]`` -> ``[N, C', h, w]`` on the embedder's device."""
    dev = next(bundle.embedder.parameters()).device
    return torch.cat([bundle.embedder.features(normalize(images01[i:i + batch].to(dev), bundle.config.input))
                      for i in range(0, len(images01), batch)])


def exemplar_crops(data: LabeledImages) -> list[Tensor]:
    """The ground-truth crops ``[C, h, w]`` of ``data`` (what a client would upload as exemplars)."""
    out = []
    for img, b in zip(data.images, data.boxes.round().long(), strict=True):
        out.append(img[:, b[1]:b[3], b[0]:b[2]])
    return out


@torch.no_grad()
def evaluate_corloc(bundle: Bundle, agent: Agent, data: LabeledImages, prototype: Tensor,
                    deterministic: bool = True, seed: int = 0, batch: int = 256, samples: int = 0,
                    nearest: bool = False) -> tuple[float, Tensor]:
    """CorLoc (%) of ``agent`` on ``data`` with one shared ``prototype [D]`` -> (corloc, boxes ``[N, 4]``).

    ``samples > 0``: the best-of-(1 + samples) search of ``Localizer.run`` (greedy episode included);
    ``nearest``: the visited box nearest the prototype is the answer (``Localizer.run``)."""
    loc = Localizer(bundle, device=next(bundle.embedder.parameters()).device)
    agent.eval()
    if samples > 0:
        gen = torch.Generator().manual_seed(seed)
    else:
        gen = None if deterministic else torch.Generator(device=loc.device).manual_seed(seed)
    boxes = torch.cat([loc.run(data.images[i:i + batch], prototype, agent, deterministic=deterministic,
                               generator=gen, samples=samples, nearest=nearest).boxes[-1].cpu()
                       for i in range(0, len(data.images), batch)])
    return corloc(boxes, data.boxes), boxes


def train_agent(bundle: Bundle, train: LabeledImages, val: LabeledImages, val_exemplars: LabeledImages,
                cfg: AgentTrainConfig, on_log: Callable[[dict], None] | None = None) -> dict:
    """Train the bundle's base policy (best validation state kept in ``bundle.agent_state``) -> summary."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    loc = Localizer(bundle, device=next(bundle.embedder.parameters()).device)
    agent = Agent(bundle.config.agent).to(loc.device)
    opt = torch.optim.Adam(agent.parameters(), lr=cfg.lr)
    feats = features_of(bundle, train.images)  # frozen backbone: once for the whole stage
    crop_emb = loc.embed_crops(exemplar_crops(train))  # [N, D]
    val_proto = loc.prototype(exemplar_crops(val_exemplars))
    gt = train.boxes.to(loc.device) if cfg.reward != "embedding" else None
    best = (-1.0, None, 0)
    history = []
    for it in range(1, cfg.iterations + 1):
        protos = group_prototypes(crop_emb, cfg.group_size, shuffle=True, generator=gen)
        stats = policy_step(bundle, agent, opt, feats, protos, cfg, gen, gt)
        if it % cfg.eval_every == 0 or it == cfg.iterations:
            val_corloc, _ = evaluate_corloc(bundle, agent, val, val_proto)
            rec = {"iteration": it, **stats, "val/corloc": val_corloc}
            history.append(rec)
            if on_log:
                on_log(rec)
            if val_corloc > best[0]:
                best = (val_corloc, copy.deepcopy(agent.state_dict()), it)
    bundle.agent_state = {k: v.cpu() for k, v in best[1].items()}
    return {"val/corloc": best[0], "best_iteration": best[2], "history": history}
