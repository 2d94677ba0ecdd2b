"""Blobs (uploaded images, checkpoints) on disk under one root, addressed by relative keys.

Every write goes to a temporary name in the target directory and is renamed into place, so a crash
leaves either the whole file or none. Rows refer to blobs by key; blobs are written before the rows
that name them and deleted after them.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

from models.bundle import atomic_write

_KEY = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")


class BlobStore:
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()

    def path(self, key: str) -> Path:
        """The file of ``key``; keys are relative, ``/``-separated, with no ``..`` parts."""
        if not _KEY.match(key) or any(part in (".", "..") for part in key.split("/")):
            raise ValueError(f"invalid blob key {key!r}")
        return self.root / key

    def put(self, key: str, data: bytes) -> str:
        """Write ``data`` atomically under ``key`` -> sha256 hex."""
        return atomic_write(self.path(key), data)

    def read(self, key: str) -> bytes:
        return self.path(key).read_bytes()

    def read_verified(self, key: str, sha256: str) -> bytes:
        """The blob's bytes, refusing a blob whose digest is not ``sha256``."""
        data = self.read(key)
        got = hashlib.sha256(data).hexdigest()
        if got != sha256:
            raise ValueError(f"blob {key} is corrupt: sha256 {got}, expected {sha256}")
        return data

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def delete_tree(self, prefix: str) -> None:
        """Remove everything under the directory ``prefix``."""
        shutil.rmtree(self.path(prefix), ignore_errors=True)


def exemplar_set_prefix(set_id: object) -> str:
    return f"exemplar-sets/{set_id}"


def exemplar_key(set_id: object, position: int, ext: str) -> str:
    return f"{exemplar_set_prefix(set_id)}/exemplars/{position:03d}{ext}"


def job_prefix(set_id: object, job_id: object) -> str:
    return f"{exemplar_set_prefix(set_id)}/jobs/{job_id}"


def job_image_key(set_id: object, job_id: object, position: int, ext: str) -> str:
    return f"{job_prefix(set_id, job_id)}/images/{position:03d}{ext}"


def checkpoint_key(set_id: object, job_id: object, iteration: int) -> str:
    return f"{job_prefix(set_id, job_id)}/checkpoints/{iteration:07d}.pt"


def heads_prefix(set_id: object) -> str:
    """The set's projection heads stored apart from the checkpoints that share them (format 6)."""
    return f"{exemplar_set_prefix(set_id)}/heads"


def head_key(set_id: object, sha256: str) -> str:
    """One of ``heads_prefix``, by its file's digest."""
    return f"{heads_prefix(set_id)}/{sha256}.pt"


def pool_image_key(set_id: object, image_id: object, ext: str) -> str:
    """An image of the set's pool: under the set's prefix, so deleting the set deletes it."""
    return f"{exemplar_set_prefix(set_id)}/pool/{image_id}{ext}"
