"""Localization throughput vs encoder-only throughput (same run), and one adaptation's wall time.

    .venv/bin/python benchmarks/speed_mnist.py --bundle bundles/mnist-digit4.pt [--device cpu]

Prints JSON: medians over repeats, images/s at batch 1 and 64 (``--batches``), the ratio localize /
encoder-only, the same for the best-of-16 search (``--samples 15``), on a GPU the greedy episode eager too
(``localize_eager_img_s``: without ``models.compiled``'s CUDA graphs; ``same_boxes``: both gave the same boxes),
and the wall time and peak RSS of one new-digit adaptation (digit 2, 500 unlabeled images, 100 iterations).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import time

import torch

from models.adapt import AdaptConfig, adapt
from models.bundle import load_bundle
from models.data.types import exemplar_crops
from models.evaluate import evaluate_corloc
from models.experiments.cmnist import cmnist
from models.inference import Localizer, normalize, resolve_device


def median_rate(fn, n_images: int, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return n_images / statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bundle", default="bundles/mnist-digit4.pt")
    p.add_argument("--device", default="auto")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--adapt-iterations", type=int, default=100)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64], help="batch sizes to time")
    p.add_argument("--samples", type=int, default=15, help="also time the best-of-(1 + N) search (0: skip)")
    a = p.parse_args()
    dev = resolve_device(a.device)
    bundle = load_bundle(a.bundle, dev)
    loc = Localizer(bundle, dev)
    eager = Localizer(bundle, dev, fast_episode=False)
    data = cmnist(2, "test", max(a.batches), seed=0)
    proto = loc.prototype(exemplar_crops(cmnist(2, "train", 5, seed=1000)))
    agent = loc.agent()
    out: dict = {"device": str(dev), "torch": torch.__version__, "threads": torch.get_num_threads(),
                 "machine": platform.machine(), "processor": platform.processor(),
                      "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None}

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for b in a.batches:
        x = data.images[:b]

        @torch.no_grad()
        def enc(x=x):
            bundle.embedder.features(normalize(x.to(dev), bundle.config.input))
            sync()

        @torch.no_grad()
        def run(x=x):
            loc.run(x, proto, agent)
            sync()

        @torch.no_grad()
        def run_eager(x=x):
            eager.run(x, proto, agent)
            sync()

        @torch.no_grad()
        def best(x=x):
            loc.run(x, proto, agent, samples=a.samples)
            sync()

        enc_rate = median_rate(enc, b, a.repeats)
        loc_rate = median_rate(run, b, a.repeats)
        out[f"batch{b}"] = {"encoder_only_img_s": round(enc_rate, 1), "localize_img_s": round(loc_rate, 1),
                            "ratio": round(loc_rate / enc_rate, 3)}
        if dev.type == "cuda":
            with torch.no_grad():
                same = torch.equal(loc.run(x, proto, agent).boxes, eager.run(x, proto, agent).boxes)
            out[f"batch{b}"].update(localize_eager_img_s=round(median_rate(run_eager, b, a.repeats), 1),
                                    same_boxes=same)
        if a.samples:
            best_rate = median_rate(best, b, a.repeats)
            out[f"batch{b}"][f"best_of_{a.samples + 1}_img_s"] = round(best_rate, 1)
            out[f"batch{b}"][f"best_of_{a.samples + 1}_ratio"] = round(best_rate / enc_rate, 3)
    unl = cmnist(2, "train", 500, seed=1000, offset=5)
    test = cmnist(2, "test", 500, seed=0)
    before, _ = evaluate_corloc(bundle, bundle.new_agent(), test, proto)
    t0 = time.perf_counter()
    res = adapt(bundle, proto, unl.images, AdaptConfig(iterations=a.adapt_iterations, batch_size=64), device=dev)
    adapt_s = time.perf_counter() - t0
    after, _ = evaluate_corloc(bundle, bundle.new_agent(res.agent_state), test, proto)
    total_s = time.perf_counter() - t0
    out["adaptation_digit2"] = {"iterations": a.adapt_iterations, "unlabeled": 500, "adapt_seconds": round(adapt_s, 1),
                                "to_reported_corloc_seconds": round(total_s, 1), "corloc_before": before,
                                "corloc_after": after,
                                "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
