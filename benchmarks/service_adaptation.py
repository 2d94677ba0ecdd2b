"""Adaptation wall time through the service (a job on the worker) against the CLI (``qloc adapt``).

Both adapt the same bundle on the same cMNIST unlabeled images of ``--digit`` with the same number of
iterations and batch size; the service's batch is ``min(QLOC_ADAPT_BATCH_SIZE, images)``, so start
the service with ``QLOC_ADAPT_BATCH_SIZE`` equal to ``--batch-size``:

    QLOC_ADAPT_BATCH_SIZE=32 ./scripts/run &
    .venv/bin/python benchmarks/service_adaptation.py --bundle bundles/mnist-digit4.pt --out runs/bench-adapt.json

Reports, for the service, the time from POST to ``succeeded`` seen by a polling client and the job's
own run time (``finished_at - started_at``); for the CLI, the process's wall time and the adaptation
loop's time it reports. Prints one JSON object (and writes it to ``--out``).
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

from models.data.types import exemplar_crops  # noqa: E402
from models.experiments.cmnist import cmnist  # noqa: E402


def via_service(a: argparse.Namespace) -> dict:
    ex = cmnist(a.digit, "train", a.exemplars, seed=a.seed + 1000)
    unl = cmnist(a.digit, "train", a.unlabeled, seed=a.seed + 1000, offset=a.exemplars)
    with client(a.url, a.api_key) as c:
        r = c.post("/v1/exemplar-sets", files=multipart([to_png(t) for t in exemplar_crops(ex)]),
                   data={"name": "benchmark", "bundle": Path(a.bundle).stem})
        r.raise_for_status()
        es = r.json()
        uploads = multipart([to_png(t) for t in unl.images])
        t0 = time.perf_counter()
        r = c.post(f"/v1/exemplar-sets/{es['id']}/adaptations", files=uploads,
                   data={"iterations": str(a.iterations), "learning_rate": str(a.lr), "seed": str(a.seed),
                         "activate": "false"})
        r.raise_for_status()
        accepted = time.perf_counter() - t0
        job = r.json()
        while job["status"] in ("queued", "running"):
            time.sleep(0.2)
            job = c.get(f"/v1/adaptations/{job['id']}").json()
        wall = time.perf_counter() - t0
        c.delete(f"/v1/exemplar-sets/{es['id']}")
    run = (datetime.fromisoformat(job["finished_at"]) - datetime.fromisoformat(job["started_at"])).total_seconds()
    return {"status": job["status"], "post_to_done_s": round(wall, 2), "upload_and_accept_s": round(accepted, 2),
            "job_run_s": round(run, 2), "mean_reward": job["progress"]["mean_reward"]}


def via_cli(a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "models", "adapt", "--bundle", a.bundle, "--digit", str(a.digit),
               "--exemplars", str(a.exemplars), "--unlabeled", str(a.unlabeled), "--iterations", str(a.iterations),
               "--batch-size", str(a.batch_size), "--lr", str(a.lr), "--seed", str(a.seed), "--device", a.device,
               "--out", f"{d}/policy.pt"]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    reported = json.loads(out.stdout)
    return {"process_wall_s": round(wall, 2), "adapt_loop_s": reported.get("seconds"),
            "mean_reward": reported.get("mean_reward")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key")
    p.add_argument("--bundle", default="bundles/mnist-digit4.pt", help="bundle file (served under its stem)")
    p.add_argument("--digit", type=int, default=2)
    p.add_argument("--exemplars", type=int, default=5)
    p.add_argument("--unlabeled", type=int, default=64, help="images uploaded to the job (<= files per request)")
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="for the CLI run; the worker uses QLOC_DEVICE")
    p.add_argument("--out")
    a = p.parse_args()
    result = {"bundle": a.bundle, "digit": a.digit, "unlabeled": a.unlabeled, "iterations": a.iterations,
              "batch_size": a.batch_size, "service": via_service(a), "cli": via_cli(a)}
    emit(result, a.out)


if __name__ == "__main__":
    main()
