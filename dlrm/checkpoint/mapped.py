"""Giving back the pages of a tensor mapped from a checkpoint file once it is copied.

``torch.load(mmap=True)`` maps state.pt privately: a tensor's pages are read from the
file (or the page cache) when first touched and then count in this process's RSS
until the mapping goes. A model that copies a large mapped tensor into its own
storage (the TorchRec backend's tables) calls :func:`release` after each copy: the
pages leave the process (``madvise(MADV_DONTNEED)``; on a private file mapping a
later touch reads them again from the file), so at most one table's pages are held
beside the model instead of every table's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import torch

MADV_DONTNEED = 4  # Linux
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def release(t: torch.Tensor) -> bool:
    """Drop the whole pages that contiguous ``t`` spans from this process; whether it
    did (a tensor not contiguous on the CPU, or spanning no whole page, is left
    alone). For tensors of a read-only private file mapping that nothing writes, or
    for memory nothing reads again (``dlrm export``'s tables once quantised): an
    anonymous page dropped reads back as zeros."""
    if t.device.type != "cpu" or not t.is_contiguous() or not hasattr(_libc, "madvise"):
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = end // mmap.PAGESIZE * mmap.PAGESIZE
    if last <= first:
        return False
    return _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED) == 0
