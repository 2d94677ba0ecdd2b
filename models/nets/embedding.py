"""The RoI embedder: backbone feature map -> RoIAlign -> projection head -> embedding.

The backbone runs once per image (``features``); every box after that is an RoIAlign on the
cached map (``roi`` / ``embed_roi``), which is what keeps a rollout cheap.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor, nn
from torchvision.extension import _has_ops
from torchvision.ops import roi_align

from models.backbones import build_backbone
from models.config import HeadConfig, ModelConfig, RoIConfig


class ProjectionHead(nn.Module):
    """Linear(C*7*7 -> hidden)-ReLU-Dropout-Linear(hidden -> out): ``[N, C, 7, 7] -> [N, out]``."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(cfg.in_features, cfg.hidden), nn.ReLU(inplace=True),
            nn.Dropout(cfg.dropout), nn.Linear(cfg.hidden, cfg.out_features),
        )

    def forward(self, roi_feats: Tensor) -> Tensor:
        return self.net(roi_feats)


@lru_cache(maxsize=64)
def _roi_index(b: int, k: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """RoIAlign's batch-index column ``[B*K, 1]`` (0, ..0, 1, ..): made once per shape, as every step of a
    rollout asks for the same one (read only: ``batched_rois`` copies it)."""
    return torch.arange(b, device=device, dtype=dtype).repeat_interleave(k)[:, None]


def batched_rois(boxes: Tensor) -> Tensor:
    """``boxes (Tensor[B, K, 4])`` -> RoIAlign's ``Tensor[B*K, 5]`` rows ``(batch_index, x1, y1, x2, y2)``."""
    b, k, _ = boxes.shape
    return torch.cat([_roi_index(b, k, boxes.device, boxes.dtype), boxes.reshape(b * k, 4)], dim=1)


# On the CPU, torchvision's ``roi_align`` wrapper ends in this op (its other branches are for quantized
# inputs, scripting, and deterministic CUDA / MPS / XPU); called directly, a rollout step skips the
# wrapper's checks, a fixed cost that batch 1 feels.
_CPU_ROI_ALIGN = torch.ops.torchvision.roi_align if _has_ops() else None


class RoIEmbedder(nn.Module):
    """Encoder + RoIAlign + projection head, built from a ``ModelConfig``."""

    def __init__(self, cfg: ModelConfig, pretrained: bool = True):
        super().__init__()
        self.cfg = cfg
        self.encoder = build_backbone(cfg.encoder, pretrained=pretrained)
        self.head = ProjectionHead(cfg.head)
        self.roi_cfg: RoIConfig = cfg.roi

    def features(self, images: Tensor) -> Tensor:
        """Normalized ``images [B, C, H, W]`` -> feature map ``[B, C', H', W']``."""
        return self.encoder(images)

    def roi(self, feats: Tensor, boxes: Tensor) -> Tensor:
        """RoI features of ``boxes [B, K, 4]`` (input pixels; moved to ``feats``' device) on
        ``feats [B, C, H', W']`` -> ``[B, K, C, s, s]``."""
        b, k, _ = boxes.shape
        r = self.roi_cfg
        rois = batched_rois(boxes.to(feats.device, feats.dtype))
        if _CPU_ROI_ALIGN is not None and feats.device.type == "cpu" and not feats.is_quantized:
            out = _CPU_ROI_ALIGN(feats, rois, r.spatial_scale, r.output_size, r.output_size, r.sampling_ratio, True)
        else:
            out = roi_align(feats, rois, output_size=r.output_size, spatial_scale=r.spatial_scale,
                            sampling_ratio=r.sampling_ratio, aligned=True)
        return out.view(b, k, *out.shape[1:])

    def embed_roi(self, roi_feats: Tensor) -> Tensor:
        """``[B, K, C, s, s]`` -> embeddings ``[B, K, D]``."""
        b, k = roi_feats.shape[:2]
        return self.head(roi_feats.flatten(0, 1)).view(b, k, -1)

    def embed(self, feats: Tensor, boxes: Tensor) -> Tensor:
        """Embeddings of ``boxes [B, K, 4]`` on ``feats`` -> ``[B, K, D]``."""
        return self.embed_roi(self.roi(feats, boxes))
