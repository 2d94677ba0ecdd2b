"""What the data modules hand to training, metrics and experiments."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor


@dataclass
class LabeledImages:
    """Images with their boxes, and optionally their backbone features.

    ``images [N, C, S, S]`` in [0, 1] at the bundle's input size; ``boxes [N, 4]``. A frozen backbone's
    features may be computed once and carried along (``models.features.with_features``): ``feats
    [N, C', h, w]``, and for each ground-truth crop pasted as an exemplar canvas, ``crop_feats
    [N, C', h, w]`` and the pasted box ``crop_boxes [N, 4]``. Trainers and metrics use the features
    when present and run the backbone on ``images`` otherwise.
    """

    images: Tensor
    boxes: Tensor
    feats: Tensor | None = None
    crop_feats: Tensor | None = None
    crop_boxes: Tensor | None = None
    sources: Tensor | None = None
    """``[N]`` long: for images made by pasting exemplar crops (``models.data.probes.paste_probes``), the index of
    the crop each holds (-1: not known)."""
    classes: Tensor | None = None
    """``[N]`` long: the kind of object each image holds, for data of several kinds (``concat``); trainers then
    anchor every image on exemplars of its own kind. ``None``: one kind."""

    def __len__(self) -> int:
        return self.images.shape[0]

    def subset(self, idx: Tensor) -> LabeledImages:
        """The images at ``idx`` (a 1-d index tensor), with whatever features are carried."""
        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[idx.to(t.device)]
        return replace(self, images=self.images[idx], boxes=self.boxes[idx], feats=pick(self.feats),
                       crop_feats=pick(self.crop_feats), crop_boxes=pick(self.crop_boxes), classes=pick(self.classes))

    @staticmethod
    def concat(parts: list[LabeledImages]) -> LabeledImages:
        """Data of several kinds, part ``i`` labeled kind ``i`` (``classes``); features are kept where every part
        carries them."""
        def cat(ts: list[Tensor | None]) -> Tensor | None:
            return None if any(t is None for t in ts) else torch.cat(ts)  # type: ignore[arg-type]
        kinds = torch.cat([torch.full((len(p),), i, dtype=torch.long) for i, p in enumerate(parts)])
        return LabeledImages(torch.cat([p.images for p in parts]), torch.cat([p.boxes for p in parts]),
                             feats=cat([p.feats for p in parts]), crop_feats=cat([p.crop_feats for p in parts]),
                             crop_boxes=cat([p.crop_boxes for p in parts]), classes=kinds)


def exemplar_crops(data: LabeledImages) -> list[Tensor]:
    """The ground-truth crops ``[C, h, w]`` of ``data`` (what a client would upload as exemplars)."""
    out = []
    for img, b in zip(data.images, data.boxes.round().long(), strict=True):
        out.append(img[:, b[1]:b[3], b[0]:b[2]])
    return out
