"""Rows of a host table copied on threads of ours: gathered and stored, off torch's threads.

    gather_rows   out[i] = table[ids[i]]        (index_select(table, 0, ids, out=out))
    store_rows    table[ids[i]] = rows[i]       (table.index_copy_(0, ids, rows))

    table [R, D] (or [R]: a row-wise state)   ids [U] int64   out / rows [U, D]

Why not torch's own calls: each spreads over torch's intra-op threads (OpenMP), as many
as the machine has cores, and returns when the last of them is done. Beside decode
workers busy on those cores, one thread not scheduled holds the whole call up. On this
2-core machine, with two busy processes beside it, a 1 MB ``copy_`` took 15 us at the
median and 3.7 ms on average (``np.copyto``: 24 us both), and an ``index_select`` of 4,500
rows of 64 fp32 379 us on average against 188 on one thread. On the H200 (53f03e8), the
Hotline step's cold gather, one such call of ~1 MB, took 1.3 ms, where the same gather
alone took 0.05 ms on 16 idle threads and 0.22 on one.

So here each copy is a numba kernel (``nogil``) on the calling thread, or on ``threads``
threads of the caller's pool, each a slice of the ids: exactly that many threads, none
waiting on another's schedule. One such thread is a little faster than torch's call on
one thread: 4,500 random rows of 64 fp32 from an 8.6 GB table on 2 MiB pages, fresh ids
each time, took 227-231 us at the median here against 259-262 for ``index_select`` on
one thread (two runs, the calls interleaved). Each copy asks for the row ``AHEAD`` ids
on first (host_rows_kernels.py), so several misses are in flight.

A row travels as 8-byte integers where it can (else as integers of its element's size):
a copy, whatever the type. Ids out of range raise an IndexError, as torch's calls do.
Anything the kernels do not take (a tensor not contiguous, not on the CPU or requiring
grad; no numba) goes to torch's call, which gives the same result.

The kernel is host_rows_kernels.py's, imported with numba at the first compiled call
(``prepare``: when a host tier is built).
"""

from __future__ import annotations

from concurrent.futures import Executor
from functools import cache

import numpy as np
import torch

from embeddings.rounding_cpu import available

# an element's bytes as a numpy integer of its size
_SAME_SIZE = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


@cache
def _kernels():
    """host_rows_kernels.py, imported (with numba) at the first compiled call."""
    from embeddings import host_rows_kernels

    return host_rows_kernels


def prepare(tables: list[torch.Tensor]) -> None:
    """Compile now (or load from numba's disk cache) the gather and the store of rows of
    each of ``tables``, as a step will call them, so that no step does: a process's
    first compiled call starts numba, 0.36-0.48 s here with every kernel cached (a
    200-step Hotline run of the Criteo sample spent that in its first gather, 2 ms a
    step on average). Nothing without numba."""
    for table in tables:  # stand-ins of the table's row shape and type: the same kernels
        stand_in = torch.zeros(2, *table.shape[1:], dtype=table.dtype)
        one = torch.ones(1, dtype=torch.int64)
        store_rows(stand_in, one, gather_rows(stand_in, one, torch.empty_like(stand_in[:1])))


def gather_rows(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor,
                pool: Executor | None = None, threads: int = 1) -> torch.Tensor:
    """``out[i] = table[ids[i]]`` (``out`` returned): on this thread, or on ``threads``
    of ``pool``'s threads, a slice of ``ids`` each."""
    words = _words(table, ids, out)
    if words is None:
        return torch.index_select(table, 0, ids, out=out)
    _run(*words, ids, pool, threads, store=False)
    return out


def store_rows(table: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor,
               pool: Executor | None = None, threads: int = 1) -> None:
    """``table[ids[i]] = rows[i]`` (distinct ids: a repeated one's last row is not
    promised, as with ``index_copy_``), as ``gather_rows`` runs."""
    words = _words(table, ids, rows)
    if words is None:
        table.index_copy_(0, ids, rows)
        return
    _run(*words, ids, pool, threads, store=True)


def _words(table: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(table, ids, rows) as numpy arrays [count, words] of a row's bytes as integers:
    8 bytes where the rows' bytes and addresses allow (one 64-wide fp32 row: 32 words;
    as 4-byte words the loop took 2-3x as long on cached rows here), else the element's
    size (a 1-D table: one element a row); None where the kernels cannot take them.
    Numpy views (torch's own took 11 us a gather, these 4)."""
    size = table.element_size()
    if not (size in _SAME_SIZE and table.dtype == rows.dtype and ids.dtype == torch.int64
            and ids.dim() == 1 and table.dim() in (1, 2) and table.dim() == rows.dim()
            and rows.shape[1:] == table.shape[1:] and rows.shape[0] == ids.shape[0]
            and table.is_cpu and rows.is_cpu and ids.is_cpu and table.is_contiguous()
            and rows.is_contiguous() and ids.is_contiguous() and not table.requires_grad
            and not rows.requires_grad and available()):
        return None
    width = table.shape[1] if table.dim() == 2 else 1
    wide = (size * width) % 8 == 0 and table.data_ptr() % 8 == 0 and rows.data_ptr() % 8 == 0
    word = np.int64 if wide else _SAME_SIZE[size]

    def as_2d(t: torch.Tensor) -> np.ndarray:  # numpy has no bf16: those as int16
        flat = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
        return flat.reshape(t.shape[0], width).view(word)

    return as_2d(table), ids.numpy(), as_2d(rows)


def _run(table: np.ndarray, ids_np: np.ndarray, rows: np.ndarray, ids: torch.Tensor,
         pool: Executor | None, threads: int, store: bool) -> None:
    """The kernel over ``ids`` in ``threads`` slices (one: on this thread); an id out
    of range raises as torch would."""
    kernel = _kernels().copy_rows
    n = ids_np.shape[0]
    parts = max(1, min(threads, n)) if pool is not None else 1
    bounds = [(k * n // parts, (k + 1) * n // parts) for k in range(parts)]
    if parts == 1:
        bad = [kernel(table, ids_np, rows, 0, n, store)]
    else:
        bad = list(pool.map(lambda b: kernel(table, ids_np, rows, *b, store), bounds))
    for at in bad:
        if at >= 0:
            raise IndexError(f"index {int(ids[at])} is out of bounds for dimension 0 with size {table.shape[0]}")
