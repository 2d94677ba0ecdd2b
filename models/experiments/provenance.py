"""What a result file records about how it was made: the command with every option, the machine."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import torch


def command_line(name: str, a: Any) -> str:
    """The command with every option spelled out (defaults included), so it reruns the same way."""
    skip = {"command", "func", "metrics"}
    parts = [f"qloc {name}"]
    for k, v in vars(a).items():
        if k in skip or v is None:
            continue
        flag = "--" + ("class" if k == "class_name" else k.replace("_", "-"))
        if k in ("cache", "feature_cache", "out"):
            v = relative(v)
        if isinstance(v, bool):
            parts.append(flag if v else f"--no-{flag[2:]}")
        elif isinstance(v, list):
            parts.append(f"{flag} {' '.join(map(str, v))}")
        else:
            parts.append(f"{flag} {v}")
    return " ".join(parts)


def relative(path: str) -> str:
    """``path`` relative to the working directory when it lies below it (no absolute paths in provenance)."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def environment() -> dict[str, Any]:



    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
