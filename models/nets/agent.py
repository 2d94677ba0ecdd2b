"""The localization agent: RoI feature (+ optional prototype offset) -> recurrent cell -> action logits.

The recurrent state is passed in and returned explicitly, never kept in the module.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from models.config import AgentConfig


class Agent(nn.Module):
    """``forward(roi [B, C, s, s], h [B, hidden], offset [B, D] | None) -> (logits [B, A], h')``."""

    def __init__(self, cfg: AgentConfig):
        super().__init__()
        self.cfg = cfg
        self.reduce = nn.Sequential(nn.Conv2d(cfg.in_channels, cfg.conv_channels, 1), nn.ReLU(inplace=True),
                                    nn.Flatten())
        in_features = cfg.conv_channels * cfg.roi_size * cfg.roi_size
        if cfg.use_prototype:
            self.offset = nn.Sequential(nn.Linear(cfg.embed_dim, 64), nn.Tanh())
            in_features += 64
        if cfg.cell == "gru":
            self.cell: nn.Module = nn.GRUCell(in_features, cfg.hidden)
        elif cfg.cell == "rnn":
            self.cell = nn.RNNCell(in_features, cfg.hidden, nonlinearity="tanh")
        else:
            raise ValueError(f"agent cell must be 'gru' or 'rnn', got {cfg.cell!r}")
        self.policy = nn.Linear(cfg.hidden, cfg.n_actions)

    def initial_state(self, batch: int, device=None) -> Tensor:
        return torch.zeros(batch, self.cfg.hidden, device=device)

    def forward(self, roi: Tensor, h: Tensor, offset: Tensor | None = None) -> tuple[Tensor, Tensor]:
        # The layers' own functions, not their modules' calls: a rollout step runs this once per step at
        # any batch size, and at batch 1 the module-call overhead was a good part of it (same numbers).
        conv = self.reduce[0]
        x = F.relu(F.conv2d(roi, conv.weight, conv.bias), inplace=True).flatten(1)
        if self.cfg.use_prototype:
            if offset is None:
                raise ValueError("this agent was built with use_prototype=True: pass the prototype offset")
            # Scale-free direction to the prototype; distances are O(10..100) in this embedding.
            x = torch.cat([x, self.offset(offset / (offset.norm(dim=-1, keepdim=True) + 1e-6))], dim=-1)
        cell = self.cell
        step = torch.gru_cell if self.cfg.cell == "gru" else torch.rnn_tanh_cell
        h = step(x, h, cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)
        return F.linear(h, self.policy.weight, self.policy.bias), h
