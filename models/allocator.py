"""glibc's allocator tuned for torch on the CPU: batched activations reuse the heap's pages.

A batch's activations are tensors of a few to a few tens of MiB. glibc serves such blocks with ``mmap``
at first and, as they are freed, raises its thresholds only so far: a freed block still leaves the heap
(``munmap`` or a trim) often enough that every forward pass faults its pages in again, zeroed by the kernel.
On a 2-core VM that doubled the cMNIST encoder's time per image at batch 16 (1.51 -> 0.77 ms; batch 64:
1.03 -> 0.79 ms) and held localization at batch 64 to 374 images/s instead of 533 (BENCHMARKS.md,
"Allocator"). Fixed thresholds keep blocks under ``mmap_threshold`` on the heap and let it keep up to
``trim_threshold`` of free memory at its top: the memory one batch frees is the next one's, without faults.
Larger blocks are mapped and unmapped as before, so a process keeps at most ``trim_threshold`` more per
heap than it uses.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20
"""glibc's largest ``M_MMAP_THRESHOLD`` on 64-bit systems (``DEFAULT_MMAP_THRESHOLD_MAX``)."""
TRIM_THRESHOLD = 64 << 20


def tune_malloc(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Set glibc's ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` for this process (see the module) -> whether
    both were taken. Elsewhere (not Linux, another C library without ``mallopt``): nothing, ``False``."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1
    if not ok:
        log.info("mallopt refused the allocator's thresholds; glibc's defaults stay")
    return ok
