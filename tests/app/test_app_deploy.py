"""The two ways to run: ``scripts/run`` (the README's run command) and the image / compose file.

No Docker engine runs here: the compose file is parsed and checked, and the image's commands are
checked to be the modes of ``scripts/run``, which the run command itself is tested with.
"""

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from service_fixtures import (
    REPO,
    VENV_BIN,
    files,
    free_port,
    live_worker_settings,
    make_test_settings,
    png_bytes,
    settings_env,
)

pytestmark = pytest.mark.slow


def test_compose_file_parses_and_runs_the_scripts_modes():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"postgres", "redis", "migrate", "api", "worker", "localize-worker"}
    assert services["migrate"]["command"] == ["scripts/run", "migrate"]
    assert services["api"]["command"] == ["scripts/run", "api"]
    assert services["worker"]["command"] == ["scripts/run", "worker"]
    for name in ("api", "worker"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        env = services[name]["environment"]
        assert env["QLOC_DATABASE_URL"].startswith("postgresql+psycopg://")
        assert env["QLOC_BROKER_URL"].startswith("redis://")
        assert services[name]["build"] == "." and "blobs:/data" in services[name]["volumes"]
    assert services["migrate"]["restart"] == "no"
    gpu = services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert services["api"]["environment"]["QLOC_HOST"] == "0.0.0.0"
    # localization on workers: the API holds no model; a worker consumes the localize queue, answers via Redis
    api_env, localize = services["api"]["environment"], services["localize-worker"]
    assert api_env["QLOC_INFERENCE"] == "workers" and api_env["QLOC_RESULT_BACKEND"].startswith("redis://")
    cmd = localize["command"]
    assert cmd[:4] == ["celery", "-A", "worker.celery_app", "worker"]
    assert cmd[cmd.index("-Q") + 1] == api_env["QLOC_LOCALIZE_QUEUE"] and cmd[cmd.index("--pool") + 1] == "threads"
    assert localize["environment"]["QLOC_RESULT_BACKEND"] == api_env["QLOC_RESULT_BACKEND"]
    assert localize["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_image_runs_the_run_script():
    dockerfile = (REPO / "Dockerfile").read_text()
    cmd = re.findall(r"^CMD (.+)$", dockerfile, re.MULTILINE)
    assert cmd == ['["scripts/run", "api"]']
    copied = set(re.findall(r"^COPY (\S+)", dockerfile, re.MULTILINE))
    assert {"models", "app", "worker", "migrations", "alembic.ini", "bundles", "scripts/run", "data/mnist"} <= copied
    assert "QLOC_DATA_DIR=/srv/qloc/data" in dockerfile  # the CLI's MNIST, found through the one data setting
    ignored = (REPO / ".dockerignore").read_text().split()
    assert "data" not in ignored and "data/photos" in ignored
    assert "QLOC_BOOTSTRAP=0" in dockerfile  # the image has no virtualenv: scripts/run uses PATH


def test_run_script_modes_and_usage():
    assert subprocess.run(["bash", "-n", str(REPO / "scripts/run")]).returncode == 0
    r = subprocess.run([str(REPO / "scripts/run"), "nonsense"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr


def test_run_command_serves_api_and_worker_and_stops_both(tmp_path, bundle_dir):
    """``scripts/run``: migrate, worker, API; a job succeeds; SIGTERM stops API and worker. The job runs with
    ``LIVE_WORKER``'s settings (16 probes): on a loaded 2-core machine a job on the default 256 probes could take
    longer than the test waits, and this test is about the run command, not the job's quality."""
    settings = live_worker_settings(tmp_path, bundle_dir)
    port = free_port()
    env = {**os.environ, **settings_env(settings), "QLOC_PORT": str(port), "QLOC_BOOTSTRAP": "0",
           "QLOC_ACCESS_LOG": "true", "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
    log = open(tmp_path / "run.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([str(REPO / "scripts/run")], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (tmp_path / "run.log").read_text()
            try:
                if httpx.get(f"{base}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "run.log").read_text()
            time.sleep(0.3)
        with httpx.Client(base_url=base, timeout=60) as c:
            es = c.post("/v1/exemplar-sets", files=files(png_bytes(28, 28))).json()
            job = c.post(f"/v1/exemplar-sets/{es['id']}/adaptations", files=files(png_bytes()),
                         data={"iterations": "2"}).json()
            deadline = time.monotonic() + 90
            while (status := c.get(f"/v1/adaptations/{job['id']}").json()["status"]) in ("queued", "running"):
                assert time.monotonic() < deadline, (tmp_path / "run.log").read_text()
                time.sleep(0.3)
            assert status == "succeeded", (tmp_path / "run.log").read_text()
        assert re.search(r'"GET /readyz HTTP/1.1" 200', (tmp_path / "run.log").read_text())  # QLOC_ACCESS_LOG=true
        children = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) >= 3  # the script, uvicorn, the Celery worker (and its pool process)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        deadline = time.monotonic() + 30
        while subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "API or worker still running after the run command exited"
            time.sleep(0.2)
    finally:
        if proc.poll() is None or subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).returncode == 0:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        log.close()
    assert Path(settings.database_url.removeprefix("sqlite:///")).exists()


def listeners(root: int, port: int) -> dict[int, set[str]]:
    """The processes from ``root`` down listening on TCP ``port`` -> the sockets each listens with (their inodes:
    one socket inherited by several processes is one inode)."""
    out: dict[int, set[str]] = {}
    top = psutil.Process(root)
    for p in [top, *top.children(recursive=True)]:
        try:
            conns = p.net_connections("tcp")
        except psutil.NoSuchProcess:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port:
                out.setdefault(p.pid, set()).add(os.readlink(f"/proc/{p.pid}/fd/{c.fd}"))
    return out


def test_a_port_in_use_stops_the_api_at_once_whatever_its_processes(tmp_path, bundle_dir):
    """Each API process binds its own socket (``app.serve``); the supervisor binds the address first, so a port
    another program holds fails at once with uvicorn's startup-failure status, not a loop of processes restarted."""
    settings = make_test_settings(tmp_path, bundle_dir)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {**os.environ, **settings_env(settings), "QLOC_PORT": str(taken.getsockname()[1]), "QLOC_BOOTSTRAP": "0",
               "QLOC_API_WORKERS": "2", "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
        r = subprocess.run([str(REPO / "scripts/run"), "api"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
    assert r.returncode == 3 and "Address already in use" in r.stderr, r.stderr


def test_each_api_process_gets_a_socket_of_its_own_bound_to_the_address_and_not_yet_listening():
    from app.serve import OwnSocket, process_socket, reuse_port_socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    own = OwnSocket(socket.AF_INET, ("127.0.0.1", port))  # what the supervisor pickles into each process
    assert own.__reduce__() == (process_socket, (socket.AF_INET, ("127.0.0.1", port), os.getpid()))
    sock = reuse_port_socket(socket.AF_INET, ("127.0.0.1", port))  # what it becomes there
    try:
        assert sock.getsockname() == ("127.0.0.1", port)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 0  # listens once its app has started
        with socket.socket() as client:
            assert client.connect_ex(("127.0.0.1", port)) != 0  # nothing listens: refused, not queued
    finally:
        sock.close()


def test_several_api_processes_serve_and_metrics_add_up_over_them(tmp_path, bundle_dir):
    """``QLOC_API_WORKERS=2``: two uvicorn processes serve; every scrape, whichever process answers it, counts
    the requests of both (prometheus_client's multiprocess mode); a stale metrics folder is emptied first."""
    settings = make_test_settings(tmp_path, bundle_dir)
    port, shared = free_port(), tmp_path / "prometheus"
    shared.mkdir()
    (shared / "histogram_1.db").write_bytes(b"stale: a scrape would fail on it")
    env = {**os.environ, **settings_env(settings), "QLOC_PORT": str(port), "QLOC_BOOTSTRAP": "0",
           "QLOC_API_WORKERS": "2", "PROMETHEUS_MULTIPROC_DIR": str(shared),
           "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run([str(REPO / "scripts/run"), "migrate"], cwd=REPO, env=env, check=True, capture_output=True)
    log = open(tmp_path / "api.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([str(REPO / "scripts/run"), "api"], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while len(pids := {p.stem.rsplit("_", 1)[1] for p in shared.glob("histogram_*.db")} - {"1"}) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "api.log").read_text()
            time.sleep(0.3)
        assert not (shared / "histogram_1.db").exists() and len(pids) == 2  # one file per process, stale one gone
        deadline = time.monotonic() + 60
        while len(listening := listeners(proc.pid, port)) < 2:  # each listens once its app has started
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "api.log").read_text()
            time.sleep(0.3)
        # a socket of its own each (app/serve.py); the supervisor does not listen
        assert set(listening) == {int(p) for p in pids} and len(set().union(*listening.values())) == 2, listening
        n = 30
        for _ in range(n):  # a connection each: the kernel spreads them over the two processes' sockets
            deadline = time.monotonic() + 60
            while True:
                try:
                    assert httpx.get(f"{base}/healthz", timeout=10).status_code == 200
                    break
                except httpx.HTTPError:
                    assert time.monotonic() < deadline, (tmp_path / "api.log").read_text()
                    time.sleep(0.3)
        line = re.compile(r'^qloc_http_request_duration_seconds_count\{method="GET",route="/healthz",status="200"\} '
                          r"(\S+)$", re.MULTILINE)
        for _ in range(6):  # whichever process answers
            r = httpx.get(f"{base}/metrics", timeout=10)
            assert r.status_code == 200, r.text
            assert [float(v) for v in line.findall(r.text)] == [n], r.text
            assert "qloc_jobs{" in r.text  # the job gauges, read from SQL, once
        assert "GET /healthz" not in (tmp_path / "api.log").read_text()  # no access log by default (QLOC_ACCESS_LOG)
        processes = [psutil.Process(pid) for pid in listening]
        os.kill(proc.pid, signal.SIGKILL)  # the supervisor killed: its processes end with it, the port is free
        gone, alive = psutil.wait_procs(processes, timeout=60)
        assert not alive, (tmp_path / "api.log").read_text()
        with socket.socket() as again:  # refused while any socket listens on it (TIME_WAIT aside)
            again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            again.bind(("127.0.0.1", port))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


def test_a_refused_setting_is_named_without_echoing_any_setting(tmp_path):
    """``scripts/run`` reads the settings first (``python -m app.config``): a refused one stops it with one line
    per problem and never the values read (pydantic printed every setting of a cross-field check, API keys and the
    Label Studio token among them)."""
    import sys

    env = {**os.environ, "QLOC_API_KEYS": "short,s3cr3t-tenant-key-AAAA", "QLOC_LABELSTUDIO_API_KEY": "ls-token-XYZ",
           "QLOC_DATABASE_URL": f"sqlite:///{tmp_path}/q.db"}
    r = subprocess.run([sys.executable, "-m", "app.config", "api-processes"], env=env, capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert r.returncode == 1
    assert "API keys must be at least 16 characters long" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "s3cr3t" not in r.stderr + r.stdout and "ls-token" not in r.stderr + r.stdout
    from pydantic import ValidationError

    from app.config import Settings

    with pytest.raises(ValidationError) as e:
        Settings(api_keys=["s3cr3t-tenant-key-AAAA", "short"], labelstudio_api_key="ls-token-XYZ")
    assert "s3cr3t" not in str(e.value) and "ls-token" not in str(e.value)
