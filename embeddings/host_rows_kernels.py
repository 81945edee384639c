"""The numba kernels behind host_rows.py: rows of a host table gathered and stored.

Imported (with numba) at host_rows.py's first compiled call, not with it: an fp32
process that copies no host row never imports numba. Each kernel is compiled at its
first call in a process, or loaded from numba's disk cache (``cache=True``), which
keys it by this file's stamp: the kernels inline ``row_ahead`` from
rounding_cpu_kernels.py, so an edit to it needs this file touched too.
"""

from __future__ import annotations

import numba

from embeddings.rounding_cpu_kernels import row_ahead


@numba.njit(nogil=True, cache=True)
def gather_kernel(table, ids, out, start, end):
    """out[i] = table[ids[i]] for i in [start, end); the first i whose id is out of
    range (nothing copied from there on), else -1."""
    rows = table.shape[0]
    for i in range(start, end):
        if ids[i] < 0 or ids[i] >= rows:
            return i
        row = row_ahead(table, ids, i, end)
        for c in range(table.shape[1]):
            out[i, c] = row[c]
    return -1


@numba.njit(nogil=True, cache=True)
def store_kernel(table, ids, rows, start, end):
    """table[ids[i]] = rows[i] for i in [start, end); the first i whose id is out of
    range (nothing stored from there on), else -1. The rows written are read first
    (``row_ahead``): a store to a line not in cache reads it anyway."""
    count = table.shape[0]
    for i in range(start, end):
        if ids[i] < 0 or ids[i] >= count:
            return i
        row = row_ahead(table, ids, i, end)
        for c in range(table.shape[1]):
            row[c] = rows[i, c]
    return -1
