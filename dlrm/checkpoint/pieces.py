"""Raw tensor bytes to and from files, streamed: a bounded buffer, never a second copy.

A piece is a row range of one live tensor, written row-major as raw bytes, hashed as
the bytes go out (sha256, so the manifest needs no second read):

    live tensor [rows, cols] ──16 MiB of rows at a time──► sha256.update ─► file
    (a contiguous CPU tensor is written from its own memory: no copy at all)

Each file is fsynced, then dropped from the page cache: a save of tables that fill
most of host memory does not also fill the rest with dirty cache, which the kernel
would have to write back while the writers wait.

Reading fills a region of a live tensor from the part of a piece that overlaps it:
whole rows of a contiguous CPU tensor are read straight into its storage
(``readinto``); anything else (a column slice, a GPU tensor) goes through a buffer of
at most 16 MiB.

Tensors are seen as matrices: [n] as [n, 1], a 0-d tensor as [1, 1].
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

CHUNK_BYTES = 16 << 20  # the buffer of one read or write


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
    size = 0
    step = _chunk_rows(t.shape[1], t.dtype)
    with open(path, "wb") as fh:
        for start in range(0, t.shape[0], step):
            chunk = t[start : start + step].detach()
            if chunk.device.type != "cpu" or not chunk.is_contiguous():
                chunk = chunk.to("cpu", copy=False).contiguous()
            data = as_bytes(chunk)
            h.update(data)  # both release the GIL: pieces are written by several threads
            fh.write(data)
            size += len(data)
        fh.flush()
        os.fsync(fh.fileno())
        if hasattr(os, "posix_fadvise"):  # written back: its cached pages are not needed
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return {"bytes": size, "sha256": h.hexdigest()}


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
) -> int:
    """Fill the part of matrix ``dest`` (whose first element is element ``at`` of the
    key) that the piece stored in ``path`` covers (``piece``: its offsets and sizes
    in the key). Returns the elements filled (0 if they do not overlap)."""
    (r0, c0), (nr, nc) = piece
    rows = max(r0, at[0]), min(r0 + nr, at[0] + dest.shape[0])
    cols = max(c0, at[1]), min(c0 + nc, at[1] + dest.shape[1])
    if rows[0] >= rows[1] or cols[0] >= cols[1]:
        return 0
    item = dest.dtype.itemsize
    target = dest[rows[0] - at[0] : rows[1] - at[0], cols[0] - at[1] : cols[1] - at[1]]
    with open(path, "rb") as fh:
        fh.seek((rows[0] - r0) * nc * item)
        if cols == (c0, c0 + nc) and target.device.type == "cpu" and target.is_contiguous():
            _read_exactly(fh, as_bytes(target), path.name)  # straight into the live storage
        else:
            step = _chunk_rows(nc, dest.dtype)
            buffer = torch.empty(min(step, rows[1] - rows[0]), nc, dtype=dest.dtype)
            for start in range(0, rows[1] - rows[0], step):
                part = buffer[: min(step, rows[1] - rows[0] - start)]
                _read_exactly(fh, as_bytes(part), path.name)
                target[start : start + part.shape[0]].copy_(part[:, cols[0] - c0 : cols[1] - c0])
    return (rows[1] - rows[0]) * (cols[1] - cols[0])
