"""Each loaded bundle's greedy episode compiled in the background (``models.compiled``), never on a request: the
one-image episode, then the episode of batches of 2-15 images (what the engine runs for concurrent requests).

A one-image localize request spends most of its model time dispatching the greedy episode's small operations;
compiled, the episode takes about a third of that with the same boxes (a batch of 2-8: 1.5-1.8x faster).
Compiling takes tens of seconds on a small CPU (a few from inductor's on-disk cache), so it runs on a daemon
thread once a bundle is loaded, and the API answers with the eager episode until it is done. A failure (no C++
compiler in the image, an operation the compiler does not support) is logged and leaves the bundle eager:
slower, never wrong.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from app.config import Settings
from app.inference import BundleRegistry, LoadedBundle

log = logging.getLogger(__name__)


class EpisodeWarmup:
    """``BundleRegistry``'s ``on_load``: compiles the loaded bundle's greedy episodes (one image, then batches of
    2-15) on a background thread. CPU only (on a GPU the episode stays eager), and only for bundles that answer
    with the episode's last box (the cMNIST ones; the photo bundles' default answer, the nearest visited box, is a
    search that embeds every step). ``observe(outcome)`` is told ``"compiled"`` or ``"failed"`` for each bundle
    compiled."""

    def __init__(self, observe: Callable[[str], None] | None = None):
        self.observe = observe
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # bundles load on request threads: two may call at once

    def __call__(self, loaded: LoadedBundle) -> None:
        if loaded.localizer.device.type != "cpu" or loaded.localizer.default_nearest:
            return  # a GPU, or a bundle whose answer is the nearest visited box (a search): the eager episode
        thread = threading.Thread(target=self._warm, args=(loaded,), name=f"qloc-compile-{loaded.name}", daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _warm(self, loaded: LoadedBundle) -> None:
        try:
            seconds = loaded.localizer.compile_episode()
        except Exception as e:  # noqa: BLE001 -- any failure leaves the eager episode, which is correct
            log.warning("bundle %s: its episode was not compiled (served eager): %s: %s",
                        loaded.name, type(e).__name__, e)
            outcome = "failed"
        else:
            log.info("bundle %s: episodes (one image, batches) compiled in %.1f s", loaded.name, seconds)
            outcome = "compiled"
        if self.observe is not None:
            try:
                self.observe(outcome)
            except Exception:  # noqa: BLE001 -- a metric never stops serving
                log.exception("compile observer failed")

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the compiles started so far -> whether all have finished."""
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout)
        return not any(t.is_alive() for t in threads)


def _torch_default_cache_dir() -> str | None:
    """Where inductor caches when ``TORCHINDUCTOR_CACHE_DIR`` is unset (``None``: this torch does not say)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return None
    return os.path.abspath(default_cache_dir())


def install(bundles: BundleRegistry, settings: Settings, observe: Callable[[str], None] | None = None
            ) -> EpisodeWarmup | None:
    """Compile the episode of every bundle ``bundles`` loads from now on, and of those it has loaded, unless
    ``settings.compile_episode`` is off (-> ``None``). Inductor's cache goes to ``<storage_dir>/compile-cache``
    unless ``TORCHINDUCTOR_CACHE_DIR`` says where (a restart then compiles in seconds)."""
    if not settings.compile_episode:
        return None
    ours = str((settings.storage_dir / "compile-cache").resolve())
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, _torch_default_cache_dir()):
        # unset, or set by torch itself to its default (inductor writes the variable the first time it looks, which an
        # import may have done already): ours; a place set by the deployment stays
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = ours
    warmup = EpisodeWarmup(observe)
    bundles.on_load = warmup
    for loaded in bundles.loaded():
        warmup(loaded)
    return warmup
