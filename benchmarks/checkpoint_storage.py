"""Bytes a job's checkpoints take in the service's storage: checkpoint files and the heads stored apart (format 6),
against what the same checkpoints took with the head inside each file (formats 3-5: each file plus its head).

Through a running service (``./scripts/run``, whose blobs are under ``--storage``): a set of exemplar crops of a
kind the bundle never saw (a glyph: its reward repair is then kept, and the checkpoints carry a head), one job with
the server's defaults on ``--images`` unlabeled images (``--iterations``, default the server's), then every file
of the set's folder read back (under ``QLOC_JOB_CHECKPOINTS=chosen``, once the job's others are deleted)::

    .venv/bin/python benchmarks/checkpoint_storage.py --storage var --out runs/checkpoint-storage.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _client import client, emit, multipart, to_png  # noqa: E402

from app.inference import BundleRegistry  # noqa: E402
from models.bundle import head_refs  # noqa: E402
from models.data.types import exemplar_crops  # noqa: E402
from models.experiments.datasets import GlyphKind  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key")
    p.add_argument("--storage", type=Path, default=Path("var"), help="the service's QLOC_STORAGE_DIR")
    p.add_argument("--bundle", default="mnist-general")
    p.add_argument("--glyph", default="K")
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--iterations", type=int, help="default: the server's")
    p.add_argument("--out")
    a = p.parse_args()
    bundle = BundleRegistry(Path("bundles"), "cpu").get(a.bundle).bundle
    kind = GlyphKind(a.glyph, "patch")
    crops = exemplar_crops(kind.draw(bundle, "exemplars", 5, 0))
    unlabeled = kind.draw(bundle, "unlabeled", a.images, 0, after=5).images
    with client(a.url, a.api_key) as c:
        r = c.post("/v1/exemplar-sets", files=multipart([to_png(t) for t in crops]), data={"bundle": a.bundle})
        r.raise_for_status()
        sid = r.json()["id"]
        data = {"activate": "false"} | ({"iterations": str(a.iterations)} if a.iterations else {})
        r = c.post(f"/v1/exemplar-sets/{sid}/adaptations", files=multipart([to_png(t) for t in unlabeled]), data=data)
        r.raise_for_status()
        job = r.json()
        while job["status"] in ("queued", "running"):
            time.sleep(1.0)
            job = c.get(f"/v1/adaptations/{job['id']}").json()
        root = a.storage / "exemplar-sets" / sid
        folder = root / "jobs" / job["id"] / "checkpoints"
        deadline = time.monotonic() + 60  # QLOC_JOB_CHECKPOINTS=chosen: the worker deletes the others as the job ends
        while time.monotonic() < deadline:
            rows = c.get(f"/v1/exemplar-sets/{sid}/checkpoints", params={"limit": 200}).json()["data"]
            if len(list(folder.glob("*.pt"))) == sum(r["job_id"] == job["id"] for r in rows):
                break
            time.sleep(0.5)
        heads = {f.name: f.stat().st_size for f in (root / "heads").glob("*.pt")} if (root / "heads").is_dir() else {}
        ckpts = sorted(folder.glob("*.pt"))
        inline = 0
        for f in ckpts:  # the same checkpoint with its heads inside: its file and each head it refers to
            refs = head_refs(f)
            inline += f.stat().st_size + sum(heads[Path(ref["key"]).name] for ref in refs)
        sizes = [f.stat().st_size for f in ckpts]
        stored = sum(sizes) + sum(heads.values())
        c.delete(f"/v1/exemplar-sets/{sid}")
    mb = 1e6
    emit({"bundle": a.bundle, "glyph": a.glyph, "status": job["status"], "iterations": job["params"]["iterations"],
          "reward": (job["validation"] or {}).get("reward"), "checkpoints": len(ckpts),
          "written": len((job["validation"] or {}).get("checkpoints") or []),
          "checkpoint_mb": [round(v / mb, 2) for v in sizes],
          "heads": len(heads), "head_mb": [round(v / mb, 2) for v in heads.values()],
          "stored_mb": round(stored / mb, 1), "heads_inside_mb": round(inline / mb, 1),
          "ratio": round(inline / stored, 2) if stored else None}, a.out)


if __name__ == "__main__":
    main()
