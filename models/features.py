"""Backbone features and exemplar embeddings of labeled images: computed through the backbone, or taken
from features a frozen backbone computed once (``LabeledImages.feats`` / ``crop_feats``).

Trainers, metrics and adaptation get their feature maps here, so none of them needs its own copy for
cached features.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from models.bundle import Bundle
from models.data.types import LabeledImages, exemplar_crops
from models.inference import exemplar_canvas, normalize


def features_of(bundle: Bundle, images01: Tensor, batch: int = 256) -> Tensor:
    """Backbone features of ``images01 [N, C, S, S]`` -> ``[N, C', h, w]`` on the embedder's device."""
    with torch.no_grad():
        dev = bundle.device
        return torch.cat([bundle.embedder.features(normalize(images01[i:i + batch].to(dev), bundle.config.input))
                          for i in range(0, len(images01), batch)])


def with_features(bundle: Bundle, data: LabeledImages, crops: bool = False, batch: int = 32,
                  cache=None) -> LabeledImages:  # noqa: ANN001 (any callable(key, make) -> Tensor)
    """``data`` carrying its backbone features (for a frozen backbone: computed once, reused by every stage
    and metric); ``crops`` also carries each ground-truth crop's exemplar-canvas features (for prototypes
    and the ``shuffle_exemplar`` anchor). ``cache(kind, make)`` may serve them from disk."""
    def get(kind: str, make):  # noqa: ANN001, ANN202
        return make() if cache is None else cache(kind, make)

    out = replace(data, feats=get("images", lambda: features_of(bundle, data.images, batch=batch)))
    if crops:
        canvases, boxes = exemplar_canvas(exemplar_crops(data), bundle.config.input)
        out.crop_feats = get("crops", lambda: features_of(bundle, canvases, batch=batch))
        out.crop_boxes = boxes
    return out


def crop_embeddings(bundle: Bundle, data: LabeledImages, idx: Tensor | None = None, *, grad: bool = False) -> Tensor:
    """Embedding of each ground-truth crop of ``data`` (or of its images ``idx``) pasted as an exemplar canvas,
    as ``Localizer`` embeds a client's exemplars -> ``[N, D]`` on the embedder's device; ``grad`` keeps the
    gradient (stage 1's ``shuffle_exemplar`` anchor). Uses the carried crop features when there are any."""
    data = data if idx is None else data.subset(idx)
    emb, spec = bundle.embedder, bundle.config.input
    with torch.set_grad_enabled(grad):
        if data.crop_feats is not None and data.crop_boxes is not None:
            return emb.embed(data.crop_feats, data.crop_boxes[:, None])[:, 0]
        canvases, boxes = exemplar_canvas(exemplar_crops(data), spec)
        feats = emb.features(normalize(canvases.to(bundle.device), spec))
        return emb.embed(feats, boxes.to(bundle.device)[:, None])[:, 0]


def prototype_of(bundle: Bundle, data: LabeledImages) -> Tensor:
    """The prototype of ``data``'s ground-truth crops: their mean exemplar embedding -> ``[D]``."""
    return crop_embeddings(bundle, data).mean(0)


def prototypes_for(bundle: Bundle, exemplars: LabeledImages, data: LabeledImages) -> Tensor:
    """The prototype each image of ``data`` is localized with: ``prototype_of(exemplars)`` ``[D]`` for data of one
    kind; for data of several kinds (``classes``), the mean embedding of the exemplars of each image's own kind
    ``[N, D]``."""
    if data.classes is None:
        return prototype_of(bundle, exemplars)
    if exemplars.classes is None:
        raise ValueError("data of several kinds needs exemplars labeled with the same kinds (LabeledImages.classes)")
    emb = crop_embeddings(bundle, exemplars)
    kinds = int(max(int(data.classes.max()), int(exemplars.classes.max()))) + 1
    ex_classes = exemplars.classes.to(emb.device)
    sums = torch.zeros(kinds, emb.shape[1], device=emb.device, dtype=emb.dtype).index_add(0, ex_classes, emb)
    counts = torch.bincount(ex_classes, minlength=kinds)
    missing = set(data.classes.unique().tolist()) - set(counts.nonzero().flatten().tolist())
    if missing:
        raise ValueError(f"no exemplars of kinds {sorted(missing)}")
    return (sums / counts.clamp(min=1)[:, None].to(emb.dtype))[data.classes.to(emb.device)]
