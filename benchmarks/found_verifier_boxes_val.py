"""A verifier trained with the general cMNIST bundle's kinds, read on the agent's boxes (issue 13; validation only).

`benchmarks/found_verifier_val.py` showed that a verifier learned on other digits does not reach 0.9 on a *new*
digit, but 0.97-1.00 on digits it was trained on. `mnist-general` is trained on all ten digits, so this asks what
a verifier trained on the same kinds would give *its* users: the prototypical CNN of that script, trained on box
contents of cMNIST train images of all ten digits (the four backgrounds, boxes jittered like an agent's answer,
read at 28 x 28 by ``roi_align``), then used frozen on `mnist-general`'s greedy answers to validation images:

- digit queries (4, 2, 7, 9: kinds the bundle and the verifier were trained on): 200 val images of the query, 22
  of each other digit, patch background;
- glyph queries (kinds neither saw: 8 glyph classes): 200 val images of the glyph, 22 of each other glyph class.

Printed per query: the best ``min(precision, recall)`` of any threshold (a ceiling: a label-free threshold lands
below it) for the served NCC feature (mean NCC with the 5 exemplars, `Templates.ncc`), the verifier's cosine to
the exemplars' mean embedding, and their sum after standardizing each on the query's own images; and ``known``:
the highest cosine of the set's verifier prototype with the trained digits' ones (does the set tell, without
labels, that its kind is one the verifier knows?).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/found_verifier_boxes_val.py     # ~8 min
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from found_verifier_val import augment, best_min_pr, encoder  # noqa: E402
from torchvision.ops import roi_align  # noqa: E402

from models.bundle import load_bundle  # noqa: E402
from models.calibration import answers, calibrate_policy  # noqa: E402
from models.core.boxes import paired_iou  # noqa: E402
from models.data.glyphs import glyphs  # noqa: E402
from models.data.types import exemplar_crops  # noqa: E402
from models.experiments.cmnist import cmnist  # noqa: E402
from models.inference import Localizer  # noqa: E402

SIDE, SHOTS, QUERIES, WAY = 28, 5, 15, 5
BACKGROUNDS = ("patch", "clutter", "impulse", "gaussian")


def read_boxes(images: Tensor, boxes: Tensor) -> Tensor:
    """Box contents ``[n, 1, SIDE, SIDE]`` of ``images [n, 1, 84, 84]`` (one box each)."""
    rois = torch.cat([torch.arange(len(boxes), dtype=torch.float32)[:, None], boxes.float()], 1)
    return roi_align(images.float(), rois, (SIDE, SIDE), 1.0, -1, True)


def jitter(boxes: Tensor, gen: torch.Generator, amount: float = 0.15) -> Tensor:
    """Boxes shifted by up to ``amount`` of their side and scaled by ``1 +- amount`` (an agent's imprecision)."""
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    cx = (boxes[:, 0] + boxes[:, 2]) / 2 + (torch.rand(len(boxes), generator=gen) * 2 - 1) * amount * w
    cy = (boxes[:, 1] + boxes[:, 3]) / 2 + (torch.rand(len(boxes), generator=gen) * 2 - 1) * amount * h
    s = 1 + (torch.rand(len(boxes), generator=gen) * 2 - 1) * amount
    return torch.stack([cx - s * w / 2, cy - s * h / 2, cx + s * w / 2, cy + s * h / 2], 1)


def train(iterations: int, per: int, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    data = {d: [cmnist(d, "train", per, bg, seed) for bg in BACKGROUNDS] for d in range(10)}
    images = {d: torch.cat([b.images for b in data[d]]) for d in range(10)}
    boxes = {d: torch.cat([b.boxes for b in data[d]]) for d in range(10)}
    net = encoder()
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    for _ in range(iterations):
        cls = rng.choice(10, WAY, replace=False)
        crops = []
        for c in cls:
            i = torch.randint(len(images[c]), (SHOTS + QUERIES,), generator=gen)
            crops.append(read_boxes(images[c][i], jitter(boxes[c][i], gen)))
        x = augment(torch.cat(crops), gen)
        e = F.normalize(net(x), dim=-1).view(WAY, SHOTS + QUERIES, -1)
        protos = F.normalize(e[:, :SHOTS].mean(1), dim=-1)
        loss = F.cross_entropy(10 * e[:, SHOTS:].flatten(0, 1) @ protos.T,
                               torch.arange(WAY).repeat_interleave(QUERIES))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net.eval()


@torch.no_grad()
def kind_prototypes(net: nn.Module, per: int = 100) -> Tensor:
    """The verifier's prototype of each trained digit ``[10, D]`` (train images' true boxes, patch): a set whose
    exemplars sit near one of them is of a kind the verifier knows."""
    out = []
    for d in range(10):
        b = cmnist(d, "train", per, "patch", 7)
        out.append(F.normalize(F.normalize(net(read_boxes(b.images, b.boxes)), dim=-1).mean(0), dim=-1))
    return torch.stack(out)


def standardized(x: Tensor) -> Tensor:
    return (x - x.mean()) / x.std().clamp(min=1e-9)


@torch.no_grad()
def query(loc: Localizer, net: nn.Module, make, kind, others: list, kinds: Tensor) -> dict:
    """``make(kind, split, n, seed)`` -> LabeledImages; the query ``kind`` against ``others``."""
    ex = make(kind, "train", 5, 1000)
    crops = exemplar_crops(ex)
    proto = loc.prototype(crops)
    cal = calibrate_policy(loc, proto, crops, nearest=loc.default_nearest, n=128, seed=0)
    pos = make(kind, "val", 200, 0)
    neg = torch.cat([make(o, "val", 22, 0).images for o in others])
    agent = loc.agent()
    bp, _ = answers(loc, agent, proto, pos.images, nearest=loc.default_nearest)
    bn, _ = answers(loc, agent, proto, neg, nearest=loc.default_nearest)
    right = paired_iou(bp, pos.boxes) >= 0.5
    ncc_p, ncc_n = cal.templates.ncc(pos.images, bp[:, None])[0][:, 0], cal.templates.ncc(neg, bn[:, None])[0][:, 0]
    vproto = F.normalize(F.normalize(net(read_boxes(ex.images, ex.boxes)), dim=-1).mean(0), dim=-1)
    ver_p = F.normalize(net(read_boxes(pos.images, bp)), dim=-1) @ vproto
    ver_n = F.normalize(net(read_boxes(neg, bn)), dim=-1) @ vproto
    both = standardized(torch.cat([ncc_p, ncc_n]).float()) + standardized(torch.cat([ver_p, ver_n]).float())

    def ceiling(p: Tensor, n: Tensor) -> float:  # wrong answers on the query's images count as negatives
        return round(best_min_pr(p[right], torch.cat([p[~right], n])), 3)

    return {"query": kind, "corloc": round(float(right.float().mean()) * 100, 1),
            "known": round(float((kinds @ vproto).max()), 3),
            "ncc": ceiling(ncc_p.float(), ncc_n.float()), "verifier": ceiling(ver_p, ver_n),
            "ncc+verifier": ceiling(both[:len(bp)], both[len(bp):])}


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--per", type=int, default=150, help="train images per digit and background")
    a = p.parse_args()
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    net = train(a.iterations, a.per)
    print(json.dumps({"train_seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    kinds = kind_prototypes(net)
    loc = Localizer(load_bundle(ROOT / "bundles" / "mnist-general.pt"), "cpu")

    def digit(d, split, n, seed):
        return cmnist(d, split, n, "patch", seed)

    def glyph(c, split, n, seed):
        return glyphs(c, split, n, "patch", seed)

    for q in (4, 2, 7, 9):
        row = query(loc, net, digit, q, [d for d in range(10) if d != q], kinds)
        print(json.dumps({"kind": "digit (trained)", **row}), flush=True)
    chars = ["A", "K", "e", "?", "R", "W", "g", "#"]
    for q in chars:
        row = query(loc, net, glyph, q, [c for c in chars if c != q], kinds)
        print(json.dumps({"kind": "glyph (new)", **row}), flush=True)


if __name__ == "__main__":
    main()
