"""glibc malloc settings for a CPU worker: keep freed memory for reuse.

A prefill step on CPU allocates activations of tens to hundreds of MB (a 16 x 512-token
step of SmolLM2: the gate_up output alone is 100 MB in fp32) and frees them at the end of
the step. glibc serves requests above its mmap threshold (32 MiB at most) with a fresh
``mmap`` and unmaps them on ``free``, and trims the heap's free top back to the kernel, so
every step pays a page fault and a page clear per 4 KiB of activations again. Measured on a
2-vCPU AMD EPYC VM (benchmarks/RESULTS.md, "glibc malloc"): about 8% of a 16 x 512 bf16
prefill step in the kernel's page-fault path, and the step 1.0-1.3x faster with the
settings below. vLLM's CPU backend has the same problem and asks for tcmalloc to be
preloaded (its CPU installation guide); this does the equivalent with glibc's own knobs,
at run time, without a preloaded library.

:func:`keep_freed_memory` sets ``M_MMAP_MAX`` to 0 (every allocation from the heap, so a
freed block is reused) and ``M_TRIM_THRESHOLD`` to :data:`TRIM_THRESHOLD` (the heap keeps
up to that much free memory instead of returning it). The process's resident memory stays
at its peak: a serving worker's steady state. ``PAGEDSERVE_MALLOC_KEEP=0`` leaves glibc's
defaults. Both are process-wide, so the call belongs where a worker process starts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

log = logging.getLogger(__name__)

# mallopt parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD = 1 << 30  # bytes of free heap top kept (1 GiB)
_FALSY = ("0", "false", "no", "off", "")


def enabled() -> bool:
    """False when ``PAGEDSERVE_MALLOC_KEEP`` is ``0``/``false``/``no``/``off``/empty."""
    return os.environ.get("PAGEDSERVE_MALLOC_KEEP", "1").strip().lower() not in _FALSY


def keep_freed_memory() -> bool:
    """Apply the settings of the module docstring to this process's glibc malloc.

    Returns:
        True when both were applied; False when disabled, not on Linux with glibc, or
        glibc refused one (mallopt returned 0; logged).
    """
    if not enabled() or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        log.warning("glibc mallopt refused M_MMAP_MAX / M_TRIM_THRESHOLD; defaults kept")
    return ok
