"""Localize under load: one client, then many concurrent clients, 1 image per request, on one or more checkouts.

Each ``--tree NAME=DIR`` is a checkout of qloc (e.g. this one and an older commit from ``git worktree add``):
its API is started the way its own ``scripts/run api`` starts it (with this Python environment's PATH,
``QLOC_BOOTSTRAP=0``), on the embedded default (SQLite, blobs and broker in a fresh temporary directory),
each on its own port. All servers are up at once and idle but for the one measured; the phases alternate
between trees round by round, so a slow moment of a shared machine falls on both alike:

    git worktree add /tmp/qloc-before <commit>
    .venv/bin/python benchmarks/service_load.py --tree before=/tmp/qloc-before --tree after=. \\
        --rounds 3 --seconds 10 --out runs/bench-load.json

Clients run in this process (asyncio + aiohttp, one connection each), the servers in their own. Images are
cMNIST test images of ``--digit`` (84 x 84 grayscale PNGs); each server gets an exemplar set of ground-truth
crops. Per tree and phase: requests/s (median over rounds), latency p50 / p95 over every request of every
round, errors (any answer but 200, or a failed connection), the CPU time the API's processes and the client
process spent per answered request (medians over rounds: on a shared 2-core machine the client's share is CPU the
server did not get); then the ratios between trees and phases.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp  # noqa: E402
import httpx  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
from _client import emit, multipart, percentiles, to_png, wait_compiled  # noqa: E402

from models.data.types import exemplar_crops  # noqa: E402
from models.experiments.cmnist import cmnist  # noqa: E402

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One checkout's API on the embedded default, in a fresh directory."""

    def __init__(self, name: str, tree: Path, env: dict[str, str]):
        self.name, self.tree, self.port = name, tree.resolve(), free_port()
        self.var = Path(tempfile.mkdtemp(prefix=f"qloc-load-{name}-"))
        self.env = {**os.environ, **env, "PATH": f"{BIN}:{os.environ.get('PATH', '')}", "QLOC_BOOTSTRAP": "0",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(self.tree), os.environ.get("PYTHONPATH")])),
                    "QLOC_HOST": "127.0.0.1", "QLOC_PORT": str(self.port),
                    "QLOC_DATABASE_URL": f"sqlite:///{self.var}/qloc.db",
                    "QLOC_BROKER_URL": f"sqla+sqlite:///{self.var}/celery-broker.db",
                    "QLOC_STORAGE_DIR": str(self.var / "blobs"), "QLOC_LOG_LEVEL": "WARNING"}
        subprocess.run([str(self.tree / "scripts/run"), "migrate"], cwd=self.tree, env=self.env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.log = open(self.var / "api.log", "wb")  # noqa: SIM115 -- closed in stop()
        self.proc = subprocess.Popen([str(self.tree / "scripts/run"), "api"], cwd=self.tree, env=self.env,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: the API exited; see {self.var / 'api.log'}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.name}: not ready after {timeout} s")

    def wait_compiled(self) -> float | None:
        """``_client.wait_compiled`` for every API process ``scripts/run api`` started (``None`` if told not to)."""
        if self.env.get("QLOC_COMPILE_EPISODE", "true").lower() in ("0", "false", "no", "off"):
            return None
        device = self.env.get("QLOC_DEVICE", "auto")
        if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
            return None  # nothing compiles on a GPU: its CUDA graphs are captured on first use (the warm-up load)
        ask = subprocess.run([str(BIN / "python"), "-m", "app.config", "api-processes"], cwd=self.tree, env=self.env,
                             capture_output=True, text=True)
        return wait_compiled(self.url, self.tree, int(ask.stdout.strip() or 1) if ask.returncode == 0 else 1)

    def cpu_seconds(self) -> float:
        """User + system CPU time of the API's processes (the supervisor and every process under it)."""
        total = 0.0
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return total
        for proc in procs:
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


async def load(url: str, path: str, images: list[bytes], clients: int, seconds: float) -> dict:
    """``clients`` concurrent clients, each sending one request after another for ``seconds`` (aiohttp, one
    keep-alive connection per client: little client CPU per request, so the server is what is measured)."""
    lat: list[float] = []
    done = errors = 0
    stop = time.perf_counter() + seconds

    async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=clients),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def client(k: int) -> None:
            nonlocal done, errors
            i = k
            while time.perf_counter() < stop:
                form = aiohttp.FormData()
                form.add_field("files", images[i % len(images)], filename=f"{i}.png", content_type="image/png")
                t0 = time.perf_counter()
                try:
                    async with session.post(path, data=form) as r:
                        await r.read()
                        ok = r.status == 200
                except (TimeoutError, aiohttp.ClientError):
                    ok = False
                dt = time.perf_counter() - t0
                if ok:
                    done += 1
                    lat.append(dt)
                else:
                    errors += 1
                i += clients

        t0 = time.perf_counter()
        await asyncio.gather(*(client(k) for k in range(clients)))
        wall = time.perf_counter() - t0
    return {"requests": done, "errors": errors, "seconds": wall, "requests_per_s": done / wall, "latency": lat}


def measured(server: Server, url: str, path: str, images: list[bytes], clients: int, seconds: float) -> dict:
    """``load``, with the CPU time the server's processes and this client process spent per answered request."""
    server0, client0 = server.cpu_seconds(), time.process_time()
    out = asyncio.run(load(url, path, images, clients, seconds))
    per = 1000 / max(out["requests"], 1)
    out["server_cpu_ms_per_request"] = (server.cpu_seconds() - server0) * per
    out["client_cpu_ms_per_request"] = (time.process_time() - client0) * per
    return out


def summarize(runs: list[dict]) -> dict:
    lat = [t for r in runs for t in r["latency"]]
    return {"rounds": len(runs), "requests": sum(r["requests"] for r in runs), "errors": sum(r["errors"] for r in runs),
            "requests_per_s": round(statistics.median(r["requests_per_s"] for r in runs), 1),
            "requests_per_s_each_round": [round(r["requests_per_s"], 1) for r in runs],
            "server_cpu_ms_per_request": round(statistics.median(r["server_cpu_ms_per_request"] for r in runs), 2),
            "client_cpu_ms_per_request": round(statistics.median(r["client_cpu_ms_per_request"] for r in runs), 2),
            **(percentiles(lat) if lat else {})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", required=True, metavar="NAME=DIR",
                   help="a qloc checkout to start and measure (repeat: the first is the baseline of the ratios)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 32])
    p.add_argument("--seconds", type=float, default=10.0, help="per phase and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load on each server before measuring")
    p.add_argument("--digit", type=int, default=4)
    p.add_argument("--env", action="append", default=[], metavar="[TREE:]VAR=VALUE",
                   help="extra environment of every server (or of tree TREE only), e.g. after:QLOC_INFERENCE_THREADS=1")
    p.add_argument("--out")
    a = p.parse_args()

    trees = [t.split("=", 1) for t in a.tree]
    env: dict[str, dict[str, str]] = {name: {} for name, _ in trees}
    for e in a.env:
        var, value = e.split("=", 1)
        tree, _, var = var.rpartition(":")
        for name in [tree] if tree else env:
            env[name][var] = value
    ex = cmnist(a.digit, "train", 5, seed=1000)
    test = cmnist(a.digit, "test", 256, seed=0)
    crops = [to_png(t) for t in exemplar_crops(ex)]
    images = [to_png(t) for t in test.images]

    servers = [Server(name, Path(d), env[name]) for name, d in trees]
    result: dict = {"machine_cpus": os.cpu_count(), "clients": a.clients, "seconds": a.seconds, "rounds": a.rounds,
                    "env": env, "trees": {}}
    try:
        paths = {}
        for s in servers:
            s.wait_ready()
            waited = s.wait_compiled()
            if waited is not None:
                print(f"{s.name}: episode compiled, {waited} s after ready", file=sys.stderr)
            r = httpx.post(f"{s.url}/v1/exemplar-sets", files=multipart(crops), data={"name": "load"}, timeout=60)
            r.raise_for_status()
            paths[s.name] = f"/v1/exemplar-sets/{r.json()['id']}/localize"
            asyncio.run(load(s.url, paths[s.name], images, max(a.clients), a.warmup))
        runs: dict[tuple[str, int], list[dict]] = {}
        for rnd in range(a.rounds):
            for n in a.clients:
                for s in servers:
                    out = measured(s, s.url, paths[s.name], images, n, a.seconds)
                    runs.setdefault((s.name, n), []).append(out)
                    print(f"round {rnd + 1}: {s.name}, {n} clients: {out['requests_per_s']:.1f} req/s, "
                          f"{out['errors']} errors, CPU ms per request: server "
                          f"{out['server_cpu_ms_per_request']:.2f}, client {out['client_cpu_ms_per_request']:.2f}",
                          file=sys.stderr)
        for s in servers:
            result["trees"][s.name] = {"dir": str(s.tree), **{f"clients_{n}": summarize(runs[(s.name, n)])
                                                              for n in a.clients}}
    finally:
        for s in servers:
            s.stop()
    names = [name for name, _ in trees]
    lo, hi = min(a.clients), max(a.clients)
    ratios = {}
    for name in names:
        t = result["trees"][name]
        ratios[f"{name}: {hi} clients / {lo} client(s), requests/s"] = round(
            t[f"clients_{hi}"]["requests_per_s"] / t[f"clients_{lo}"]["requests_per_s"], 2)
    for name in names[1:]:
        for n in a.clients:
            ratios[f"{name} / {names[0]}, {n} clients, requests/s"] = round(
                result["trees"][name][f"clients_{n}"]["requests_per_s"]
                / result["trees"][names[0]][f"clients_{n}"]["requests_per_s"], 2)
    result["ratios"] = ratios
    emit(result, a.out)


if __name__ == "__main__":
    main()
