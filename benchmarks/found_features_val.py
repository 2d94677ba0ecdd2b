"""How far a better appearance feature could take ``found`` on cMNIST new digits (issue 13), on **validation**
images only (MNIST's train file, images the exemplars and the benchmark's pools do not use; the test file is not
read).

``found`` must tell the query digit from the other nine, given 5 exemplar crops. For each feature of the agent's
answer box, the best ``min(precision, recall)`` any threshold reaches on these labeled images is printed: a
ceiling for a calibration that picks its threshold without labels. The features:

- ``ncc_mean`` / ``ncc_max``: NCC with the exemplars at 16 x 16, 27 jittered reads (``models.calibration``: what
  the service uses);
- ``hog_mean`` / ``hog_max``: cosine of gradient-orientation histograms (9 bins, 8 x 8 cells, 32 x 32 reads);
- ``bb_mean`` / ``bb_max``: cosine of the bundle's own backbone features (avg-pooled to 7 x 7, 28 x 28 reads);
- ``mn_mean`` / ``mn_max``: cosine of ImageNet MobileNetV2 features (stride 16, 64 x 64 read, one read);
- ``combo_oracle``: a logistic regression on all of them fit on half of these *labeled* images and scored on the
  other half -- an upper bound no label-free calibration reaches.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/found_features_val.py   # ~10 min on 2 shared cores
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.backbones.imagenet import IMAGENET_MEAN, IMAGENET_STD, mobilenet_v2_imagenet  # noqa: E402
from models.bundle import load_bundle  # noqa: E402
from models.calibration import answers  # noqa: E402
from models.core.boxes import paired_iou  # noqa: E402
from models.core.platt import fit_platt  # noqa: E402
from models.core.templates import box_contents, box_ncc, jittered, make_templates, mean_ncc  # noqa: E402
from models.data.types import exemplar_crops  # noqa: E402
from models.experiments.cmnist import cmnist  # noqa: E402
from models.inference import Localizer  # noqa: E402

N_POS, PER_OTHER, OFFSET, SEED = 150, 17, 200, 3000


def best_min_pr(score: torch.Tensor, y: torch.Tensor) -> float:
    """The best ``min(precision, recall)`` over every threshold on ``score`` (higher: more likely ``y``)."""
    idx = score.double().argsort(descending=True)
    tp = y[idx].double().cumsum(0)
    k = torch.arange(1, len(y) + 1, dtype=torch.float64)
    return round(float(torch.minimum(tp / k, tp / y.sum()).max()), 3)


def hog(x: torch.Tensor, cells: int = 8, bins: int = 9) -> torch.Tensor:
    """``[N, 1, s, s]`` -> unit gradient-orientation histograms ``[N, bins * cells^2]`` (clipped at 0.2)."""
    gx = F.conv2d(x, torch.tensor([[[[-1.0, 0.0, 1.0]]]]), padding=(0, 1))
    gy = F.conv2d(x, torch.tensor([[[[-1.0], [0.0], [1.0]]]]), padding=(1, 0))
    mag, ang = (gx ** 2 + gy ** 2).sqrt(), torch.atan2(gy, gx) % math.pi
    b = ang / math.pi * bins
    lo, w = b.floor().long() % bins, b - b.floor()
    h = torch.zeros(x.shape[0], bins, *x.shape[-2:])
    h.scatter_add_(1, lo, mag * (1 - w))
    h.scatter_add_(1, (lo + 1) % bins, mag * w)
    v = F.adaptive_avg_pool2d(h, cells).flatten(1)
    v = (v / v.norm(dim=1, keepdim=True).clamp(min=1e-6)).clamp(max=0.2)
    return v / v.norm(dim=1, keepdim=True).clamp(min=1e-6)


def unit(f: torch.Tensor) -> torch.Tensor:
    f = f.flatten(1)
    return f / f.norm(dim=1, keepdim=True).clamp(min=1e-12)


def main() -> None:
    torch.set_num_threads(1)
    bundle = load_bundle(ROOT / "bundles" / "mnist-digit4.pt")
    loc = Localizer(bundle, "cpu")
    agent = loc.agent()
    mnv2 = mobilenet_v2_imagenet().eval()
    mean, std = torch.tensor(IMAGENET_MEAN)[None, :, None, None], torch.tensor(IMAGENET_STD)[None, :, None, None]

    def mn(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return unit(mnv2.features[:14]((x.repeat(1, 3, 1, 1) - mean) / std))

    def bb(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return unit(F.adaptive_avg_pool2d(bundle.embedder.encoder(x), 7))

    def resized(crops: list[torch.Tensor], side: int) -> torch.Tensor:
        return torch.stack([F.interpolate(c[None].float(), size=(side, side), mode="bilinear", antialias=True)[0]
                            for c in crops])

    for q in (7, 2, 9):
        crops = exemplar_crops(cmnist(q, "train", 5, "patch", 1000))
        proto = loc.prototype(crops)
        pos = cmnist(q, "train", N_POS, "patch", SEED, offset=OFFSET)
        others = torch.cat([cmnist(d, "train", PER_OTHER, "patch", SEED, offset=OFFSET).images
                            for d in range(10) if d != q])
        images = torch.cat([pos.images, others])
        boxes, _ = answers(loc, agent, proto, images, nearest=loc.default_nearest)
        right = torch.zeros(len(images), dtype=torch.bool)
        right[:N_POS] = paired_iou(boxes[:N_POS], pos.boxes) >= 0.5
        cols = {}
        n16 = box_ncc(images, boxes[:, None], make_templates(crops, 16))[:, 0]
        cols["ncc_mean"], cols["ncc_max"] = mean_ncc(n16), n16.amax(-1)
        jb = jittered(boxes.float())  # [n, 27, 4]
        for name, fn, side in (("hog", hog, 32), ("bb", bb, 28)):
            reads = box_contents(images, jb, side).flatten(0, 1)
            sim = (fn(reads).view(len(images), jb.shape[1], -1) @ fn(resized(crops, side)).T).amax(1)  # [n, E]
            cols[f"{name}_mean"], cols[f"{name}_max"] = sim.mean(-1), sim.amax(-1)
        sim = mn(box_contents(images, boxes[:, None], 64)[:, 0]) @ mn(resized(crops, 64)).T
        cols["mn_mean"], cols["mn_max"] = sim.mean(-1), sim.amax(-1)
        row = {"query": q, "images": len(images), "right": int(right.sum())}
        row.update({k: best_min_pr(v, right) for k, v in cols.items()})
        x = torch.stack([v.double() for v in cols.values()], 1)
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        a, b = perm[: len(x) // 2], perm[len(x) // 2:]
        row["combo_oracle"] = best_min_pr(fit_platt(x[a], right[a]).probability(x[b]), right[b])
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
