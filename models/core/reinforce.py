"""REINFORCE with a baseline: small pure functions on time-major ``[T, B]`` tensors."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


def discounted_returns(rewards: Tensor, gamma: float) -> Tensor:
    """``G_t = sum_{k >= t} gamma^(k - t) r_k`` for ``rewards [T, B]`` -> ``[T, B]``."""
    out = torch.empty_like(rewards)
    running = torch.zeros_like(rewards[0])
    for t in range(rewards.shape[0] - 1, -1, -1):  # over time only
        running = rewards[t] + gamma * running
        out[t] = running
    return out


class PolicyLoss(NamedTuple):
    loss: Tensor
    policy: Tensor
    entropy: Tensor
    mean_return: Tensor


def reinforce_loss(log_probs: Tensor, entropies: Tensor, rewards: Tensor, gamma: float = 0.99,
                   entropy_coef: float = 0.5, normalize: bool = True, episodes: int = 1) -> PolicyLoss:
    """Policy-gradient loss with a baseline at each step.

    ``episodes == 1``: the baseline is the batch mean return. ``episodes > 1``: the columns are
    ``episodes`` episodes per image, image-major (``rollout(..., episodes=E)``), and each episode's
    baseline is the mean return of its image's *other* episodes (leave-one-out), so how far the whole
    image starts from the prototype -- which differs a lot between images -- no longer adds variance.
    ``normalize`` divides advantages by their std, so the entropy weight does not depend on the
    reward's scale (embedding distances are O(10..100), IoU gains O(0.1)).
    """
    returns = discounted_returns(rewards, gamma)  # [T, B]
    if episodes > 1:
        t, b = returns.shape
        if b % episodes:
            raise ValueError(f"{b} episodes do not split into groups of {episodes}")
        g = returns.view(t, b // episodes, episodes)
        adv = (g - (g.sum(dim=2, keepdim=True) - g) / (episodes - 1)).view(t, b)
    else:
        adv = returns - returns.mean(dim=1, keepdim=True)
    if normalize and adv.numel() > 1:
        adv = adv / (adv.std() + 1e-6)
    policy = -(log_probs * adv.detach()).sum(0).mean()
    entropy = entropies.sum(0).mean()  # summed over the episode; the bonus uses the per-step mean
    return PolicyLoss(policy - entropy_coef * entropy / log_probs.shape[0], policy, entropy, returns[0].mean())
