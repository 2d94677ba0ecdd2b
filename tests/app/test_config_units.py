"""``app.config`` by value: how settings are read from the environment, each cross-field refusal at its boundary, the
derived limits, and how many API processes ``scripts/run api`` starts.

(The defaults and bounds of every field are pinned by SETTINGS.md, ``test_settings_reference.py``.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from app import config
from app.config import MiB, Settings, api_processes

KEY = "k" * 16


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No ``QLOC_*`` or Label Studio variable of the machine running the tests leaks into these settings."""
    for name in list(os.environ):
        if name.startswith(("QLOC_", "LABEL_STUDIO_", "LABELSTUDIO_")):
            monkeypatch.delenv(name)


def refusal(**values) -> str:
    with pytest.raises(ValidationError) as e:
        Settings(**values)
    return str(e.value)


def test_values_come_from_qloc_variables_by_their_field_names(monkeypatch):
    monkeypatch.setenv("QLOC_HEARTBEAT_TIMEOUT", "12.5")
    monkeypatch.setenv("QLOC_TUNE_MALLOC", "false")
    monkeypatch.setenv("QLOC_BROKER_TRANSPORT_OPTIONS", '{"global_keyprefix": "q:"}')
    monkeypatch.setenv("HEARTBEAT_TIMEOUT", "99")  # no prefix: not ours
    monkeypatch.setenv("QLOC_NOT_A_SETTING", "x")  # unknown names are ignored, not refused
    s = Settings()
    assert (s.heartbeat_timeout, s.tune_malloc, s.broker_transport_options) == (12.5, False, {"global_keyprefix": "q:"})


def test_api_keys_are_comma_separated_and_trimmed_in_their_case(monkeypatch):
    monkeypatch.setenv("QLOC_API_KEYS", f" {KEY}A , ,{KEY}b,")
    s = Settings()
    assert s.api_keys == [f"{KEY}A", f"{KEY}b"] and s.auth_enabled
    assert Settings(api_keys=[KEY]).api_keys == [KEY]  # a list is taken as it is
    assert Settings().auth_enabled and not Settings(api_keys=[]).auth_enabled


def test_label_studio_hosts_are_comma_separated_trimmed_and_lower_case(monkeypatch):
    monkeypatch.setenv("QLOC_LABELSTUDIO_FETCH_HOSTS", " LS.Example:8080, ,Images.example ,")
    assert Settings().labelstudio_fetch_hosts == ["ls.example:8080", "images.example"]
    assert Settings(labelstudio_fetch_hosts=["A"]).labelstudio_fetch_hosts == ["A"]  # a list as it is
    assert Settings().labelstudio_fetch_hosts is not None
    monkeypatch.delenv("QLOC_LABELSTUDIO_FETCH_HOSTS")
    assert Settings().labelstudio_fetch_hosts is None  # unset: any host


def test_label_studio_address_and_token_are_read_under_either_name(monkeypatch):
    monkeypatch.setenv("LABEL_STUDIO_URL", "http://ls:8080")
    monkeypatch.setenv("LABEL_STUDIO_API_KEY", "tok")
    assert (Settings().labelstudio_url, Settings().labelstudio_api_key) == ("http://ls:8080", "tok")
    monkeypatch.setenv("QLOC_LABELSTUDIO_URL", "http://ours:1")
    assert Settings().labelstudio_url == "http://ours:1"  # ours first
    monkeypatch.setenv("LABELSTUDIO_URL", "http://neither:2")  # neither name: ignored
    monkeypatch.delenv("QLOC_LABELSTUDIO_URL")
    monkeypatch.delenv("LABEL_STUDIO_URL")
    assert Settings().labelstudio_url is None
    assert Settings(labelstudio_url="http://x").labelstudio_url == "http://x"  # and by name in code
    assert "tok" not in repr(Settings())  # the token is never in a repr


def test_hard_job_limit_must_exceed_the_soft_one():
    assert "job_time_limit (hard) must exceed" in refusal(job_soft_time_limit=100, job_time_limit=100)
    assert Settings(job_soft_time_limit=100, job_time_limit=100.5).job_time_limit == 100.5


def test_heartbeat_timeout_is_at_least_two_beats():
    assert "at least twice heartbeat_interval" in refusal(heartbeat_interval=5, heartbeat_timeout=9.99)
    assert Settings(heartbeat_interval=5, heartbeat_timeout=10).heartbeat_timeout == 10


def test_default_iterations_within_the_maximum():
    assert "must not exceed max_iterations" in refusal(default_iterations=101, max_iterations=100)
    assert Settings(default_iterations=100, max_iterations=100).default_iterations == 100


def test_api_keys_of_fewer_than_16_characters_are_refused_without_echoing_them():
    text = refusal(api_keys=[KEY, "s3cr3t-15-chars"])
    assert "at least 16 characters" in text and "s3cr3t" not in text
    assert Settings(api_keys=["x" * 16]).api_keys == ["x" * 16]


def test_workers_mode_needs_a_result_backend():
    assert "needs QLOC_RESULT_BACKEND" in refusal(inference="workers")
    assert "needs QLOC_RESULT_BACKEND" in refusal(inference="workers", result_backend="")
    assert Settings(inference="workers", result_backend="redis://h:6379/1").inference == "workers"
    assert Settings(inference="local").result_backend is None  # local mode needs none


def test_the_localize_queue_is_not_the_jobs_queue():
    assert "must differ from QLOC_QUEUE" in refusal(queue="same", localize_queue="same")
    assert Settings(queue="a", localize_queue="b").localize_queue == "b"


def test_derived_limits():
    s = Settings(max_files_per_request=3, max_file_bytes=1000)
    assert s.max_request_bytes == 3 * 1000 + MiB
    assert Settings(job_soft_time_limit=10, job_time_limit=99.9).broker_visibility_timeout == 99 + 600
    assert Settings().broker_visibility_timeout == 3660 + 600


def test_get_settings_reads_the_environment_once(monkeypatch):
    config.get_settings.cache_clear()
    try:
        monkeypatch.setenv("QLOC_QUEUE", "first")
        first = config.get_settings()
        monkeypatch.setenv("QLOC_QUEUE", "second")
        assert config.get_settings() is first and first.queue == "first"
    finally:
        config.get_settings.cache_clear()


@pytest.fixture
def cores(monkeypatch):
    def set_cores(n: int, nvidia: bool = False) -> None:
        monkeypatch.setattr(config, "usable_cores", lambda: n)
        monkeypatch.setattr(config, "_nvidia", lambda: nvidia)
    return set_cores


def test_api_processes_as_told_whatever_the_cores(cores):
    cores(2)
    assert api_processes(Settings(api_workers=5)) == 5
    assert api_processes(Settings(api_workers=1, device="cuda")) == 1


def test_api_processes_one_per_core_up_to_the_most(cores):
    cores(3)
    assert api_processes(Settings(device="cpu")) == 3
    cores(64)
    assert api_processes(Settings(device="cpu")) == config.AUTO_API_PROCESSES == 8
    cores(0)
    assert api_processes(Settings(device="cpu")) == 1  # never none


def test_api_processes_on_a_gpu_are_fewer(cores, monkeypatch):
    cores(64)
    assert api_processes(Settings(device="cuda")) == config.GPU_API_PROCESSES == 4
    cores(3)
    assert api_processes(Settings(device="cuda")) == 3  # still no more than the cores
    cores(64)  # the model on the workers: the API holds no GPU context
    assert api_processes(Settings(device="cuda", inference="workers", result_backend="redis://h:1/0")) == 8
    # auto: torch is asked only where NVIDIA's driver is loaded, and its answer counts
    import models.inference

    asked = []

    def resolve(device):
        asked.append(device)
        return models.inference.torch.device(answer)

    monkeypatch.setattr(models.inference, "resolve_device", resolve)
    answer = "cuda"
    assert api_processes(Settings(device="auto")) == 8 and asked == []  # no driver: not asked
    cores(64, nvidia=True)
    assert api_processes(Settings(device="auto")) == 4 and asked == ["auto"]
    answer = "cpu"
    assert api_processes(Settings(device="auto")) == 8
    assert api_processes(Settings(device="auto", inference="workers", result_backend="redis://h:1/0")) == 8
    assert asked == ["auto", "auto"]


def test_nvidia_is_seen_by_either_of_its_driver_files(monkeypatch):
    present: set[str] = set()
    monkeypatch.setattr(Path, "exists", lambda self: str(self) in present)
    assert not config._nvidia()
    present = {"/proc/driver/nvidia/version"}
    assert config._nvidia()
    present = {"/dev/nvidiactl"}
    assert config._nvidia()


def test_usable_cores_are_this_processs_affinity_else_the_machines(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0} if pid == 0 else None, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert config.usable_cores() == 1  # pinned to one core of six
    monkeypatch.delattr(os, "sched_getaffinity")  # a system without affinities (macOS)
    assert config.usable_cores() == 6
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # and one that cannot tell
    assert config.usable_cores() == 1


def test_uvicorn_options(cores):
    cores(3)
    assert config.UVICORN_OPTIONS["api-processes"](Settings(device="cpu")) == "3"
    assert config.UVICORN_OPTIONS["access-log"](Settings()) == "--no-access-log"
    assert config.UVICORN_OPTIONS["access-log"](Settings(access_log=True)) == "--access-log"
