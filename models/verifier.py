"""A verifier of known kinds: "is this box one of the set's objects?" for sets of a kind the bundle was trained on.

`found` is decided by the calibration's fit on a feature of the answer's box (``models.calibration``). For grayscale
bundles that feature is the box's NCC with the exemplars: it tells a digit from an empty background but not from
another digit (cMNIST, a query 4 against images of other digits: precision of `found` 0.66 on `mnist-general`).
A small CNN trained, like a prototypical network, on box contents of the kinds the bundle was trained on tells them
apart (BENCHMARKS.md, "Known kinds"): the set's crops give a prototype; an answer is ``found`` when its box is
likelier the set's kind than any other kind the verifier knows, the background (a class of its own in training) or
the set's negative exemplars -- a softmax over cosines (``KindCheck``), with no fit on synthesized samples.

It applies only where the set is of a kind the verifier knows (``KindVerifier.check``: the set's prototype within
``KNOWN_BAR`` cosine of one of its kinds, chosen on validation sets); elsewhere (new kinds: glyphs, where the
verifier reads worse than the NCC) the calibration's fit is served as before. The verifier is its own file beside
the bundle (``<bundle>.verifier``): the bundle file, which exemplar sets record by sha256, does not change, and a
set's check records the verifier's sha256 (another file: the check is not applied, the fit is).
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn
from torch.nn.utils.fusion import fuse_conv_bn_eval
from torchvision.ops import roi_align

from models.backbones.onednn import OneDnnConvs
from models.backbones.onednn import available as onednn_available
from models.bundle import atomic_write

SIDE = 28
"""Boxes and crops are read at ``SIDE x SIDE``."""
TEMPERATURE = 10.0
"""The softmax's scale on cosines, as in training."""
KNOWN_BAR = 0.92
"""A set is of a known kind when its prototype's cosine with that kind's is at least this. Chosen on validation sets
(``benchmarks/found_kinds_val.py``, the shipped `mnist-general` verifier): 30 glyph kinds the verifier never saw score
0.42-0.87 ('O' 0.866), digit sets 0.94-0.996 on patch and clutter but down to 0.92 on impulse and gaussian (two of
140 digit sets lower, 0.84 and 0.90: they keep the fit)."""
NEGATIVE_BAR = 0.8
"""A negative exemplar whose crop is within this cosine of another known kind than the set's is left out of the check:
that kind's prototype stands for it already, and one crop as a prototype of its own only costs recall. Chosen on
validation sets (queries 4, 2, 7, 9 with 5 crops each of their two look-alike digits, ``found_kinds_val.py
--negatives``): recall with every negative 0.95 / 0.93 / 0.965 / 0.86, with this rule 0.99 / 0.965 / 0.98 / 0.94
(as without negatives), precision 0.99-1.00 either way; 0.92 and 0.7 did no better."""
BACKGROUND = "background"
SUFFIX = ".verifier"
FORMAT = "qloc-verifier"


WIDTHS = (32, 64, 64)
"""The three convolutions' channels (a verifier file records its own)."""


def encoder(channels: int = 1, dim: int = 64, widths: tuple[int, ...] = WIDTHS) -> nn.Sequential:
    def block(i: int, o: int) -> list[nn.Module]:
        return [nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(), nn.MaxPool2d(2)]

    a, b, c = widths
    return nn.Sequential(*block(channels, a), *block(a, b), *block(b, c), nn.Flatten(),
                         nn.Linear(c * (SIDE // 8) ** 2, dim))


def read_boxes(images01: Tensor, boxes: Tensor) -> Tensor:
    """Box contents ``[n * K, C, SIDE, SIDE]`` of ``images01 [n, C, S, S]`` for boxes ``[n, K, 4]`` (input pixels)."""
    n, k = boxes.shape[:2]
    idx = torch.arange(n, dtype=boxes.dtype, device=boxes.device).repeat_interleave(k)[:, None]
    rois = torch.cat([idx, boxes.reshape(-1, 4)], 1).to(images01)
    return roi_align(images01, rois, (SIDE, SIDE), 1.0, -1, True)


def resize_crops(crops: list[Tensor]) -> Tensor:
    """Crops ``[C, h_i, w_i]`` in [0, 1] -> ``[E, C, SIDE, SIDE]`` (bilinear, antialiased)."""
    return torch.cat([F.interpolate(c[None].float(), size=(SIDE, SIDE), mode="bilinear", antialias=True,
                                    align_corners=False) for c in crops])


@dataclass
class KindCheck:
    """A set's check (stored in its calibration, ``to_dict``): its prototype, the prototypes it is weighed against
    (the other known kinds, the background, the set's negative exemplars), the kind it was matched to."""

    prototype: list[float]
    others: list[list[float]]
    kind: str
    known: float
    """The cosine of the set's prototype with ``kind``'s (>= ``KNOWN_BAR``)."""
    verifier: str
    """The sha256 of the verifier file it was made with."""
    temperature: float = TEMPERATURE

    def made_with(self, verifier: KindVerifier | None) -> bool:
        """Whether ``verifier`` is the file this check was made with (another one embeds boxes otherwise)."""
        return verifier is not None and verifier.sha256 == self.verifier

    @cached_property
    def _prototypes(self) -> Tensor:
        return torch.tensor([self.prototype, *self.others], dtype=torch.float64)  # made once per decoded check

    def probability(self, embeddings: Tensor) -> Tensor:
        """Unit embeddings ``[..., D]`` -> ``P(the set's kind)`` ``[...]`` (float64): the softmax over the cosines
        with the set's prototype and the others."""
        return torch.softmax(self.temperature * embeddings.double() @ self._prototypes.T, dim=-1)[..., 0]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KindCheck:
        return cls(**d)


class KindVerifier(nn.Module):
    """The encoder and the prototypes of the kinds it was trained on (``names``; the last is ``BACKGROUND``)."""

    def __init__(self, channels: int, names: list[str], dim: int = 64, widths: tuple[int, ...] = WIDTHS):
        super().__init__()
        self.channels, self.names, self.widths = channels, list(names), tuple(widths)
        self.net = encoder(channels, dim, self.widths)
        self.register_buffer("kinds", torch.zeros(len(names), dim))
        self.sha256: str | None = None
        self._served: tuple[Callable[[Tensor], Tensor], ...] = ()
        """``freeze``'s copy of ``net`` for answers (in a tuple: not a submodule, not in the state dict), batch norms
        folded into the convolutions (the same embeddings to float rounding, ~1.5x faster on the CPU), run on
        oneDNN's tensors where this torch has it (``OneDnnConvs``); empty: ``net`` answers."""

    def freeze(self, onednn: bool | None = None) -> KindVerifier:
        """Eval mode, and answer with a copy of ``net`` with each batch norm folded into its convolution
        (``torch.nn.utils.fusion.fuse_conv_bn_eval``), its convolutions run on oneDNN's tensors (``OneDnnConvs``;
        ``onednn``: ``None`` where ``torch.backends.mkldnn`` is available) -> this verifier. ``load_verifier``
        freezes what it loads."""
        self.eval()
        layers, out = list(self.net), []
        while layers:
            m = layers.pop(0)
            if isinstance(m, nn.Conv2d) and layers and isinstance(layers[0], nn.BatchNorm2d):
                m = fuse_conv_bn_eval(m, layers.pop(0))
            out.append(m)
        folded = nn.Sequential(*out).eval()
        if onednn is None:
            onednn = onednn_available()
        self._served = (OneDnnConvs(folded) if onednn else folded,)
        return self

    def embed(self, x: Tensor) -> Tensor:
        """``[m, C, SIDE, SIDE]`` -> unit embeddings ``[m, D]``."""
        with torch.no_grad():
            if not len(x):
                return x.new_zeros(0, self.kinds.shape[1])
            net = self._served[0] if self._served else self.net
            return F.normalize(net(x.float()), dim=-1)

    def embed_boxes(self, images01: Tensor, boxes: Tensor) -> Tensor:
        """Boxes ``[n, K, 4]`` (input pixels of ``images01 [n, C, S, S]``) -> unit embeddings ``[n, K, D]``."""
        with torch.no_grad():
            return self.embed(read_boxes(images01, boxes)).view(*boxes.shape[:2], -1)

    def nearest_kind(self, crops: list[Tensor]) -> tuple[Tensor, int, float]:
        """A set's crops ``[C, h, w]`` in [0, 1] -> (its prototype ``[D]``, the index of the known kind nearest to
        it, their cosine)."""
        with torch.no_grad():
            proto = F.normalize(self.embed(resize_crops(crops)).mean(0), dim=-1)
            sims = self.kinds[:-1] @ proto  # the background is never a set's kind
            return proto, int(sims.argmax()), float(sims.max())

    def check(self, crops: list[Tensor], negative_crops: list[Tensor] | None = None) -> KindCheck | None:
        """A set's ``KindCheck`` from its crops ``[C, h, w]`` in [0, 1] (and negative exemplars: those not of another
        known kind, ``NEGATIVE_BAR``), or ``None``: the set is not of a kind the verifier knows (``KNOWN_BAR``) or its
        crops are not of its channels."""
        with torch.no_grad():
            if not crops or any(c.shape[0] != self.channels for c in crops):
                return None
            proto, at, known = self.nearest_kind(crops)
            if known < KNOWN_BAR:
                return None
            kinds = self.kinds[:-1]
            others = [torch.cat([kinds[:at], kinds[at + 1:]]), self.kinds[-1:]]
            negs = [c for c in negative_crops or [] if c.shape[0] == self.channels]
            if negs:
                e = self.embed(resize_crops(negs))
                sims = e @ kinds.T
                represented = (sims.max(1).values >= NEGATIVE_BAR) & (sims.argmax(1) != at)  # by another known kind
                others.append(e[~represented])
            return KindCheck(proto.tolist(), torch.cat(others).tolist(), self.names[at], round(known, 4),
                             self.sha256 or "")


def verifier_path(bundle_path: str | os.PathLike) -> Path:
    """Where a bundle's verifier is: ``<bundle dir>/<bundle name>.verifier``."""
    p = Path(bundle_path)
    return p.with_name(p.stem + SUFFIX)


def save_verifier(path: str | os.PathLike, verifier: KindVerifier, provenance: dict[str, Any]) -> str:
    """Write ``verifier`` (plain types) atomically -> the file's sha256."""
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "format_version": 1, "channels": verifier.channels, "names": verifier.names,
                "widths": list(verifier.widths),
                "state": {k: v.cpu() for k, v in verifier.state_dict().items()}, "provenance": provenance}, buf)
    return atomic_write(path, buf.getvalue())


def load_verifier(path: str | os.PathLike) -> KindVerifier:
    """A verifier file -> the verifier (frozen for answers: ``freeze``; CPU; ``sha256`` of the bytes read)."""
    data = Path(path).read_bytes()
    try:
        d = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # torch's unpickler raises many kinds on bytes that are not its format
        raise ValueError(f"{path} is not a qloc verifier file ({type(e).__name__})") from e
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError(f"{path} is not a qloc verifier file")
    v = KindVerifier(int(d["channels"]), list(d["names"]), int(d["state"]["kinds"].shape[1]),
                     tuple(d.get("widths", WIDTHS)))
    v.load_state_dict(d["state"])
    v.sha256 = hashlib.sha256(data).hexdigest()
    return v.freeze()


# --- training (cMNIST: ``qloc train-verifier``)

SHOTS, QUERIES, WAY = 5, 15, 5


def jitter(boxes: Tensor, gen: torch.Generator, amount: float = 0.15) -> Tensor:
    """Boxes ``[n, 4]`` shifted by up to ``amount`` of their side and scaled by ``1 +- amount``: an agent's answer."""
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    r = (torch.rand(len(boxes), 3, generator=gen) * 2 - 1) * amount
    cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2 + r[:, 0] * w, (boxes[:, 1] + boxes[:, 3]) / 2 + r[:, 1] * h
    s = 1 + r[:, 2]
    return torch.stack([cx - s * w / 2, cy - s * h / 2, cx + s * w / 2, cy + s * h / 2], 1)


def background_boxes(boxes: Tensor, size: int, gen: torch.Generator, tries: int = 16) -> Tensor:
    """For each object box ``[n, 4]``, a box of an object's size elsewhere on the ``size`` canvas that barely
    overlaps it (IoU < 0.05; the best of ``tries`` random ones): the background class's examples."""
    n = len(boxes)
    side = (boxes[:, 2:] - boxes[:, :2]).mean(1, keepdim=True) * (0.8 + 0.6 * torch.rand(n, tries, generator=gen))
    x = torch.rand(n, tries, generator=gen) * (size - side)
    y = torch.rand(n, tries, generator=gen) * (size - side)
    cand = torch.stack([x, y, x + side, y + side], -1)  # [n, tries, 4]
    b = boxes[:, None]
    iw = (torch.minimum(cand[..., 2], b[..., 2]) - torch.maximum(cand[..., 0], b[..., 0])).clamp(min=0)
    ih = (torch.minimum(cand[..., 3], b[..., 3]) - torch.maximum(cand[..., 1], b[..., 1])).clamp(min=0)
    area = (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])
    iou = iw * ih / (side ** 2 + area - iw * ih)
    return cand[torch.arange(n), iou.argmin(1)]


def augment(x: Tensor, gen: torch.Generator) -> Tensor:
    """Random rotation (+-0.2 rad), scale (+-15 %), shear and shift: a handwriting's variations."""
    n = len(x)
    a, s = (torch.rand(n, generator=gen) - 0.5) * 0.4, 1 + (torch.rand(n, generator=gen) - 0.5) * 0.3
    th = torch.zeros(n, 2, 3)
    th[:, 0, 0], th[:, 1, 1] = s * torch.cos(a), s * torch.cos(a)
    th[:, 0, 1] = -s * torch.sin(a) + (torch.rand(n, generator=gen) - 0.5) * 0.3
    th[:, 1, 0] = s * torch.sin(a)
    th[:, :, 2] = (torch.rand(n, 2, generator=gen) - 0.5) * 0.2
    return F.grid_sample(x, F.affine_grid(th, list(x.shape), align_corners=False), align_corners=False)


def train_verifier(images: dict[str, Tensor], boxes: dict[str, Tensor], iterations: int = 2000, seed: int = 0,
                   widths: tuple[int, ...] = WIDTHS) -> KindVerifier:
    """Train on each kind's images ``[n, C, S, S]`` in [0, 1] and object boxes ``[n, 4]`` (input pixels): episodes
    of ``WAY`` classes among the kinds and the background (boxes beside the objects), ``SHOTS`` jittered boxes
    each for the prototypes, ``QUERIES`` to classify (cross-entropy on ``TEMPERATURE`` x cosine). Then each kind's
    prototype (and the background's) from up to 200 of its examples."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    names = sorted(images)
    size = next(iter(images.values())).shape[-1]
    all_images, all_boxes = torch.cat([images[k] for k in names]), torch.cat([boxes[k] for k in names])
    bg_boxes = background_boxes(all_boxes, size, gen)
    pools = {k: (images[k], boxes[k]) for k in names} | {BACKGROUND: (all_images, bg_boxes)}
    classes = [*names, BACKGROUND]
    channels = all_images.shape[1]
    v = KindVerifier(channels, classes, widths=widths)
    opt = torch.optim.Adam(v.net.parameters(), 1e-3)
    v.net.train()
    way = min(WAY, len(classes))
    for _ in range(iterations):
        pick = rng.choice(len(classes), way, replace=False)
        crops = []
        for c in pick:
            im, bx = pools[classes[c]]
            i = torch.randint(len(im), (SHOTS + QUERIES,), generator=gen)
            crops.append(read_boxes(im[i], jitter(bx[i], gen)[:, None]))
        e = F.normalize(v.net(augment(torch.cat(crops), gen)), dim=-1).view(way, SHOTS + QUERIES, -1)
        protos = F.normalize(e[:, :SHOTS].mean(1), dim=-1)
        loss = F.cross_entropy(TEMPERATURE * e[:, SHOTS:].flatten(0, 1) @ protos.T,
                               torch.arange(way).repeat_interleave(QUERIES))
        opt.zero_grad()
        loss.backward()
        opt.step()
    v.eval()
    with torch.no_grad():
        v.kinds.copy_(torch.stack([F.normalize(v.embed(read_boxes(pools[k][0][:200], pools[k][1][:200, None]))
                                               .mean(0), dim=-1) for k in classes]))
    return v
