"""Recovery after ``kill -9``: how long a job whose worker died shows ``running`` before it runs again.

Each trial starts the API and a Celery worker (real processes, the tests' small random-weight bundle),
posts a job, ``kill -9`` s the worker's whole process group once the job has written two checkpoints,
starts a new worker at once, and times, from the kill: the new worker ready, the job requeued by its
reaper, running again (claimed by the new worker), and succeeded. Heartbeat and reaper timings are the
settings' defaults unless given. ``--victim pool`` kills only the pool process running the job (the
worker lives and its main process expires the job's lease). Prints one JSON object (medians, every trial):

    .venv/bin/python benchmarks/recovery.py --trials 5 --backend embedded --out runs/recovery.json
    .venv/bin/python benchmarks/recovery.py --trials 5 --backend postgres_redis   # PostgreSQL + Redis here
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "worker")]

import psycopg  # noqa: E402
from service_fixtures import PG_ADMIN_URL, REDIS_URL, Stack, migrate  # noqa: E402
from test_worker_recovery import kill_mid_job_and_resume, recovery_settings  # noqa: E402


def bundles(root: Path) -> Path:
    from models.bundle import new_bundle, save_bundle
    from models.presets import mnist_config

    d = root / "bundles"
    d.mkdir()
    for seed, name in enumerate(("test-digits", "test-other")):
        save_bundle(d / f"{name}.pt", new_bundle(name, mnist_config(), seed=seed))
    return d


def trial(root: Path, bundle_dir: Path, a: argparse.Namespace) -> dict:
    timings = {k: v for k, v in (("heartbeat_interval", a.heartbeat_interval),
                                 ("heartbeat_timeout", a.heartbeat_timeout),
                                 ("reaper_interval", a.reaper_interval)) if v is not None}
    root.mkdir(parents=True, exist_ok=True)
    db = None
    admin = PG_ADMIN_URL.replace("postgresql+psycopg://", "postgresql://")
    if a.backend == "embedded":
        s = recovery_settings(root, bundle_dir, **timings)
    else:
        db = f"qloc_bench_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{db}"')
        prefix = f"qloc-bench-{uuid.uuid4().hex[:12]}:"
        s = recovery_settings(root, bundle_dir, database_url=f"{PG_ADMIN_URL.rsplit('/', 1)[0]}/{db}",
                              broker_url=REDIS_URL, broker_transport_options={"global_keyprefix": prefix},
                              queue=f"qloc-bench-{uuid.uuid4().hex[:8]}", **timings)
    migrate(s.database_url)
    st = Stack(s, root)
    try:
        st.start_api()
        st.start_worker()
        st.wait_ready()
        out = kill_mid_job_and_resume(st, iterations=a.iterations, kill_after=2, victim=a.victim)
    finally:
        st.stop()
        if db is not None:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    iters = [k.iteration for k in out["checkpoints"]]
    return {"seconds": {k: round(v, 2) for k, v in out["seconds"].items() if v is not None},
            "killed_at_iteration": out["at_kill"].progress_iteration,
            "resumed_from": max(k.iteration for k in out["checkpoints_at_kill"]),
            "attempts": out["final"].attempts, "checkpoints": iters, "duplicates": len(iters) - len(set(iters))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--backend", choices=["embedded", "postgres_redis"], default="embedded")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--victim", choices=["worker", "pool"], default="worker",
                   help="kill the whole worker and start a new one, or only the pool process running the job")
    p.add_argument("--heartbeat-interval", type=float)
    p.add_argument("--heartbeat-timeout", type=float)
    p.add_argument("--reaper-interval", type=float)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    trials = []
    with tempfile.TemporaryDirectory(prefix="qloc-recovery-") as tmp:
        bundle_dir = bundles(Path(tmp))
        for i in range(a.trials):
            trials.append(trial(Path(tmp) / f"t{i}", bundle_dir, a))
            print(json.dumps(trials[-1]), file=sys.stderr)
    keys = ("ready", "requeued", "running", "succeeded")
    result = {"backend": a.backend, "victim": a.victim, "trials": a.trials,
              "settings": recovery_settings(Path("."), Path(".")).model_dump(
                  include={"heartbeat_interval", "heartbeat_timeout", "reaper_interval"}) | {
                  k: v for k, v in vars(a).items() if k.startswith(("heartbeat", "reaper")) and v is not None},
              "median_s": {k: round(statistics.median(t["seconds"][k] for t in trials if k in t["seconds"]), 2)
                           for k in keys if any(k in t["seconds"] for t in trials)},
              "max_s": {k: max(t["seconds"][k] for t in trials if k in t["seconds"])
                        for k in keys if any(k in t["seconds"] for t in trials)},
              "per_trial": trials}
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)


if __name__ == "__main__":
    main()
