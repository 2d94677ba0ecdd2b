"""Deformation-tolerant matching for `found` on new digits (issue 13; validation only).

Pixel NCC with 5 exemplars tells a new digit from the other nine at best ``min(precision, recall)`` 0.57-0.84
(BENCHMARKS.md, "How far a better feature could take found"). Handwriting varies by small local shifts, which
nearest-neighbour MNIST classifiers absorb with the image distortion model (IDM; Keysers et al., PAMI 2007): each
pixel of the test image, with its 3 x 3 context (the pixel, or the pixel and its Sobel gradients), may match the
exemplar's at any position within ``w`` pixels; the distance is the sum over pixels of the best match. Per query,
5 exemplars from the train part of MNIST's train file, 200 images of the digit and 23 of each other digit from its
val part (the test file is not read), on the digits' own 28 x 28 frames (ideal boxes); the score is minus the IDM
distance to the nearest exemplar (``min``) or to all (``mean``), beside the NCC (mean / max over exemplars); printed:
the best ``min(precision, recall)`` of any threshold (a ceiling), mean over 3 draws of exemplars.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/found_idm_val.py      # ~1 min
"""

from __future__ import annotations

import json

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from found_verifier_val import best_min_pr, ncc, split
from torch import Tensor

from models.data.cmnist import load_mnist

SOBEL = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]])[None, None] / 8


def context(images: Tensor, gradients: bool) -> Tensor:
    """``[n, 1, H, W]`` -> the channels matched: the pixels, and with ``gradients`` their Sobel x / y too."""
    if not gradients:
        return images
    gx, gy = F.conv2d(images, SOBEL, padding=1), F.conv2d(images, SOBEL.transpose(2, 3), padding=1)
    return torch.cat([images, gx, gy], 1)


def idm(test: Tensor, exemplars: Tensor, w: int, gradients: bool) -> Tensor:
    """IDM distances ``[n, k]`` of ``test [n, 1, H, W]`` to ``exemplars [k, 1, H, W]`` (3 x 3 context, shifts <= w)."""
    ft, fe = context(test, gradients), context(exemplars, gradients)
    size = test.shape[-1]
    patches = F.unfold(ft, 3, padding=1)  # [n, D, H*W]
    shifted = F.unfold(F.pad(fe, (w, w, w, w)), 3, padding=1).view(len(exemplars), -1, size + 2 * w, size + 2 * w)
    out = torch.empty(len(test), len(exemplars))
    for j in range(len(exemplars)):  # over the 5 exemplars and the (2w + 1)^2 shifts: each a batched step
        best = torch.full((len(test), size * size), float("inf"))
        for dy in range(2 * w + 1):
            for dx in range(2 * w + 1):
                ref = shifted[j, :, dy:dy + size, dx:dx + size].reshape(1, -1, size * size)
                best = torch.minimum(best, ((patches - ref) ** 2).sum(1))
        out[:, j] = best.sum(1)
    return out


def main() -> None:
    x, y = load_mnist("train")
    xtr, ytr = split(x, y, "train")
    xva, yva = split(x, y, "val")
    gen = torch.Generator().manual_seed(0)
    results = {}
    for query in (2, 5, 7, 8, 9):
        rows = []
        for _ in range(3):
            pool = (ytr == query).nonzero().flatten()
            ex = xtr[pool[torch.randperm(len(pool), generator=gen)[:5]]]
            def draw(digit: int, n: int) -> Tensor:
                at = (yva == digit).nonzero().flatten()
                return xva[at[torch.randperm(len(at), generator=gen)[:n]]]

            pos = draw(query, 200)
            neg = torch.cat([draw(d, 23) for d in range(10) if d != query])
            row = {}
            n_pos, n_neg = ncc(pos, ex), ncc(neg, ex)
            row["ncc_mean"] = best_min_pr(n_pos.mean(1), n_neg.mean(1))
            row["ncc_max"] = best_min_pr(n_pos.max(1).values, n_neg.max(1).values)
            for w in (1, 2):
                for grad in (False, True):
                    d_pos, d_neg = idm(pos, ex, w, grad), idm(neg, ex, w, grad)
                    name = f"idm_w{w}_{'grad' if grad else 'pixel'}"
                    row[f"{name}_min"] = best_min_pr(-d_pos.min(1).values, -d_neg.min(1).values)
                    row[f"{name}_mean"] = best_min_pr(-d_pos.mean(1), -d_neg.mean(1))
            rows.append(row)
        results[query] = {k: round(float(np.mean([r[k] for r in rows])), 3) for k in rows[0]}
        print(query, json.dumps(results[query]), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
