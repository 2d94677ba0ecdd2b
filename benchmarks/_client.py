"""Shared helpers of the service benchmarks: cMNIST images as PNG uploads, an HTTP client, percentiles."""

from __future__ import annotations

import io
import statistics
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image
from torch import Tensor


def to_png(image01: Tensor) -> bytes:
    """``[C, H, W]`` in [0, 1] -> PNG bytes."""
    arr = (image01.clamp(0, 1).numpy() * 255).round().astype(np.uint8)
    return pil_png(Image.fromarray(arr[0]) if arr.shape[0] == 1 else Image.fromarray(arr.transpose(1, 2, 0)))


def pil_png(image: Image.Image) -> bytes:
    """A PIL image -> PNG bytes."""
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def multipart(pngs: list[bytes]) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("files", (f"{i}.png", b, "image/png")) for i, b in enumerate(pngs)]


def client(url: str, api_key: str | None) -> httpx.Client:
    headers = {"X-API-Key": api_key} if api_key else {}
    return httpx.Client(base_url=url, headers=headers, timeout=300)


def percentiles(seconds: list[float]) -> dict[str, float]:
    q = statistics.quantiles(seconds, n=100, method="inclusive") if len(seconds) > 1 else seconds * 99
    return {"n": len(seconds), "p50_ms": round(q[49] * 1000, 1), "p95_ms": round(q[94] * 1000, 1),
            "mean_ms": round(statistics.fmean(seconds) * 1000, 1)}


def emit(result: dict, out: str | None) -> None:
    """Print a benchmark's result as indented JSON, and write it to ``out`` too when given."""
    import json
    from pathlib import Path

    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")


def wait_compiled(url: str, tree: Path, processes: int = 1, timeout: float = 600) -> float | None:
    """Wait until the API at ``url`` (started from checkout ``tree``, ``processes`` processes) has compiled its
    one-image episode in every process, or given up (``QLOC_COMPILE_EPISODE``, counted in ``/metrics``), so that
    a measurement neither includes the compile's CPU nor misses its speed -> seconds waited (``None``: that
    checkout does not compile)."""
    if "qloc_episode_compiles_total" not in (tree / "app/metrics.py").read_text():
        return None
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        done = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("qloc_episode_compiles_total{"))
        if done >= processes:
            return round(time.monotonic() - start, 1)
        time.sleep(1)
    raise RuntimeError(f"{url}: the episode was not compiled after {timeout} s")
