"""What leaving out instances mostly inside or around a better one (``models.instances.kept_apart``, the answer's
rule since 2026-12-01) does to several-instances answers: AP50 at K with and without it, and which instances it
drops, on the cMNIST multi-instance images of ``multi_instance.py`` (1-4 instances of the query digit, 0-3 other
digits), as the API answers ``max_instances=K``: the K instances the engine finds, then the rule.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/instances_apart.py --split val --seeds 100 101 \\
        --bundle bundles/mnist-general.pt --cs 0.5 0.6 0.7 0.8 0.9      # the choice of CONTAINED
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/instances_apart.py --split test --seeds 0 1 2 --cs 0.6 \\
        --bundle bundles/mnist-general.pt                                 # once, with the chosen value

Per K: AP50 (``multi_instance.metrics_at``, mean over queries 4 / 2 / 7 / 9 and seeds) without the rule and at each
``--cs``; and at the last ``--cs``, how many instances it drops, how many of those had IoU >= 0.5 with an object no
kept instance finds (a right answer lost), and how many with one a kept instance finds too (a duplicate).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import multi_instance as mi  # noqa: E402

from models.core.boxes import pairwise_iou  # noqa: E402
from models.experiments.baselines import Detections  # noqa: E402
from models.instances import InstanceConfig, kept_apart  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--split", default="val")
    p.add_argument("--seeds", type=int, nargs="+", default=[mi.VAL_SEED])
    p.add_argument("--n", type=int, default=40, help="images per query and seed")
    p.add_argument("--cs", type=float, nargs="+", default=[0.6], help="CONTAINED values to try")
    p.add_argument("--bundle", default="bundles/mnist-general.pt")
    p.add_argument("--digits", type=int, nargs="+", default=[4, 2, 7, 9])
    a = p.parse_args()
    torch.set_num_threads(1)
    setup = mi.Setup(argparse.Namespace(variant="cmnist", bundle=a.bundle, digits=a.digits, photos=None))
    cfg = InstanceConfig()
    methods = mi.Methods(setup, 8, cfg)
    ap: dict = {}
    drops = {k: dict(instances=0, dropped=0, right_lost=0, duplicates=0) for k in (4, 8)}
    for q in setup.queries:
        for seed in a.seeds:
            sc = setup.scene(q, a.split, a.n, seed)
            d = methods.qloc(sc, methods.answer(sc), cfg.nms_iou).det
            for k in (4, 8):
                boxes, dist, valid = d.boxes[:, :k], d.distances[:, :k], d.valid[:, :k]
                ap.setdefault(("none", k), []).append(
                    mi.metrics_at(mi.Run(Detections(boxes, dist, valid, 0), 0, 0), sc.batch.boxes, k)["ap50"])
                for c in a.cs:
                    keep = kept_apart(boxes, valid, c)
                    ap.setdefault((c, k), []).append(
                        mi.metrics_at(mi.Run(Detections(boxes, dist, keep, 0), 0, 0), sc.batch.boxes, k)["ap50"])
                gone = valid & ~keep  # at the last c
                drops[k]["instances"] += int(valid.sum())
                drops[k]["dropped"] += int(gone.sum())
                for i, gt in enumerate(sc.batch.boxes):
                    if len(gt) == 0 or not gone[i].any():
                        continue
                    hit = pairwise_iou(boxes[i], gt) >= 0.5  # [k, G]
                    found = (hit & keep[i][:, None]).any(0)
                    lost = (hit[gone[i]] & ~found).any(1)
                    drops[k]["right_lost"] += int(lost.sum())
                    drops[k]["duplicates"] += int((hit[gone[i]].any(1) & ~lost).sum())
    print(f"bundle {a.bundle}, split {a.split}, seeds {a.seeds}, {a.n} images per query and seed")
    for (c, k), v in sorted(ap.items(), key=lambda x: (x[0][1], str(x[0][0]))):
        print(f"K={k} contained={c}: AP50 {statistics.fmean(v):.4f}")
    for k, t in drops.items():
        print(f"K={k} contained={a.cs[-1]}: {t}")


if __name__ == "__main__":
    main()
