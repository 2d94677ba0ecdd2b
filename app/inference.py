"""The serving side of ``models``: bundles loaded by name and known by content, policies cached by checkpoint.

``BundleRegistry`` is shared by the API (localization) and the worker (adaptation): every
``<bundle_dir>/<name>.pt`` is servable as ``name``; each is loaded on first use and kept, known by the
sha256 of the bytes it was loaded from (one read: what is hashed is what is loaded). Each ``get``
looks at the file again (one ``stat``): a file replaced under the same name (another inode, size,
mtime or ctime) is read again, and reloaded if its bytes changed; later calls serve the new bundle.

An exemplar set records the sha256 of the bundle file that made its prototype. A prototype belongs
to the embedder that made it, so a set whose bundle was replaced since is refused
(``BundleReplaced``, answered 409 by the API; the worker fails such a job with the same message)
until its file is back; a new set works with the new file. A set without a recorded sha256 (made
before it was recorded) is served by whatever file is installed, as before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from app.lru import LoadingLRU
from app.storage import BlobStore
from app.tables import ExemplarSet
from models.bundle import (
    Bundle,
    HeadRef,
    Reward,
    bundle_from_bytes,
    checkpoint_from_bytes,
    head_from_bytes,
    head_to_bytes,
    policy_from_bytes,
)
from models.inference import Localizer, resolve_device
from models.verifier import KindVerifier, load_verifier, verifier_path

log = logging.getLogger(__name__)

BUNDLE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


class UnknownBundle(LookupError):
    pass


def short_sha(sha256: str) -> str:
    """The first 12 hex digits: enough to tell two bundle files apart in a message."""
    return sha256[:12]


class BundleMismatch(Exception):  # noqa: N818 -- a refusal, not a crash
    """An exemplar set cannot be served by the bundle installed under its bundle's name now."""


class BundleReplaced(BundleMismatch):
    """The bundle file an exemplar set was made with is no longer the one installed under its name."""

    def __init__(self, name: str, recorded: str, installed: str):
        self.name, self.recorded, self.installed = name, recorded, installed
        super().__init__(
            f"bundle {name!r} was replaced since this exemplar set was made (set made with sha256 "
            f"{short_sha(recorded)}, installed now: sha256 {short_sha(installed)}); the set's prototype belongs "
            f"to the old bundle. Re-create the exemplar set from its crops to use the new bundle (or reinstall "
            f"the old bundle file to use this set).")


_StatKey = tuple[int, int, int, int, int]


def _stat_key(st: os.stat_result) -> _StatKey:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


@dataclass(frozen=True)
class LoadedBundle:
    name: str
    """The name it is served under (its file's stem)."""
    path: Path
    sha256: str
    """Of the bundle file's bytes it was loaded from: the identity of its embedder and base policy."""
    bundle: Bundle
    localizer: Localizer
    stat: _StatKey | None = None
    """The file as it was read (device, inode, size, mtime, ctime): another one means look again."""


class BundleRegistry:
    def __init__(self, bundle_dir: str | Path, device: str = "auto", policy_cache_size: int = 32,
                 on_load: Callable[[LoadedBundle], None] | None = None, fast_episode: bool = True):
        """``on_load`` is called with each bundle file once it is loaded (the first time, or after it changed);
        ``fast_episode`` is its localizers' (``models.inference.Localizer``)."""
        self.fast_episode = fast_episode
        self.on_load = on_load
        self.bundle_dir = Path(bundle_dir)
        self.device = resolve_device(device)
        self._loaded: dict[str, LoadedBundle] = {}
        self._lock = threading.Lock()
        self._policies: LoadingLRU[dict[str, Tensor]] = LoadingLRU(policy_cache_size)
        self._verifiers: dict[str, tuple[_StatKey | None, KindVerifier | None]] = {}

    def names(self) -> list[str]:
        """Bundles available in the bundle directory."""
        if not self.bundle_dir.is_dir():
            return []
        return sorted(p.stem for p in self.bundle_dir.glob("*.pt") if BUNDLE_NAME.match(p.stem))

    def path(self, name: str) -> Path:
        if not BUNDLE_NAME.match(name):
            raise UnknownBundle(f"invalid bundle name {name!r}")
        path = self.bundle_dir / f"{name}.pt"
        if not path.is_file():
            raise UnknownBundle(f"unknown bundle {name!r}; available: {self.names()}")
        return path

    def get(self, name: str, *, expect_sha256: str | None = None) -> LoadedBundle:
        """The bundle installed as ``name`` now, loaded on first use and again once its file changed.

        Raises ``UnknownBundle``; with ``expect_sha256`` (an exemplar set's recorded bundle), raises
        ``BundleReplaced`` if the installed file is another one. A file that cannot be read or decoded
        raises ``OSError`` / ``ValueError`` (the copy loaded before, if any, stays cached, unserved).
        """
        loaded = self._current(name, self.path(name))
        if expect_sha256 is not None and loaded.sha256 != expect_sha256:
            raise BundleReplaced(name, expect_sha256, loaded.sha256)
        return loaded

    def _current(self, name: str, path: Path) -> LoadedBundle:
        loaded = self._loaded.get(name)
        if loaded is not None and loaded.stat == _stat_key(path.stat()):
            return loaded
        fresh = False
        with self._lock:
            with path.open("rb") as f:  # the stat and the bytes of one file, even if renamed over meanwhile
                key = _stat_key(os.fstat(f.fileno()))
                loaded = self._loaded.get(name)
                if loaded is not None and loaded.stat == key:
                    return loaded
                data = f.read()
            sha256 = hashlib.sha256(data).hexdigest()
            if loaded is not None and loaded.sha256 == sha256:  # touched, or copied over with the same bytes
                loaded = dataclasses.replace(loaded, path=path, stat=key)
            else:
                bundle = bundle_from_bytes(data, self.device, source=str(path))
                if loaded is not None:
                    log.warning("bundle %s replaced: sha256 %s -> %s; reloaded", name, short_sha(loaded.sha256),
                                short_sha(sha256))
                localizer = Localizer(bundle, self.device, fast_episode=self.fast_episode)
                loaded = LoadedBundle(name, path, sha256, bundle, localizer, key)
                fresh = True
            self._loaded[name] = loaded
        if fresh and self.on_load is not None:
            self.on_load(loaded)
        return loaded

    def verifier(self, name: str) -> KindVerifier | None:
        """The known-kinds verifier installed beside bundle ``name`` (``<name>.verifier``, ``models.verifier``),
        loaded on first use and again once its file changed; ``None``: there is none, or it cannot be read (logged:
        the sets' calibrated fits are served instead). It needs no model: the API reads it in every mode."""
        if not BUNDLE_NAME.match(name):
            return None
        path = verifier_path(self.bundle_dir / f"{name}.pt")
        try:
            key: _StatKey | None = _stat_key(path.stat())
        except OSError:
            key = None
        cached = self._verifiers.get(name)
        if cached is not None and cached[0] == key:
            return cached[1]
        verifier = None
        if key is not None:
            try:
                verifier = load_verifier(path)
            except (OSError, ValueError, RuntimeError, KeyError) as e:  # a broken file: ValueError
                log.warning("verifier %s not read (%s): sets of bundle %s keep their calibrated fits", path, e, name)
        self._verifiers[name] = (key, verifier)
        return verifier

    def is_loaded(self, name: str) -> bool:
        return name in self._loaded

    def loaded(self) -> list[LoadedBundle]:
        """The bundles loaded so far (their current files)."""
        with self._lock:
            return list(self._loaded.values())

    def cached_policy(self, key: Hashable, load: Callable[[], dict[str, Tensor]]) -> dict[str, Tensor]:
        """``load()``'s result, cached under ``key`` (checkpoints never change once written; a key should
        name the bundle too, as the same checkpoint is refused by another bundle file)."""
        return self._policies.get(key, load)


def bundle_for_set(bundles: BundleRegistry, es: ExemplarSet) -> LoadedBundle:
    """The bundle that serves the exemplar set ``es`` (API and worker alike): the file installed under its
    bundle's name, if it is the one that made the set's prototype. Raises ``BundleReplaced`` if the set
    recorded another file's sha256, ``BundleMismatch`` if the file makes prototypes of another dimension
    (a set with no recorded sha256), and what ``BundleRegistry.get`` raises."""
    loaded = bundles.get(es.bundle, expect_sha256=es.bundle_sha256)
    if es.prototype_dim != loaded.bundle.prototype_dim:
        raise BundleMismatch(
            f"bundle {es.bundle!r} (sha256 {short_sha(loaded.sha256)}) makes prototypes of dimension "
            f"{loaded.bundle.prototype_dim}, but this exemplar set's prototype has dimension {es.prototype_dim}: "
            "it was made by another bundle file of that name. Re-create the exemplar set from its crops.")
    return loaded


def prototype_to_bytes(prototype: Tensor) -> bytes:
    """``[D]`` -> float32 little-endian bytes."""
    return prototype.detach().cpu().numpy().astype("<f4").tobytes()


def prototype_from_bytes(data: bytes) -> Tensor:
    """float32 little-endian bytes -> ``[D]``."""
    return torch.from_numpy(np.frombuffer(data, dtype="<f4").copy())


def read_checkpoint(store: BlobStore, *, blob: str, sha256: str, bundle: Bundle, source: str | None = None
                    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """An adapted checkpoint's (agent state, meta), after checking the file's digest and that it belongs
    to ``bundle`` (name, file sha256 and prototype dimension, as far as the checkpoint records them:
    ``models.bundle.PolicyMismatch`` otherwise). The bytes checked are the bytes decoded (one read)."""
    data = store.read_verified(blob, sha256)
    return policy_from_bytes(data, bundle, source=source or f"checkpoint {blob}")


def read_served_checkpoint(store: BlobStore, *, blob: str, sha256: str, bundle: Bundle, source: str | None = None
                           ) -> tuple[dict[str, Tensor], Reward | None]:
    """What serving a checkpoint needs: (agent state, the repaired reward it carries or ``None``), checked
    as ``read_checkpoint`` checks; heads it keeps apart (format 6) read from ``store``, each checked by its digest."""
    data = store.read_verified(blob, sha256)
    agent, _, reward = checkpoint_from_bytes(data, bundle, source=source or f"checkpoint {blob}",
                                             load_head=lambda ref: read_head(store, ref))
    return agent, reward


def read_head(store: BlobStore, ref: HeadRef) -> dict[str, Tensor]:
    """A head a format-6 checkpoint keeps apart (``worker.jobs``: ``{"key", "sha256"}`` of its blob)."""
    return head_from_bytes(store.read_verified(ref["key"], ref["sha256"]), source=f"head {ref['key']}")


def store_head(store: BlobStore, key_of: Callable[[str], str], head: dict[str, Tensor]) -> HeadRef:
    """Store ``head`` apart for format-6 checkpoints under ``key_of(its digest)`` (once: a blob that is there is the
    same bytes) -> its reference, as ``read_head`` reads it."""
    data = head_to_bytes(head)
    sha = hashlib.sha256(data).hexdigest()
    key = key_of(sha)
    if not store.exists(key):
        store.put(key, data)
    return {"key": key, "sha256": sha}
