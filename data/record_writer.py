"""Decoded columns written into a window's records in one compiled pass (numba).

The decoder turns a row group's columns into whole records (data/rows.py), one per row:

    columns   label [n]   dense j [n] float32 (D)   ids k [n] int64 (P single-hot)
                  │             │                         │
                  ▼             ▼                         ▼
    record    [ id 0 | ... | id P-1 | dense 0..D-1 | label | pad ]   (rows.Layout)

numpy writes them one column at a time, each a strided copy of 8 or 4 bytes a row
(blocks of rows, so each block's records stay in cache): 1.75 ns an element on this
project's 2-core machine. Here blocks of 512 rows are written column by column in
registers: 0.9 ns (64k rows x 40 columns: 2.4 ms against 4.6-4.9). Over a shuffled
one-core read of bench_gpu's schema (1M rows) that is ~37 ms of ~510.

The kernel takes the columns as tuples of arrays, so numba compiles it once per
(P, D) pair; ``cache=True`` keeps each on disk (a later process, a decode worker,
loads it). Without numba, or with no packed id or no dense column (a tuple numba
cannot type), :func:`write` returns False and the caller writes column by column.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np

BLOCK_ROWS = 512  # rows of records written column by column at a time (~136 KB at 266 B a row)


def _write(rec64: np.ndarray, rec32: np.ndarray, ids: Any, dense: Any, labels: np.ndarray,
           dense_at: int, label_at: int) -> None:
    """rec64 [n, width/8] and rec32 [n, width/4] view the same records; ``dense_at`` and
    ``label_at`` count float32 words."""
    n = labels.shape[0]
    for a in range(0, n, BLOCK_ROWS):
        b = min(a + BLOCK_ROWS, n)
        for k in range(len(ids)):
            column = ids[k]
            for i in range(a, b):
                rec64[i, k] = column[i]
        for j in range(len(dense)):
            column = dense[j]
            for i in range(a, b):
                rec32[i, dense_at + j] = column[i]
        for i in range(a, b):
            rec32[i, label_at] = labels[i]


@cache
def _kernel() -> Callable[..., None] | None:
    """The compiled writer, or None without numba (imported here, at the first window:
    a process that decodes nothing never pays its import). nogil: a decode thread
    writes while the trainer's thread runs Python."""
    try:
        import numba
    except ImportError:
        return None
    return numba.njit(cache=True, nogil=True)(_write)


def write(rec: np.ndarray, ids: list[np.ndarray], dense: list[np.ndarray], labels: np.ndarray,
          dense_at: int, label_at: int) -> bool:
    """Rows ``rec`` [n, width] (uint8, contiguous rows, width a multiple of 8) given the
    packed ids (record slots 0..P-1, in order), the dense columns and the labels, each
    [n]; ``dense_at`` / ``label_at``: byte offsets in a record. False (nothing written)
    where it cannot: no numba, no packed id or no dense column."""
    kernel = _kernel()
    if kernel is None or not ids or not dense or not rec.flags.c_contiguous:
        return False
    kernel(rec.view(np.int64), rec.view(np.float32), tuple(_read_only(x, np.int64) for x in ids),
           tuple(_read_only(x, np.float32) for x in dense), _read_only(labels, np.float32),
           dense_at // 4, label_at // 4)
    return True


def _read_only(x: np.ndarray, dtype: type) -> np.ndarray:
    """``x`` as a contiguous ``dtype`` array, seen read-only: numba types a read-only
    array (arrow's zero-copy columns) apart from a writable one, and a tuple indexed in
    a loop must hold one type. A view: no copy where ``x`` is already so."""
    view = np.ascontiguousarray(x, dtype=dtype).view()
    view.flags.writeable = False
    return view
