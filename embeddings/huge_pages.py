"""2 MiB pages for the embedding tables in host memory.

Tables are read and written a row here, a row there: with 4 KiB pages nearly
every row of a 1.3 GB table costs a TLB miss. ``madvise(MADV_HUGEPAGE)`` asks
for 2 MiB pages where transparent huge pages are "madvise" (the common default)
or "always": the row updates and lookups of a step then miss the TLB far less.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

_MADV_HUGEPAGE = 14  # <sys/mman.h>
_HUGE = 2 << 20
MIN_BYTES = 64 << 20  # smaller tensors are not worth it


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask the kernel to back a large CPU tensor with 2 MiB pages (madvise).

    Call it before the tensor is first written: pages faulted in afterwards are
    huge at once; ones already present wait for khugepaged. False (and nothing
    done) for small or non-CPU tensors and where the call is not available.
    """
    nbytes = tensor.untyped_storage().nbytes()
    if tensor.device.type != "cpu" or nbytes < MIN_BYTES or not sys.platform.startswith("linux"):
        return False
    try:
        madvise = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").madvise
    except (OSError, AttributeError):
        return False
    start = tensor.untyped_storage().data_ptr()
    first = (start + _HUGE - 1) & ~(_HUGE - 1)  # the 2 MiB-aligned interior
    last = (start + nbytes) & ~(_HUGE - 1)
    if last <= first:
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise(first, last - first, _MADV_HUGEPAGE) == 0


def huge_page_bytes(tensors: list[torch.Tensor]) -> list[int] | None:
    """Bytes of each CPU tensor's storage that the kernel backs with 2 MiB pages now:
    the AnonHugePages of the mappings holding it (madvise splits a mapping, so its
    2 MiB-aligned interior is a mapping of its own), at most the storage's size. None
    where /proc/self/smaps cannot be read. A gather of random rows from a table on 4 KiB
    pages misses the TLB at nearly every row; the kernel may fall back to them when
    memory is fragmented, whatever was advised: Hotline's summary says how much it got."""
    try:
        with open("/proc/self/smaps") as fh:
            text = fh.read()
    except OSError:
        return None
    spans = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors]
    found = [0] * len(spans)
    inside: list[int] = []
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = [i for i, (start, size) in enumerate(spans) if lo < start + size and start < hi]
        elif inside and head == "AnonHugePages:":
            for i in inside:
                found[i] += int(line.split()[1]) * 1024
    return [min(f, size) for f, (_, size) in zip(found, spans)]
