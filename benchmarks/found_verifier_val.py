"""Could a verifier learned on *other* digits tell a new digit from the rest? (issue 13, `found`; validation only)

`found` must tell the query object from look-alikes with 5 exemplars and no labels. Every label-free feature
measured so far stays under 0.9 (BENCHMARKS.md, "How far a better feature could take found"). This asks what a
*learned* verifier would give: a small CNN embedding trained as a prototypical network (5-way 5-shot episodes,
affine augmentation, cosine to the support's mean) on some digit classes, then used, frozen, on a digit it never
saw: 5 exemplars of that digit (the train part of MNIST's train file) make its prototype; 200 validation images of
it and 23 of each other digit (the val part; the test file is not read) are scored by cosine to that prototype.
Printed per query: the best ``min(precision, recall)`` any threshold reaches (a ceiling: a label-free threshold
lands below it), mean over 5 draws of exemplars, beside the same for pixel NCC (the mean over the exemplars, as
`found`'s NCC feature). On the digits' own 28 x 28 frames (ideal boxes): what the agent's boxes give is lower.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/found_verifier_val.py --train 0 1 3 4 6    # ~1.5 min
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/found_verifier_val.py --held-out 7         # train on the 9 others
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.data.cmnist import _source_indices, load_mnist  # noqa: E402
from models.verifier import augment, encoder  # noqa: E402 -- the shipped verifier's net and variations

SHOTS, WAY, QUERIES = 5, 5, 15


def split(x: np.ndarray, y: np.ndarray, part: str) -> tuple[Tensor, Tensor]:
    """The MNIST train file's ``part`` ("train" / "val": ``models.data.cmnist``'s fixed split) as [n, 1, 28, 28]."""
    idx = np.sort(np.concatenate([_source_indices(y, d, part, 0.2) for d in range(10)]))
    return torch.tensor(x[idx], dtype=torch.float32)[:, None] / 255, torch.tensor(y[idx]).long()


def train(x: Tensor, y: Tensor, classes: list[int], iterations: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    net = encoder()
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    idx = {c: (y == c).nonzero().flatten() for c in classes}
    way = min(WAY, len(classes))
    for _ in range(iterations):
        cls = rng.choice(classes, way, replace=False)
        draw = [idx[c][torch.randint(len(idx[c]), (SHOTS + QUERIES,), generator=gen)] for c in cls]
        batch = x[torch.stack(draw)]  # [way, shots + queries, 1, 28, 28]
        e = F.normalize(net(augment(batch.flatten(0, 1), gen)), dim=-1).view(way, SHOTS + QUERIES, -1)
        protos = F.normalize(e[:, :SHOTS].mean(1), dim=-1)
        logits = 10 * e[:, SHOTS:].flatten(0, 1) @ protos.T
        loss = F.cross_entropy(logits, torch.arange(way).repeat_interleave(QUERIES))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net.eval()


def best_min_pr(pos: Tensor, neg: Tensor) -> float:
    """The best ``min(precision, recall)`` of any threshold on scores (higher: more likely positive)."""
    s = torch.cat([pos, neg])
    y = torch.cat([torch.ones(len(pos)), torch.zeros(len(neg))]).bool()[s.argsort(descending=True)]
    tp = y.cumsum(0).float()
    return float(torch.minimum(tp / torch.arange(1, len(y) + 1), tp / y.sum()).max())


def ncc(a: Tensor, b: Tensor) -> Tensor:
    a, b = a.flatten(1), b.flatten(1)
    a, b = F.normalize(a - a.mean(1, keepdim=True), dim=1), F.normalize(b - b.mean(1, keepdim=True), dim=1)
    return a @ b.T


@torch.no_grad()
def evaluate(net: nn.Module, xtr: Tensor, ytr: Tensor, xva: Tensor, yva: Tensor, query: int, draws: int = 5
             ) -> dict[str, float]:
    gen = torch.Generator().manual_seed(1)
    pos = xva[(yva == query).nonzero().flatten()[:200]]
    neg = torch.cat([xva[(yva == d).nonzero().flatten()[:23]] for d in range(10) if d != query])
    ep, en = F.normalize(net(pos), dim=-1), F.normalize(net(neg), dim=-1)
    pixel, learned = [], []
    mine = (ytr == query).nonzero().flatten()
    for _ in range(draws):
        ex = xtr[mine[torch.randperm(len(mine), generator=gen)[:SHOTS]]]
        pixel.append(best_min_pr(ncc(pos, ex).mean(1), ncc(neg, ex).mean(1)))
        proto = F.normalize(F.normalize(net(ex), dim=-1).mean(0), dim=-1)
        learned.append(best_min_pr(ep @ proto, en @ proto))
    return {"pixel_ncc": round(float(np.mean(pixel)), 3), "verifier": round(float(np.mean(learned)), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--train", type=int, nargs="+", help="the digits the verifier learns on")
    g.add_argument("--held-out", type=int, help="learn on the nine other digits, report this one")
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(2)
    x, y = load_mnist("train")
    (xtr, ytr), (xva, yva) = split(x, y, "train"), split(x, y, "val")
    classes = a.train if a.train else [d for d in range(10) if d != a.held_out]
    t0 = time.perf_counter()
    net = train(xtr, ytr, classes, a.iterations, a.seed)
    secs = round(time.perf_counter() - t0, 1)
    for q in range(10) if a.train else [a.held_out]:
        print(json.dumps({"query": q, "new": q not in classes, "trained_on": classes, "train_seconds": secs,
                          **evaluate(net, xtr, ytr, xva, yva, q)}), flush=True)


if __name__ == "__main__":
    main()
