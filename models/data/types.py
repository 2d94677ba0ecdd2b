"""What the data modules hand to training and experiments."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class LabeledImages:
    """``images`` ``[N, C, S, S]`` in [0, 1] at the bundle's input size; ``boxes`` ``[N, 4]``."""

    images: Tensor
    boxes: Tensor


def exemplar_crops(data: LabeledImages) -> list[Tensor]:
    """The ground-truth crops ``[C, h, w]`` of ``data`` (what a client would upload as exemplars)."""
    out = []
    for img, b in zip(data.images, data.boxes.round().long(), strict=True):
        out.append(img[:, b[1]:b[3], b[0]:b[2]])
    return out

