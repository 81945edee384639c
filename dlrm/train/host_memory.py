"""Keep freed host memory for reuse instead of handing it back to the kernel.

A training step allocates and frees the same dozen large tensors every time
(activations, the pooled vectors, their gradients: up to ~14 MB each on the
bench model). glibc serves blocks above its mmap threshold with a fresh mmap and
unmaps them on free (the threshold adapts, but not to every size and order a
step frees in), and trims the heap top beyond its trim threshold, so steps keep
page-faulting some of those buffers in again. Raising both thresholds makes the
heap recycle them instead (``dlrm bench`` shows the effect on a step).

Blocks above 32 MiB (embedding tables, optimizer state) still get their own
mapping; the price is that up to 1 GiB of freed heap stays with the process.
(Those tables get 2 MiB pages instead: embeddings/huge_pages.py.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD = 1 << 30


def reuse_freed_memory() -> bool:
    """Tune glibc's malloc for this process; False where there is no glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )

