"""Debian packages as a data source: downloaded with ``apt-get download`` and read with ``dpkg-deb``, nothing
installed. Used by the photo data (``models.data.photos``) and the real-photo benchmark (``models.data.realphotos``)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError as e:
        raise RuntimeError(f"{cmd[0]} not found: fetching data from Debian's archive needs apt-get and dpkg-deb") from e


def download(pkg: str, debs: Path, log) -> Path:
    """``apt-get download`` of ``pkg`` into ``debs`` (a ``.deb`` already there is used) -> the ``.deb``; on failure
    the package lists are updated once and the download retried."""
    debs.mkdir(parents=True, exist_ok=True)
    found = sorted(debs.glob(f"{pkg}_*.deb"))
    if found:
        return found[-1]
    log(f"apt-get download {pkg}")
    res = run(["apt-get", "download", pkg], cwd=debs)
    if res.returncode != 0:  # most often a stale or empty package list
        log(f"apt-get download failed ({res.stderr.strip().splitlines()[-1:]}); running apt-get update")
        upd = run(["apt-get", "update"])
        if upd.returncode != 0:
            raise RuntimeError(f"apt-get update failed (run as root?): {upd.stderr.strip()}")
        res = run(["apt-get", "download", pkg], cwd=debs)
        if res.returncode != 0:
            raise RuntimeError(f"apt-get download {pkg} failed: {res.stderr.strip()}")
    found = sorted(debs.glob(f"{pkg}_*.deb"))
    if not found:
        raise RuntimeError(f"apt-get download {pkg} left no {pkg}_*.deb in {debs}")
    return found[-1]


def deb_field(deb: Path, field: str) -> str:
    """A control field of a ``.deb`` (e.g. ``Version``)."""
    res = run(["dpkg-deb", "-f", str(deb), field])
    if res.returncode != 0:
        raise RuntimeError(f"dpkg-deb could not read {deb}: {res.stderr.strip()}")
    return res.stdout.strip()
