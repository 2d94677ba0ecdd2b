"""Shared helpers of the service benchmarks: cMNIST images as PNG uploads, an HTTP client, percentiles."""

from __future__ import annotations

import io
import statistics

import httpx
import numpy as np
from PIL import Image
from torch import Tensor


def to_png(image01: Tensor) -> bytes:
    """``[C, H, W]`` in [0, 1] -> PNG bytes."""
    arr = (image01.clamp(0, 1).numpy() * 255).round().astype(np.uint8)
    img = Image.fromarray(arr[0]) if arr.shape[0] == 1 else Image.fromarray(arr.transpose(1, 2, 0))
    buf = io.BytesIO()
    img.save(buf, "PNG")
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
