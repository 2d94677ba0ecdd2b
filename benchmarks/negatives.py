"""Benchmark of issue 13 (part 2): negative exemplars on selective localization, cMNIST.

Each test image holds a 4 (the query) and a 9 (a look-alike distractor), ``models.data.cmnist.generate_pair``
(MNIST's test file), with the shipped ``mnist-digit4`` bundle. The set: 5 crops of 4s (train file); its
negative exemplars: 5 crops of 9s (train file). Calibrated as the service calibrates a new set. Reports, with
and without the negatives: CorLoc of the answer (IoU >= 0.5 with the 4) -- without re-ranking the box is the
agent's either way; with ``rerank`` it is the visited box the calibration with negatives likes best -- and
how well the confidence tells right answers from wrong ones (AUROC; the share of wrong answers found).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/negatives.py [--bundle bundles/mnist-general.pt]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.bundle import load_bundle  # noqa: E402
from models.calibration import (  # noqa: E402
    Calibration,
    box_distances,
    calibrate_policy,
    pick,
    score_boxes,
)
from models.core.boxes import paired_iou  # noqa: E402
from models.core.platt import auroc  # noqa: E402
from models.data.cmnist import generate_pair  # noqa: E402
from models.data.types import exemplar_crops  # noqa: E402
from models.experiments.cmnist import cmnist  # noqa: E402
from models.inference import Localizer, preprocess  # noqa: E402

N = 300
K_CANDIDATES = 4


def rerank(localizer: Localizer, images01: torch.Tensor, paths: torch.Tensor, prototype: torch.Tensor,
           negatives: torch.Tensor | None, cal: Calibration) -> tuple[torch.Tensor, ...]:
    """Among the boxes each episode visited (``paths [n, T+1, 4]``, input pixels; the first, the whole image,
    is left out), the one the calibration finds most likely right -> (its index in the path ``[n]``, its
    distance to the prototype ``[n]``, to the nearest negative ``[n]``, its confidence ``[n]``)."""
    d_p, d_n, conf = score_boxes(localizer, images01, paths[:, 1:], prototype, negatives, cal)
    k = conf.argmax(dim=1)
    rows = torch.arange(len(k))
    return k + 1, d_p[rows, k], d_n[rows, k], conf[rows, k]


def main(bundle_path: Path = ROOT / "bundles" / "mnist-digit4.pt") -> None:
    torch.set_num_threads(1)
    loc = Localizer(load_bundle(bundle_path), "cpu")
    nearest = loc.default_nearest
    crops = exemplar_crops(cmnist(4, "train", 5, "patch", 1000))
    proto = loc.prototype(crops)
    neg_crops = exemplar_crops(cmnist(9, "train", 5, "patch", 2000))
    neg = loc.embed_crops(neg_crops).cpu()
    fours, nines = generate_pair((4, 9), "test", n=N, seed=0)
    images = fours.images
    agent = loc.agent()
    ro = loc.run(images, proto, agent, nearest=nearest)
    final, paths = ro.boxes[-1].cpu(), ro.boxes.transpose(0, 1).cpu()
    scores = ro.distances[-1].cpu()
    right = paired_iou(final, fours.boxes) >= 0.5
    on9 = paired_iou(final, nines.boxes) >= 0.5
    rows = []
    t0 = time.perf_counter()
    plain = calibrate_policy(loc, proto, crops, nearest=nearest, n=128, seed=0)
    with_neg = calibrate_policy(loc, proto, crops, nearest=nearest, n=128, seed=0, negative_crops=neg_crops,
                                negative_embeddings=neg)
    cal_s = time.perf_counter() - t0
    conf_plain = plain.confidence(scores).float()
    d_n = box_distances(loc, images, final[:, None], neg)[:, 0].min(-1).values
    conf_neg = with_neg.confidence(scores, d_n).float()
    base = {"images": N, "corloc": round(float(right.float().mean()) * 100, 1),
            "answers_on_the_9": round(float(on9.float().mean()) * 100, 1)}
    for name, conf in (("without negatives", conf_plain), ("with negatives", conf_neg)):
        found = conf >= 0.5
        rows.append({"variant": name, **base, "auroc_confidence": round(auroc(conf, right), 3),
                     "found_when_right": round(float(found[right].float().mean()), 3),
                     "found_when_wrong": round(float(found[~right].float().mean()), 3)})
    t0 = time.perf_counter()
    idx, _, _, conf_r = rerank(loc, images, paths, proto, neg, with_neg)
    rr_s = time.perf_counter() - t0
    picked = paths[torch.arange(N), idx]
    right_r = paired_iou(picked, fours.boxes) >= 0.5
    found = conf_r >= 0.5
    rows.append({"variant": "with negatives + rerank", "images": N,
                 "corloc": round(float(right_r.float().mean()) * 100, 1),
                 "answers_on_the_9": round(float((paired_iou(picked, nines.boxes) >= 0.5).float().mean()) * 100, 1),
                 "auroc_confidence": round(auroc(conf_r.float(), right_r), 3),
                 "found_when_right": round(float(found[right_r].float().mean()), 3),
                 "found_when_wrong": round(float(found[~right_r].float().mean()), 3),
                 "rerank_ms_per_image": round(rr_s / N * 1000, 2)})
    # Re-ranking the several-instances candidates (``max_instances``: the 4 and the 9 are both among them) by the
    # calibration with negatives (its NCC fits: no backbone pass), as ``rerank=true`` does with ``max_instances``.
    batch, scales = preprocess(list(images), loc.spec)
    t0 = time.perf_counter()
    locs = loc.localize_batch(batch, scales, proto, agent, nearest=nearest, max_instances=K_CANDIDATES)
    padded = [list(r.instances) + [r.instances[0]] * (K_CANDIDATES - len(r.instances)) for r in locs]
    cand = torch.tensor([[i.box for i in row] for row in padded])  # [N, K, 4], padded with the first
    cand_scores = torch.tensor([[i.score for i in row] for row in padded])
    valid = torch.tensor([[j < len(r.instances) for j in range(K_CANDIDATES)] for r in locs])
    for name, cal in (("instances + pick (no negatives)", plain), ("with negatives + instances + pick", with_neg)):
        k, conf_p = pick(images, cand, cand_scores, valid, cal)
        picked = cand[torch.arange(N), k]
        right_p = paired_iou(picked, fours.boxes) >= 0.5
        found = conf_p >= 0.5
        rows.append({"variant": name, "images": N, "corloc": round(float(right_p.float().mean()) * 100, 1),
                     "answers_on_the_9": round(float((paired_iou(picked, nines.boxes) >= 0.5).float().mean()) * 100, 1),
                     "auroc_confidence": round(auroc(conf_p.float(), right_p), 3),
                     "found_when_right": round(float(found[right_p].float().mean()), 3),
                     "found_when_wrong": round(float(found[~right_p].float().mean()), 3),
                     "ms_per_image_with_instances": round((time.perf_counter() - t0) / N * 1000, 2)})
    for r in rows:
        print(json.dumps(r), flush=True)
    print(json.dumps({"calibration_seconds_both": round(cal_s, 2)}))


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, default=ROOT / "bundles" / "mnist-digit4.pt")
    main(p.parse_args().bundle)
