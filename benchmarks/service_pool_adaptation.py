"""An adaptation job on an exemplar set's image pool (filled over several requests) against the CLI's adaptation
on the same images: does the service, past the 64 files one request carries, reach the CLI's CorLoc?

Both adapt the same bundle from the same 5 exemplars of cMNIST ``--digit`` on the same ``--unlabeled`` images
(the CLI's own draw: ``qloc adapt``'s exemplars and unlabeled images), with the same iterations, batch size,
learning rate and seed. The service gets the images as PNG uploads into the set's pool over ``--requests``
requests, then one job with ``source=pool`` and ``activate=true`` (its final checkpoint). Both policies are then
scored by the same command, ``qloc evaluate`` on ``--n-test`` test images, with the base policy as reference.
The service's checkpoint file is read from its blob store (``--storage-dir``: the service's QLOC_STORAGE_DIR).
Start the service with QLOC_ADAPT_BATCH_SIZE equal to ``--batch-size``, and a QLOC_MAX_POOL_IMAGES of at least
``--unlabeled`` (the default, 2000, is):

    QLOC_ADAPT_BATCH_SIZE=32 ./scripts/run &
    .venv/bin/python benchmarks/service_pool_adaptation.py --storage-dir var --out runs/bench-pool.json

Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _client import client, emit, multipart, to_png  # noqa: E402

from app.storage import checkpoint_key  # noqa: E402
from models.data.types import exemplar_crops  # noqa: E402
from models.experiments.cmnist import cmnist  # noqa: E402


def qloc(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "models", *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def evaluate(a: argparse.Namespace, policy: str | None) -> float:
    args = ["evaluate", "--bundle", a.bundle, "--digit", str(a.digit), "--exemplars", str(a.exemplars),
            "--n-test", str(a.n_test), "--seed", str(a.seed), "--device", a.device]
    return qloc(*args, *(["--policy", policy] if policy else []))["corloc"]


def via_service(a: argparse.Namespace) -> dict:
    ex = cmnist(a.digit, "train", a.exemplars, seed=a.seed + 1000)  # = qloc adapt's draws
    unl = cmnist(a.digit, "train", a.unlabeled, seed=a.seed + 1000, offset=a.exemplars)
    pngs = [to_png(t) for t in unl.images]
    with client(a.url, a.api_key) as c:
        r = c.post("/v1/exemplar-sets", files=multipart([to_png(t) for t in exemplar_crops(ex)]),
                   data={"name": "pool benchmark", "bundle": Path(a.bundle).stem})
        r.raise_for_status()
        es = r.json()
        t0 = time.perf_counter()
        per = -(-len(pngs) // a.requests)
        for start in range(0, len(pngs), per):
            r = c.post(f"/v1/exemplar-sets/{es['id']}/images", files=multipart(pngs[start:start + per]))
            r.raise_for_status()
        fill = time.perf_counter() - t0
        pool = c.get(f"/v1/exemplar-sets/{es['id']}").json()["num_pool_images"]
        t0 = time.perf_counter()
        r = c.post(f"/v1/exemplar-sets/{es['id']}/adaptations",
                   data={"source": "pool", "iterations": str(a.iterations), "learning_rate": str(a.lr),
                         "seed": str(a.seed), "activate": "true"})
        r.raise_for_status()
        job = r.json()
        while job["status"] in ("queued", "running"):
            time.sleep(0.5)
            job = c.get(f"/v1/adaptations/{job['id']}").json()
        wall = time.perf_counter() - t0
        if job["status"] != "succeeded":
            raise SystemExit(f"the job did not succeed: {json.dumps(job)}")
        ckpt = c.get(f"/v1/checkpoints/{job['checkpoint_id']}").json()
        path = Path(a.storage_dir) / checkpoint_key(es["id"], job["id"], ckpt["iteration"])
        corloc = evaluate(a, str(path))
        c.delete(f"/v1/exemplar-sets/{es['id']}")
    run = (datetime.fromisoformat(job["finished_at"]) - datetime.fromisoformat(job["started_at"])).total_seconds()
    return {"corloc": corloc, "pool_images": pool, "requests": -(-len(pngs) // per), "fill_s": round(fill, 2),
            "job_images": job["params"]["num_images"], "iterations": ckpt["iteration"],
            "stopped_early": (job["validation"] or {}).get("stopped_early"), "verdict": job["verdict"],
            "post_to_done_s": round(wall, 2), "job_run_s": round(run, 2), "mean_reward": job["progress"]["mean_reward"]}


def via_cli(a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        out = qloc("adapt", "--bundle", a.bundle, "--digit", str(a.digit), "--exemplars", str(a.exemplars),
                   "--unlabeled", str(a.unlabeled), "--iterations", str(a.iterations), "--batch-size",
                   str(a.batch_size), "--lr", str(a.lr), "--seed", str(a.seed), "--device", a.device,
                   "--out", f"{d}/policy.pt")
        wall = time.perf_counter() - t0
        corloc = evaluate(a, f"{d}/policy.pt")
    return {"corloc": corloc, "iterations": out["iterations"], "process_wall_s": round(wall, 2),
            "adapt_loop_s": out.get("seconds"), "mean_reward": out.get("mean_reward")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key")
    p.add_argument("--storage-dir", default="var", help="the service's QLOC_STORAGE_DIR (its checkpoint files)")
    p.add_argument("--bundle", default="bundles/mnist-digit4.pt", help="bundle file (served under its stem)")
    p.add_argument("--digit", type=int, default=2)
    p.add_argument("--exemplars", type=int, default=5)
    p.add_argument("--unlabeled", type=int, default=500, help="images put in the pool")
    p.add_argument("--requests", type=int, default=8, help="requests the pool is filled over")
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-test", type=int, default=500)
    p.add_argument("--device", default="cpu", help="for the CLI runs; the worker uses QLOC_DEVICE")
    p.add_argument("--out")
    a = p.parse_args()
    result = {"bundle": a.bundle, "digit": a.digit, "unlabeled": a.unlabeled, "iterations": a.iterations,
              "batch_size": a.batch_size, "lr": a.lr, "seed": a.seed, "n_test": a.n_test,
              "base_corloc": evaluate(a, None), "service": via_service(a), "cli": via_cli(a)}
    result["corloc_difference"] = round(result["service"]["corloc"] - result["cli"]["corloc"], 2)
    emit(result, a.out)


if __name__ == "__main__":
    main()
