"""The serving side of ``models``: bundles loaded once by name, policies cached by checkpoint.

``BundleRegistry`` is shared by the API (localization) and the worker (adaptation): every
``<bundle_dir>/<name>.pt`` is servable as ``name``; each is loaded on first use and kept.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from app.storage import BlobStore
from models.bundle import Bundle, load_bundle, load_policy
from models.inference import Localizer, resolve_device

BUNDLE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


class UnknownBundle(LookupError):
    pass


@dataclass
class LoadedBundle:
    name: str
    """The name it is served under (its file's stem)."""
    path: Path
    sha256: str
    """Of the bundle file: the identity of its base policy."""
    bundle: Bundle
    localizer: Localizer


class BundleRegistry:
    def __init__(self, bundle_dir: str | Path, device: str = "auto", policy_cache_size: int = 32):
        self.bundle_dir = Path(bundle_dir)
        self.device = resolve_device(device)
        self._loaded: dict[str, LoadedBundle] = {}
        self._lock = threading.Lock()
        self._policies: OrderedDict[object, dict[str, Tensor]] = OrderedDict()
        self._policy_cache_size = policy_cache_size

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

    def get(self, name: str) -> LoadedBundle:
        """The bundle served as ``name``, loaded on first use; raises ``UnknownBundle``."""
        loaded = self._loaded.get(name)
        if loaded is not None:
            return loaded
        with self._lock:
            loaded = self._loaded.get(name)
            if loaded is None:
                path = self.path(name)
                data = path.read_bytes()
                bundle = load_bundle(path, self.device)
                loaded = LoadedBundle(name, path, hashlib.sha256(data).hexdigest(), bundle,
                                      Localizer(bundle, self.device))
                self._loaded[name] = loaded
        return loaded

    def is_loaded(self, name: str) -> bool:
        return name in self._loaded

    def cached_policy(self, key: object, load) -> dict[str, Tensor]:  # type: ignore[no-untyped-def]
        """``load()``'s result, cached under ``key`` (checkpoints never change once written)."""
        with self._lock:
            if key in self._policies:
                self._policies.move_to_end(key)
                return self._policies[key]
        state = load()
        with self._lock:
            self._policies[key] = state
            while len(self._policies) > self._policy_cache_size:
                self._policies.popitem(last=False)
        return state


def prototype_to_bytes(prototype: Tensor) -> bytes:
    """``[D]`` -> float32 little-endian bytes."""
    return prototype.detach().cpu().numpy().astype("<f4").tobytes()


def prototype_from_bytes(data: bytes) -> Tensor:
    """float32 little-endian bytes -> ``[D]``."""
    return torch.from_numpy(np.frombuffer(data, dtype="<f4").copy())


def read_checkpoint(store: BlobStore, *, blob: str, sha256: str, bundle: Bundle
                    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """An adapted checkpoint's (agent state, meta), after checking the file's digest and bundle."""
    store.read_verified(blob, sha256)
    return load_policy(store.path(blob), bundle)
