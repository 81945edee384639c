"""Raw tensor bytes to and from files, streamed: a bounded buffer, never a second copy.

A piece is a row range of one live tensor, written row-major as raw bytes, hashed as
the bytes go out (sha256, so the manifest needs no second read):

    live tensor [rows, cols] ──16 MiB of rows at a time──► sha256.update ─► file
    (a contiguous CPU tensor is written from its own memory: no copy at all)

Files are written past the page cache (``O_DIRECT``) where the file system allows
it, else fsynced and dropped from it: a save of tables that fill most of host memory
does not also fill the rest with dirty cache, which the kernel would have to write
back while the writers wait.

Reading fills a region of a live tensor from the part of a piece that overlaps it:
whole rows of a contiguous CPU tensor are read straight into its storage
(``readinto``); anything else (a column slice, a GPU tensor) goes through a buffer of
at most 16 MiB.

Tensors are seen as matrices: [n] as [n, 1], a 0-d tensor as [1, 1].
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
from pathlib import Path
from typing import Any

import torch

CHUNK_BYTES = 16 << 20  # the rows of a piece read or written at a time
DIRECT_BYTES = 8 << 20  # the aligned buffer of a file written with O_DIRECT
ALIGN = 4096  # O_DIRECT's alignment of addresses, offsets and sizes


class Truncated(Exception):
    """A file holds fewer bytes than the index says."""


def matrix(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a [rows, cols] view."""
    if t.dim() == 2:
        return t
    return t.reshape(1, 1) if t.dim() == 0 else t.reshape(t.shape[0], -1)


def as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def _chunk_rows(cols: int, dtype: torch.dtype) -> int:
    return max(1, CHUNK_BYTES // max(1, cols * dtype.itemsize))


def write_piece(path: Path, t: torch.Tensor) -> dict[str, Any]:
    """Write matrix ``t`` to ``path`` (fsynced); its {"bytes", "sha256"}."""
    h = hashlib.sha256()
    step = _chunk_rows(t.shape[1], t.dtype)
    sink = _Sink(path)
    try:
        for start in range(0, t.shape[0], step):
            chunk = t[start : start + step].detach()
            if chunk.device.type != "cpu" or not chunk.is_contiguous():
                chunk = chunk.to("cpu", copy=False).contiguous()
            flat = chunk.reshape(-1).view(torch.uint8)
            h.update(as_bytes(flat))  # hashing, copying and writing release the GIL:
            sink.write(flat)  # pieces are written by several threads at once
    finally:
        sink.close()
    return {"bytes": sink.size, "sha256": h.hexdigest()}


class _Sink:
    """A file written past the page cache (``O_DIRECT``, through one aligned 8 MiB
    buffer, the tail zero-padded then truncated) where the file system allows it,
    else an ordinary file dropped from the cache once fsynced. Buffered writes of
    gigabytes are throttled by the kernel's writeback and cost a copy into the page
    cache; direct ones go at the disk's rate."""

    def __init__(self, path: Path) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        except OSError:  # tmpfs and others refuse O_DIRECT
            self.fd, self.direct = os.open(path, flags, 0o644), False
        self.size = self.filled = 0
        if self.direct:  # page-aligned, and given back to the system at close (a heap
            self.pages = mmap.mmap(-1, DIRECT_BYTES)  # buffer per file stayed resident)
            self.buffer = torch.frombuffer(self.pages, dtype=torch.uint8)

    def write(self, flat: torch.Tensor) -> None:
        self.size += flat.numel()
        while self.direct and flat.numel():
            n = min(flat.numel(), DIRECT_BYTES - self.filled)
            self.buffer[self.filled : self.filled + n].copy_(flat[:n])
            self.filled, flat = self.filled + n, flat[n:]
            if self.filled == DIRECT_BYTES:
                self._flush(DIRECT_BYTES)
        if flat.numel():
            _write_all(self.fd, as_bytes(flat))

    def _flush(self, n: int) -> None:
        try:
            _write_all(self.fd, as_bytes(self.buffer[:n]))
        except OSError as e:  # opened with O_DIRECT, refused at the write: go on buffered
            if e.errno != errno.EINVAL:
                raise
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False
            _write_all(self.fd, as_bytes(self.buffer[:n]))
        self.filled = 0

    def close(self) -> None:
        try:
            if self.filled:
                padded = -(-self.filled // ALIGN) * ALIGN
                self.buffer[self.filled : padded].zero_()
                self._flush(padded)
                os.ftruncate(self.fd, self.size)
            os.fsync(self.fd)
            if not self.direct and hasattr(os, "posix_fadvise"):  # written back: not needed in cache
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(self.fd)
            if hasattr(self, "pages"):
                del self.buffer
                self.pages.close()


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        data = data[os.write(fd, data) :]


def _read_exactly(fh: Any, into: memoryview, name: str) -> None:
    done = 0
    while done < len(into):
        got = fh.readinto(into[done:])
        if not got:
            raise Truncated(f"{name} is truncated")
        done += got


def read_overlap(
    path: Path,
    piece: tuple[tuple[int, int], tuple[int, int]],
    dest: torch.Tensor,
    at: tuple[int, int],
    sha: Any = None,
) -> int:
    """Fill the part of matrix ``dest`` (whose first element is element ``at`` of the
    key) that the piece stored in ``path`` covers (``piece``: its offsets and sizes
    in the key). Returns the elements filled (0 if they do not overlap).

    ``sha`` (a hashlib object): the whole file also goes through it, read once: a
    piece the region covers whole is hashed from the rows just read into ``dest``;
    one it covers in part is read whole, in order, through the buffer, and only the
    overlap copied out (no second read of any byte to verify it)."""
    (r0, c0), (nr, nc) = piece
    rows = max(r0, at[0]), min(r0 + nr, at[0] + dest.shape[0])
    cols = max(c0, at[1]), min(c0 + nc, at[1] + dest.shape[1])
    if rows[0] >= rows[1] or cols[0] >= cols[1]:
        return 0
    target = dest[rows[0] - at[0] : rows[1] - at[0], cols[0] - at[1] : cols[1] - at[1]]
    whole_rows = cols == (c0, c0 + nc)
    with open(path, "rb") as fh:
        if whole_rows and target.device.type == "cpu" and target.is_contiguous() and (
                sha is None or rows == (r0, r0 + nr)):
            fh.seek((rows[0] - r0) * nc * dest.dtype.itemsize)
            into = as_bytes(target)
            _read_exactly(fh, into, path.name)  # straight into the live storage
            if sha is not None:
                sha.update(into)  # from memory: the file is not read again
        else:
            span = (r0, r0 + nr) if sha is not None else rows  # hashing: every row of the file
            fh.seek((span[0] - r0) * nc * dest.dtype.itemsize)
            _copy_rows(fh, path.name, (span[0] - r0, span[1] - r0), (rows[0] - r0, rows[1] - r0),
                       (cols[0] - c0, cols[1] - c0), nc, target, sha)
    return (rows[1] - rows[0]) * (cols[1] - cols[0])


def _copy_rows(fh: Any, name: str, span: tuple[int, int], rows: tuple[int, int], cols: tuple[int, int],
               nc: int, target: torch.Tensor, sha: Any) -> None:
    """Read rows ``span`` (of ``nc`` columns) of a piece in order through a bounded
    buffer, hashing them if ``sha``; copy the part in ``rows`` × ``cols`` (``cols``
    relative to the piece's first column) into ``target``."""
    step = _chunk_rows(nc, target.dtype)
    buffer = torch.empty(min(step, span[1] - span[0]), nc, dtype=target.dtype)
    for start in range(span[0], span[1], step):
        part = buffer[: min(step, span[1] - start)]
        _read_exactly(fh, as_bytes(part), name)
        if sha is not None:
            sha.update(as_bytes(part))
        lo, hi = max(start, rows[0]), min(start + part.shape[0], rows[1])
        if lo < hi:
            target[lo - rows[0] : hi - rows[0]].copy_(part[lo - start : hi - start, cols[0] : cols[1]])
