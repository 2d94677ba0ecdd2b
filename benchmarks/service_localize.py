"""Localize latency (p50 / p95 at 1 and 32 images per request) and throughput under concurrent clients.

Against a running service, by default the embedded one that ``./scripts/run`` starts:

    ./scripts/run &                      # wait for http://127.0.0.1:8000/readyz
    .venv/bin/python benchmarks/service_localize.py --out runs/bench-localize.json

Images are cMNIST test images (84 x 84 grayscale PNGs) of ``--digit``; the exemplar set is made of
ground-truth crops of that digit. Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _client import client, emit, multipart, percentiles, to_png  # noqa: E402

from models.core.metrics import corloc  # noqa: E402
from models.data.types import exemplar_crops  # noqa: E402
from models.experiments.cmnist import cmnist  # noqa: E402


def latency(c, url: str, images: list[bytes], batch: int, requests: int, warmup: int = 2) -> dict:
    times = []
    for i in range(warmup + requests):
        start = (i * batch) % max(1, len(images) - batch)
        t0 = time.perf_counter()
        r = c.post(url, files=multipart(images[start:start + batch]))
        dt = time.perf_counter() - t0
        r.raise_for_status()
        if i >= warmup:
            times.append(dt)
    return {"images_per_request": batch, **percentiles(times)}


def api_corloc(c, url: str, digit: int, n: int, batch: int = 50) -> dict:
    """CorLoc of the boxes the API returns for ``n`` test images (the CLI's ``evaluate`` draws the same ones)."""
    test = cmnist(digit, "test", n, seed=0)
    boxes = []
    for i in range(0, n, batch):
        r = c.post(url, files=multipart([to_png(t) for t in test.images[i:i + batch]]))
        r.raise_for_status()
        boxes += [res["box"] for res in r.json()["results"]]
    return {"images": n, "corloc": corloc(torch.tensor(boxes), test.boxes)}


def throughput(base: str, api_key: str | None, url: str, images: list[bytes], clients: int, batch: int,
               seconds: float) -> dict:
    done, errors, lat = [0], [0], []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def run(k: int) -> None:
        with client(base, api_key) as c:
            i = k
            while time.monotonic() < stop:
                start = (i * batch) % max(1, len(images) - batch)
                t0 = time.perf_counter()
                r = c.post(url, files=multipart(images[start:start + batch]))
                dt = time.perf_counter() - t0
                with lock:
                    if r.status_code == 200:
                        done[0] += 1
                        lat.append(dt)
                    else:
                        errors[0] += 1
                i += clients

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"clients": clients, "images_per_request": batch, "requests": done[0], "errors": errors[0],
            "requests_per_s": round(done[0] / wall, 2), "images_per_s": round(done[0] * batch / wall, 1),
            **(percentiles(lat) if lat else {})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key")
    p.add_argument("--bundle", help="bundle name (default: the server's)")
    p.add_argument("--digit", type=int, default=4)
    p.add_argument("--requests", type=int, default=50, help="timed requests per batch size")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--throughput-batch", type=int, default=1)
    p.add_argument("--seconds", type=float, default=15.0, help="per concurrency level")
    p.add_argument("--corloc-images", type=int, default=500,
                   help="CorLoc through the API on this many test images (compare: qloc evaluate --n-test N)")
    p.add_argument("--samples", type=int, help="localize's best-of-N search (default: the server's setting)")
    p.add_argument("--out")
    a = p.parse_args()

    ex = cmnist(a.digit, "train", 5, seed=1000)
    test = cmnist(a.digit, "test", 256, seed=0)
    crops = [to_png(t) for t in exemplar_crops(ex)]
    images = [to_png(t) for t in test.images]
    with client(a.url, a.api_key) as c:
        ready = c.get("/readyz")
        ready.raise_for_status()
        r = c.post("/v1/exemplar-sets", files=multipart(crops), data={"name": "benchmark",
                                                                      **({"bundle": a.bundle} if a.bundle else {})})
        r.raise_for_status()
        es = r.json()
        url = f"/v1/exemplar-sets/{es['id']}/localize" + ("" if a.samples is None else f"?samples={a.samples}")
        result = {"url": a.url, "bundle": es["bundle"], "digit": a.digit, "samples": a.samples,
                  "corloc": api_corloc(c, url, a.digit, a.corloc_images),
                  "latency": [latency(c, url, images, b, a.requests) for b in a.batches]}
        result["throughput"] = [throughput(a.url, a.api_key, url, images, n, a.throughput_batch, a.seconds)
                                for n in a.clients]
        c.delete(f"/v1/exemplar-sets/{es['id']}")
    emit(result, a.out)


if __name__ == "__main__":
    main()
