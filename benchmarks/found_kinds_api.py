"""`found` through the API on the served default, one checkout against another in the same run (issue 13; test split).

For each tree (``--tree NAME=PATH``: a checkout, e.g. a ``git worktree`` of the commit before) an API on the embedded
default in a fresh directory (``service_load.Server``), and for each query: an exemplar set of 5 crops (MNIST's train
file) made with every field left to the server, then ``localize`` with the server's defaults on three blocks of
MNIST test images on the patch background -- 198 with the query (``right`` at IoU >= 0.5), 22 of each other kind
("others": `not_found.py`'s look-alike reading) and the same 198 with the object removed ("empty": the literal
reading). Printed per tree and query, one JSON line: the set's ``kind`` (null on a server without the field), CorLoc,
`found` on each block, its precision against others and against empty images, and its recall over the right answers
(`not_found.py`'s definitions). Queries: digits (``--digits``) against other digits, glyphs (``--glyphs``, kinds the
verifier never saw) against the other glyphs given.

    git worktree add -f /tmp/qloc-before <rev>
    .venv/bin/python benchmarks/found_kinds_api.py --tree before=/tmp/qloc-before --tree after=. \\
        [--digits 0 1 ... 9] [--glyphs K A ? W] [--rerank false] [--split val]     # ~3 min per tree
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _client import client, multipart, to_png  # noqa: E402
from found_absent_val import removed  # noqa: E402
from service_load import Server  # noqa: E402

from models.core.boxes import paired_iou  # noqa: E402
from models.data.glyphs import glyphs  # noqa: E402
from models.data.types import exemplar_crops  # noqa: E402
from models.experiments.cmnist import cmnist  # noqa: E402

N_POS, PER_OTHER, BATCH = 198, 22, 32


def draw(kind: str, split: str, n: int, seed: int):
    return cmnist(int(kind), split, n, "patch", seed) if kind.isdigit() else glyphs(kind, split, n, "patch", seed)


def query(http, kind: str, others: list[str], params: dict, split: str = "test", raw: list | None = None) -> dict:
    crops = exemplar_crops(draw(kind, "train", 5, 1000))
    r = http.post("/v1/exemplar-sets", files=multipart([to_png(c) for c in crops]))
    r.raise_for_status()
    es = r.json()
    pos = draw(kind, split, N_POS, 0)
    blocks = {"with": pos.images, "others": torch.cat([draw(o, split, PER_OTHER, 0).images for o in others]),
              "empty": removed(pos.images, pos.boxes, "patch")}
    results = {}
    for name, images in blocks.items():
        out = []
        for i in range(0, len(images), BATCH):
            r = http.post(f"/v1/exemplar-sets/{es['id']}/localize", params=params,
                          files=multipart([to_png(x) for x in images[i:i + BATCH]]))
            r.raise_for_status()
            out += r.json()["results"]
        results[name] = out
    http.delete(f"/v1/exemplar-sets/{es['id']}").raise_for_status()
    right = paired_iou(torch.tensor([a["box"] for a in results["with"]]), pos.boxes) >= 0.5
    if raw is not None:  # every answer, for replaying rules offline
        raw += [{"query": kind, "block": k, "confidence": a["confidence"], "reranked": bool(a.get("reranked")),
                 "right": bool(right[i]) if k == "with" else False}
                for k, v in results.items() for i, a in enumerate(v)]
    found = {k: torch.tensor([bool(a["found"]) for a in v]) for k, v in results.items()}
    tp = int((found["with"] & right).sum())
    called = int(found["with"].sum())
    return {"query": kind, "kind": es.get("kind"), "corloc": round(float(right.float().mean()) * 100, 1),
            "found_with": round(float(found["with"].float().mean()), 3),
            "found_on_others": round(float(found["others"].float().mean()), 3),
            "found_on_empty": round(float(found["empty"].float().mean()), 3),
            "precision_vs_others": round(tp / max(1, called + int(found["others"].sum())), 3),
            "precision_vs_empty": round(tp / max(1, called + int(found["empty"].sum())), 3),
            "recall": round(tp / max(1, int(right.sum())), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH of a checkout")
    p.add_argument("--digits", nargs="*", default=[str(d) for d in range(10)])
    p.add_argument("--glyphs", nargs="*", default=["K", "A", "?", "W"])
    p.add_argument("--rerank", help="localize's rerank (default: the server's)")
    p.add_argument("--split", default="test", choices=("test", "val"), help="the images' split (val: for choices)")
    p.add_argument("--raw", help="also write every answer (query, block, confidence, reranked, right) as JSON lines")
    a = p.parse_args()
    params = {"rerank": a.rerank} if a.rerank else {}
    raw: list | None = [] if a.raw else None
    torch.set_num_threads(1)
    for spec in a.tree:
        name, path = spec.split("=", 1)
        server = Server(name, Path(path), {})
        try:
            server.wait_ready()
            with client(server.url, None) as http:
                for d in a.digits:
                    row = query(http, d, [o for o in map(str, range(10)) if o != d], params, a.split, raw)
                    print(json.dumps({"tree": name, "split": a.split, **params, **row}), flush=True)
                for g in a.glyphs:
                    row = query(http, g, [o for o in a.glyphs if o != g], params, a.split, raw)
                    print(json.dumps({"tree": name, "split": a.split, **params, **row}), flush=True)
        finally:
            server.stop()
    if a.raw and raw is not None:
        Path(a.raw).write_text("".join(json.dumps(r) + "\n" for r in raw))


if __name__ == "__main__":
    main()
