"""One image through the model alone: ``Localizer.localize_batch`` at batch 1, greedy, on one or more checkouts.

What a single client's localize request waits for on the engine thread (issue 12's latency floors), without
HTTP. Each ``--tree NAME=DIR`` runs in its own process with ``PYTHONPATH=DIR`` (its own ``models``), one torch
thread, the bundle and images of this checkout; the trees alternate round by round (a shared machine's slow
moment falls on all alike), and each round times every one of ``--images`` cMNIST test images once:

    .venv/bin/python benchmarks/latency_batch1.py --tree before=/tmp/qloc-head --tree after=. --rounds 5

``--compile NAME`` has tree NAME compile its one-image episode first (``Localizer.compile_episode``, what the
API does at start; seconds reported as ``compile_s``): ``--tree eager=. --tree compiled=. --compile compiled``.

Prints JSON: per tree, the median and p95 latency (ms) over every timed call and each round's median;
then the ratios to the first tree, and whether every tree gave the same boxes (``same_boxes``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(bundle: str, images: int, digit: int, compile_episode: bool) -> None:
    """Run in a tree's process: time each image when told on stdin, report the times and boxes as JSON lines."""
    import time

    import torch

    torch.set_num_threads(1)
    from models.bundle import load_bundle
    from models.data.types import exemplar_crops
    from models.experiments.cmnist import cmnist
    from models.inference import Localizer

    loc = Localizer(load_bundle(bundle, torch.device("cpu")), "cpu")
    agent = loc.agent()
    proto = loc.prototype(exemplar_crops(cmnist(digit, "train", 5, seed=1000)))
    x = cmnist(digit, "test", images, seed=0).images
    scales = torch.ones(1, 2)
    compile_s = loc.compile_episode() if compile_episode else None
    for i in range(min(20, images)):  # warm-up
        loc.localize_batch(x[i:i + 1], scales, proto, agent)
    for _ in sys.stdin:
        times, boxes = [], []
        for i in range(images):
            t0 = time.perf_counter()
            r = loc.localize_batch(x[i:i + 1], scales, proto, agent)
            times.append(time.perf_counter() - t0)
            boxes.append(r[0].box)
        print(json.dumps({"times": times, "boxes": boxes, "compile_s": compile_s}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", required=True, metavar="NAME=DIR")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--images", type=int, default=200)
    p.add_argument("--digit", type=int, default=4)
    p.add_argument("--bundle", default=str(ROOT / "bundles/mnist-general.pt"))
    p.add_argument("--compile", action="append", default=[], metavar="NAME",
                   help="tree NAME compiles its one-image episode first")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.bundle, a.images, a.digit, bool(a.compile))
        return
    procs = {}
    for t in a.tree:
        name, d = t.split("=", 1)
        env = {**os.environ, "PYTHONPATH": str(Path(d).resolve()), "OMP_NUM_THREADS": "1"}
        procs[name] = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--child", "--tree", t, "--images", str(a.images),
             "--digit", str(a.digit), "--bundle", a.bundle, *(["--compile", name] if name in a.compile else [])],
            cwd=Path(d).resolve(), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    runs: dict[str, list[dict]] = {name: [] for name in procs}
    try:
        for _ in range(a.rounds):
            for name, proc in procs.items():
                proc.stdin.write("go\n")
                proc.stdin.flush()
                runs[name].append(json.loads(proc.stdout.readline()))
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait(60)
    out: dict = {"images": a.images, "rounds": a.rounds, "cpus": os.cpu_count(), "trees": {}}
    for name, rs in runs.items():
        ms = sorted(1e3 * t for r in rs for t in r["times"])
        out["trees"][name] = {
            "p50_ms": round(statistics.median(ms), 2), "p95_ms": round(ms[int(0.95 * (len(ms) - 1))], 2),
            "round_medians_ms": [round(1e3 * statistics.median(r["times"]), 2) for r in rs],
            "compile_s": rs[0]["compile_s"] and round(rs[0]["compile_s"], 1)}
    names = list(runs)
    out["ratios"] = {f"{n} / {names[0]}, p50": round(out["trees"][n]["p50_ms"] / out["trees"][names[0]]["p50_ms"], 3)
                     for n in names[1:]}
    out["same_boxes"] = all(runs[n][0]["boxes"] == runs[names[0]][0]["boxes"] for n in names[1:])
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
