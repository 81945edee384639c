"""The numba kernel behind host_rows.py: rows of a host table gathered or stored.

Imported (with numba) at host_rows.py's first compiled call, not with it: an fp32
process that copies no host row never imports numba. The kernel is compiled at its
first call in a process, or loaded from numba's disk cache (``cache=True``), which
keys it by this file's stamp: it inlines ``prefetch_line`` from
rounding_cpu_kernels.py, so an edit to that needs this file touched too.
"""

from __future__ import annotations

import numba

from embeddings.rounding_cpu_kernels import AHEAD, LINE, prefetch_line


@numba.njit(nogil=True, cache=True)
def copy_rows(table, ids, rows, start, end, store):
    """For i in [start, end): rows[i] = table[ids[i]] (a gather), or, ``store``,
    table[ids[i]] = rows[i]; the first i whose id is out of range (nothing copied from
    there on), else -1. The row ``AHEAD`` ids on is asked for first (a store to a line
    not in cache reads it first too; a prefetch of any address is harmless: one out of
    range is not read)."""
    count, width = table.shape
    # a row's cache lines, the step worked out once: per row (rounding_cpu_kernels'
    # prefetch_row, inlined) the gather took 275 us against 230 (4,500 rows of 256 B)
    step = max(1, LINE // table.itemsize)
    for i in range(start, end):
        if i + AHEAD < end:
            ahead = ids[i + AHEAD]
            for c in range(0, width, step):
                prefetch_line(table, ahead, c)
        row = ids[i]
        if row < 0 or row >= count:
            return i
        if store:
            for c in range(width):
                table[row, c] = rows[i, c]
        else:
            for c in range(width):
                rows[i, c] = table[row, c]
    return -1
