"""Peak RSS of the API under concurrent localize requests of large JPEGs (issue 12: bounded memory).

Starts the API (``uvicorn --factory app.main:create_app``) on the embedded default in a subprocess, from
each checkout given (``--repo``, e.g. this one and ``git worktree add /tmp/qloc-before HEAD``; every one runs
with this Python), with a fresh SQLite database and blob directory and the shipped bundles (``bundles/``);
registers an exemplar set (the default bundle, ``mnist-digit4``), sends one small warm-up localize, then
``--concurrency`` localize requests at once, each of ``--images`` photo-like RGB JPEGs of ``--side`` x
``--side`` pixels (gradients, blobs and noise at quality 95: about 7.5 MB each at 4000 px). The server's RSS
is sampled with psutil every 10 ms. Prints JSON: per checkout, idle RSS (after the warm-up), peak RSS during
the burst, their difference, each request's status and seconds.

    .venv/bin/python benchmarks/upload_memory.py --repo /tmp/qloc-before --repo . --out runs/upload_memory.json

``--fidelity`` instead measures what decoding downscaled changes in the bundles' input (no server).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import psutil
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _client import wait_compiled  # noqa: E402

HERE = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024


def photo_jpeg(side: int, seed: int, quality: int = 95) -> bytes:
    """A photo-like RGB JPEG: smooth colour gradients, a few bright blobs, sensor-like noise."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 1, side, dtype=np.float32)[None, :]
    y = np.linspace(0, 1, side, dtype=np.float32)[:, None]
    f = rng.uniform(2, 8, 3)
    img = np.empty((side, side, 3), np.uint8)
    img[..., 0] = np.sin(f[0] * x + seed) * 90 + 90
    img[..., 1] = np.cos(f[1] * y) * 90 + 90
    img[..., 2] = x * y * 180
    for _ in range(6):
        cx, cy, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.03, 0.15)
        img[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.integers(60, 250, 3)
    noise = rng.integers(-15, 16, img.shape, dtype=np.int16)
    img = (img + noise).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def crop_png() -> bytes:
    arr = np.zeros((28, 28), np.uint8)
    arr[6:22, 10:18] = 230
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sampler(threading.Thread):
    """Samples a process's RSS every ``interval`` seconds; ``peak`` since the last ``reset``."""

    def __init__(self, pid: int, interval: float = 0.01):
        super().__init__(daemon=True)
        self.proc, self.interval = psutil.Process(pid), interval
        self.peak = self.last = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.last = self.proc.memory_info().rss
            except psutil.Error:
                return
            self.peak = max(self.peak, self.last)
            time.sleep(self.interval)

    def reset(self) -> None:
        self.peak = self.last


def run_one(repo: Path, images: list[bytes], concurrency: int, env_extra: dict[str, str]) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="qloc-mem-"))
    env = {**os.environ, "QLOC_DATABASE_URL": f"sqlite:///{tmp}/qloc.db",
           "QLOC_BROKER_URL": f"sqla+sqlite:///{tmp}/broker.db", "QLOC_STORAGE_DIR": str(tmp / "blobs"),
           "QLOC_BUNDLE_DIR": str(HERE / "bundles"), "QLOC_DEVICE": "cpu", **env_extra}
    bin_dir = Path(sys.executable).parent
    subprocess.run([str(bin_dir / "alembic"), "upgrade", "head"], cwd=repo, env=env, check=True,
                   capture_output=True)
    port = free_port()
    log = open(tmp / "api.log", "wb")  # noqa: SIM115 -- closed below
    api = subprocess.Popen([str(bin_dir / "uvicorn"), "--factory", "app.main:create_app", "--port", str(port),
                            "--log-level", "warning"], cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise RuntimeError(f"API not ready: {(tmp / 'api.log').read_text()[-3000:]}")
        with httpx.Client(base_url=base, timeout=600) as c:
            r = c.post("/v1/exemplar-sets", files=[("files", ("crop.png", crop_png(), "image/png"))])
            r.raise_for_status()
            url = f"/v1/exemplar-sets/{r.json()['id']}/localize"
            warm = c.post(url, files=[("files", ("w.jpg", photo_jpeg(640, 99), "image/jpeg"))])
            warm.raise_for_status()
        compiled_after_s = wait_compiled(base, repo)  # idle: after the episode's compile, where the tree has one
        sampler = Sampler(api.pid)
        sampler.start()
        time.sleep(1.0)
        idle = sampler.last
        sampler.reset()
        files = [("files", (f"{i}.jpg", b, "image/jpeg")) for i, b in enumerate(images)]

        def one(i: int) -> dict:
            t = time.perf_counter()
            try:
                with httpx.Client(base_url=base, timeout=600) as c:
                    r = c.post(url, files=files)
                status, detail = r.status_code, (r.json().get("detail") if r.status_code >= 400 else None)
            except httpx.HTTPError as e:
                status, detail = None, f"{type(e).__name__}: {e}"
            return {"status": status, "seconds": round(time.perf_counter() - t, 2),
                    **({"detail": detail} if detail else {})}

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            answers = list(pool.map(one, range(concurrency)))
        wall = time.perf_counter() - t0
        time.sleep(0.2)
        sampler.stopped.set()
        alive = api.poll() is None
        return {"repo": str(repo), "idle_rss_mib": round(idle / MiB), "peak_rss_mib": round(sampler.peak / MiB),
                "peak_minus_idle_mib": round((sampler.peak - idle) / MiB), "requests": answers,
                "wall_s": round(wall, 1), "api_alive_after": alive, "compiled_after_s": compiled_after_s}
    finally:
        api.terminate()
        try:
            api.wait(30)
        except subprocess.TimeoutExpired:
            api.kill()
        log.close()


def fidelity(side: int) -> list[dict]:
    """How far the bundle's input drifts when an image is decoded downscaled: for each decode side, the largest
    and mean absolute difference (0-255 levels) of ``preprocess``'s output from the full-resolution decode's,
    at both shipped input sizes (84 px grayscale, 224 px RGB), and the decode's seconds (median of 3)."""
    import statistics

    from app.images import UploadLimits, decode_image
    from models.config import InputSpec
    from models.inference import preprocess

    data = photo_jpeg(side, 0)
    limits = UploadLimits(len(data), side * side)
    rows = []
    for size, channels in ((84, 1), (224, 3)):
        spec = InputSpec(channels=channels, size=size)
        ref = None
        for max_side in (None, 1792, 896, 448, size):
            times = []
            for _ in range(3):
                t = time.perf_counter()
                im = decode_image(data, filename=None, declared_type=None, limits=limits, max_side=max_side)
                times.append(time.perf_counter() - t)
            x01 = preprocess([im.image], spec)[0]
            ref = x01 if ref is None else ref
            d = (x01 - ref).abs() * 255
            rows.append({"input": size, "decode_max_side": max_side or side, "max_diff": round(float(d.max()), 2),
                         "mean_diff": round(float(d.mean()), 3), "decode_s": round(statistics.median(times), 3)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", action="append", type=Path, help="checkout to run the API from (repeatable)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--images", type=int, default=16)
    p.add_argument("--side", type=int, default=4000)
    p.add_argument("--env", action="append", default=[], help="extra NAME=VALUE for the API (repeatable)")
    p.add_argument("--out", type=Path)
    p.add_argument("--fidelity", action="store_true", help="only measure decode fidelity and time (no server)")
    args = p.parse_args()
    if args.fidelity:
        print(json.dumps(fidelity(args.side), indent=1))
        return
    t = time.perf_counter()
    images = [photo_jpeg(args.side, seed) for seed in range(args.images)]
    sizes = [len(b) for b in images]
    print(f"{len(images)} JPEGs of {args.side}x{args.side}: {min(sizes) / 1e6:.2f}-{max(sizes) / 1e6:.2f} MB "
          f"(made in {time.perf_counter() - t:.0f} s)", file=sys.stderr)
    extra = dict(kv.split("=", 1) for kv in args.env)
    result = {"images": args.images, "side": args.side, "concurrency": args.concurrency,
              "jpeg_mb": [round(min(sizes) / 1e6, 2), round(max(sizes) / 1e6, 2)], "runs": []}
    for repo in args.repo or [HERE]:
        run = run_one(repo.resolve(), images, args.concurrency, extra)
        print(json.dumps(run), file=sys.stderr)
        result["runs"].append(run)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
