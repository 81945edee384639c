"""Rows of a saved table gathered by row id into a live block: a warm start's read.

A checkpoint's table pieces (``tables.py``) are raw row-major files. A warm start needs,
for each row of a block this rank holds, the old row of the same value (``row_map.py``),
wherever it lies: each piece is mapped (``np.memmap``, read-only) and the rows it holds
fancy-indexed out (the caller goes a chunk of the block at a time). Only the pages of the rows asked for
are read, and they stay the page cache's: no copy of the old table is made.

    block rows 0..n of the new key       old_rows [n] (-1: none)     pieces of the old key
    ┌──────────┐                          [ 5, -1, 2, 9, ...]         rank-0.0.bin rows 0-7
    │ row 0    │ ◄── piece 0, row 5                                  rank-1.0.bin rows 8-15
    │ row 1    │     (kept: no old row)
    │ row 2    │ ◄── piece 0, row 2
    │ row 3    │ ◄── piece 1, row 9 - 8
    └──────────┘

Bytes are sliced as bytes (any dtype: fp32, bf16, int64 counters) and converted on the
copy into the block (a bf16 table warm-started from an fp32 one is rounded once).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch


def fill_rows(path: Path, pieces: list[dict[str, Any]], dtype: torch.dtype, dest: torch.Tensor,
              at: tuple[int, int], old_rows: np.ndarray) -> int:
    """Copy old row ``old_rows[i]`` of the key into row i of matrix ``dest`` (whose first
    element is element ``at`` of the new key), for every i with ``old_rows[i] >= 0``,
    from the ``pieces`` (index.json entries of the old key, files under ``path``, of
    ``dtype``). The elements copied; the caller checks that every wanted one was."""
    copied = 0
    cols = at[1], at[1] + dest.shape[1]
    for piece in pieces:
        (r0, c0), (nr, nc) = piece["offsets"], piece["sizes"]
        lo, hi = max(c0, cols[0]), min(c0 + nc, cols[1])
        if lo >= hi or nr == 0:
            continue
        inside = np.flatnonzero((old_rows >= r0) & (old_rows < r0 + nr))
        if not len(inside):
            continue
        size = dtype.itemsize
        stored = np.memmap(path / piece["file"], dtype=np.uint8, mode="r", shape=(nr, nc * size))
        try:
            inside = inside[np.argsort(old_rows[inside], kind="stable")]  # the file in order
            raw = np.ascontiguousarray(stored[old_rows[inside] - r0, (lo - c0) * size:(hi - c0) * size])
            values = torch.from_numpy(raw).view(dtype).to(dest.device, dest.dtype)
            dest[:, lo - cols[0]:hi - cols[0]].index_copy_(0, torch.from_numpy(inside).to(dest.device), values)
            copied += values.numel()
        finally:
            del stored  # unmapped: the pages leave this process
    return copied

