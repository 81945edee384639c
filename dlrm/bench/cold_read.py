"""``dlrm bench --reader-only``'s cold first read, beside the disk's own read rate.

    drop     fsync, then posix_fadvise(DONTNEED) on each file: its clean pages leave the cache
    check    mincore: the share of the files' pages still resident (0 when the drop took)
    reader   one epoch read through the caller's ``read()`` (rows/s, cold)
    drop     again, and check
    disk     the files' bytes read in order, 8 MiB at a time: MB/s, and rows/s worth

Where the drop does not take (another OS, a file system that ignores the advice) the
resident share says so and the "cold" figures are warm ones. On a virtual machine the
disk may be the host's cache: the disk rate is what a read costs this machine, whatever
lies behind it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

_READ = 8 << 20


def cold_read(files: list[str], read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """{"reader_rows_per_s", "resident_before_reader", "disk_mb_s", "disk_rows_per_s",
    "resident_before_disk", "bytes"}; ``read()`` reads ``files`` once and returns its
    {"rows", "rows_per_s"}."""
    size = sum(os.path.getsize(f) for f in files)
    drop(files)
    before_reader = resident(files)
    reader = read()
    drop(files)
    before_disk = resident(files)
    t0 = time.perf_counter()
    got = sum(_read_bytes(f) for f in files)
    seconds = time.perf_counter() - t0
    return {"reader_rows_per_s": reader["rows_per_s"], "resident_before_reader": before_reader,
            "disk_mb_s": got / seconds / 1e6, "disk_rows_per_s": reader["rows"] / seconds,
            "resident_before_disk": before_disk, "bytes": size}


def drop(files: list[str]) -> None:
    """Ask the kernel to drop ``files`` from the page cache (written back first)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident(files: list[str]) -> float | None:
    """Share of ``files``' pages in the page cache (mincore); None where it cannot be asked."""
    import ctypes
    import ctypes.util
    import mmap

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return None
    page, total, cached = mmap.PAGESIZE, 0, 0
    for path in files:
        n = os.path.getsize(path)
        if n == 0:
            continue
        with open(path, "rb") as f, mmap.mmap(f.fileno(), n, access=mmap.ACCESS_COPY) as mm:
            pages = -(-n // page)
            vec = (ctypes.c_ubyte * pages)()
            buf = ctypes.c_char.from_buffer(mm)
            try:
                if libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(n), vec):
                    return None
            finally:
                del buf  # the mmap closes only once no buffer points into it
            total += pages
            cached += int(np.count_nonzero(np.frombuffer(vec, np.uint8) & 1))
    return cached / total if total else 0.0


def _read_bytes(path: str) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_READ):
            n += len(chunk)
    return n


def format_cold(c: dict[str, Any]) -> str:
    def share(x: float | None) -> str:
        return "unknown" if x is None else f"{x:.0%}"

    return (f"cold first read: {c['reader_rows_per_s']:,.0f} rows/s through the reader "
            f"({share(c['resident_before_reader'])} of the files' pages cached before it); "
            f"the disk alone {c['disk_mb_s']:,.0f} MB/s = {c['disk_rows_per_s']:,.0f} rows/s "
            f"({c['bytes'] / 1e6:,.0f} MB, {share(c['resident_before_disk'])} cached before it)")
