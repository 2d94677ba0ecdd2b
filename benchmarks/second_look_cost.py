"""What the second look (``rerank=auto``) and several instances cost, and whether two checkouts answer alike.

Each ``--tree NAME=DIR`` is a checkout of qloc, started as ``benchmarks/service_load.py`` starts it (its own
``scripts/run api`` on the embedded default, in a fresh directory, all at once, idle but for the one measured):

    git worktree add /tmp/qloc-before <commit>
    .venv/bin/python benchmarks/second_look_cost.py --tree before=/tmp/qloc-before --tree after=. \\
        --out runs/second-look-cost.json

1. **Answers.** Per target (``--targets``, as ``benchmarks/second_look.py``: glyphs and digits on the starting
   policy of the default bundle, where many answers are doubtful), an exemplar set of 5 crops and 200 images of
   ``--split`` (validation by default), localized with the defaults, 50 images per request; every tree's boxes,
   confidences and ``reranked`` flags are compared with the first tree's.
2. **Latency.** One client, one image per request, on the first target's images, for each query in ``--queries``
   (``rerank=auto``, the default; ``rerank=false``, the agent's answer alone; ``max_instances=4``); the trees
   alternate round by round. Per tree and query: p50, mean and p95 over every request of every round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from _client import emit, to_png  # noqa: E402
from service_load import Server  # noqa: E402

from models.bundle import load_bundle  # noqa: E402
from models.data.types import exemplar_crops  # noqa: E402
from models.experiments.datasets import CMnistKind, GlyphKind  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ["glyph:Φ:patch", "glyph:θ:patch", "glyph:δ:patch", "digit:2:clutter", "digit:2:impulse"]
QUERIES = ["rerank=auto", "rerank=false", "max_instances=4"]


def draw(target: str, split: str, seed: int) -> tuple[list[bytes], list[bytes]]:
    """A target's 5 exemplar crops and 200 images of ``split``, as PNGs."""
    what, name, background = target.split(":")
    bundle = load_bundle(ROOT / "bundles" / "mnist-general.pt", "cpu")
    kind = GlyphKind(name, background) if what == "glyph" else CMnistKind(int(name), background)
    crops = exemplar_crops(kind.draw(bundle, "exemplars", 5, seed))
    return [to_png(c) for c in crops], [to_png(x) for x in kind.draw(bundle, split, 200, seed).images]


def make_set(http: httpx.Client, crops: list[bytes]) -> str:
    r = http.post("/v1/exemplar-sets", files=[("files", (f"c{i}.png", c, "image/png")) for i, c in enumerate(crops)])
    r.raise_for_status()
    return r.json()["id"]


def answers(http: httpx.Client, sid: str, images: list[bytes]) -> list[dict]:
    out = []
    for i in range(0, len(images), 50):
        r = http.post(f"/v1/exemplar-sets/{sid}/localize",
                      files=[("files", (f"{k}.png", p, "image/png")) for k, p in enumerate(images[i:i + 50])])
        r.raise_for_status()
        out += [{"box": x["box"], "confidence": x.get("confidence"), "reranked": bool(x.get("reranked"))}
                for x in r.json()["results"]]
    return out


def compare(base: list[dict], other: list[dict]) -> dict:
    return {"images": len(base), "reranked": sum(a["reranked"] for a in other),
            "same_reranked": sum(a["reranked"] == b["reranked"] for a, b in zip(base, other, strict=True)),
            "max_box_difference": max(abs(x - y) for a, b in zip(base, other, strict=True)
                                      for x, y in zip(a["box"], b["box"], strict=True)),
            "max_confidence_difference": max(abs((a["confidence"] or 0) - (b["confidence"] or 0))
                                             for a, b in zip(base, other, strict=True))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", required=True, metavar="NAME=DIR")
    p.add_argument("--targets", nargs="+", default=TARGETS)
    p.add_argument("--split", choices=("val", "test"), default="val")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--queries", nargs="+", default=QUERIES)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out")
    a = p.parse_args()
    trees = [t.split("=", 1) for t in a.tree]
    servers = [Server(name, Path(d), {}) for name, d in trees]
    try:
        for s in servers:
            s.wait_ready()
            s.wait_compiled()
        https = {s.name: httpx.Client(base_url=s.url, timeout=120) for s in servers}
        result: dict = {"trees": dict(trees), "split": a.split, "seed": a.seed, "answers": {}, "latency": {}}
        for target in a.targets:
            crops, images = draw(target, a.split, a.seed)
            got = {name: answers(http, make_set(http, crops), images) for name, http in https.items()}
            base = got[servers[0].name]
            result["answers"][target] = {name: compare(base, g) for name, g in got.items()}
            print(target, result["answers"][target], file=sys.stderr, flush=True)
        crops, images = draw(a.targets[0], a.split, a.seed)
        sets = {name: make_set(http, crops) for name, http in https.items()}
        lat: dict[str, dict[str, list[float]]] = {name: {q: [] for q in a.queries} for name in https}
        for _ in range(a.rounds):
            for name, http in https.items():
                for q in a.queries:
                    for png in images:
                        t0 = time.perf_counter()
                        r = http.post(f"/v1/exemplar-sets/{sets[name]}/localize?{q}",
                                      files=[("files", ("x.png", png, "image/png"))])
                        lat[name][q].append(time.perf_counter() - t0)
                        r.raise_for_status()
        for name, per in lat.items():
            result["latency"][name] = {q: {"requests": len(v), "p50_ms": round(1000 * statistics.median(v), 2),
                                           "mean_ms": round(1000 * statistics.mean(v), 2),
                                           "p95_ms": round(1000 * statistics.quantiles(v, n=20)[-1], 2)}
                                       for q, v in per.items()}
        emit(result, a.out)
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    main()
