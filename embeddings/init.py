"""Initial table values that any shard can make on its own.

A table is filled block by block (``INIT_BLOCK_ROWS`` rows each), every block from
its own generator seeded by (seed, table name, block index). A row-wise or
column-wise shard therefore makes exactly its slice of the table that a single
process would have, without building the rest:

    rows 0..4095 ← gen(seed, "C1", 0)   rows 4096..8191 ← gen(seed, "C1", 1)   ...

Values: uniform(-sqrt(1/rows), sqrt(1/rows)), DLRM's and TorchRec's default.

``out=`` fills a caller's tensor (the weight's rows, on any device, in any dtype) in
place, so a table near the memory size needs no second copy of itself (before, the
whole slice was made and then copied: twice the table at the peak). Blocks being
independent, cuts of ``STAGE_ROWS`` rows are made on ``torch.get_num_threads()``
threads (torch's kernels release the GIL): written straight into an fp32 host ``out``,
else made in fp32 on the host and copied (converted) in order, a few cuts in flight.
The values do not depend on the threads.
"""

from __future__ import annotations

import math
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

INIT_BLOCK_ROWS = 4096
STAGE_ROWS = 64 * INIT_BLOCK_ROWS  # rows per cut: a thread's task, one copy to a device


def _block_seed(seed: int, table: str, block: int) -> int:
    return (seed * 1_000_003 + zlib.crc32(table.encode()) * 7919 + block) % (2**63 - 1)


def init_rows(
    table: str,
    table_rows: int,
    dim: int,
    seed: int,
    row_start: int = 0,
    row_end: int | None = None,
    col_start: int = 0,
    col_end: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows [row_start, row_end) x cols [col_start, col_end) of the initial table,
    written into ``out`` ([rows, cols], any dtype or device) when given, else into a
    new fp32 host tensor. Returns it."""
    row_end = table_rows if row_end is None else row_end
    col_end = dim if col_end is None else col_end
    shape = (row_end - row_start, col_end - col_start)
    if out is None:
        out = torch.empty(shape)
    elif tuple(out.shape) != shape:
        raise ValueError(f"init_rows: out is {tuple(out.shape)}, the slice is {shape}")
    in_place = out.device.type == "cpu" and out.dtype == torch.float32
    # cut at multiples of STAGE_ROWS (of INIT_BLOCK_ROWS), so no block is made twice
    cuts, lo = [], row_start
    while lo < row_end:
        hi = min((lo // STAGE_ROWS + 1) * STAGE_ROWS, row_end)
        cuts.append((lo, hi))
        lo = hi

    def make(cut: tuple[int, int]) -> torch.Tensor:
        lo, hi = cut
        target = out[lo - row_start : hi - row_start] if in_place else torch.empty(hi - lo, shape[1])
        _fill(target, table, table_rows, dim, seed, lo, hi, col_start, col_end)
        return target

    threads = min(torch.get_num_threads(), len(cuts))
    if threads <= 1:
        for cut in cuts:
            made = make(cut)
            if not in_place:
                out[cut[0] - row_start : cut[1] - row_start].copy_(made)
        return out
    with ThreadPoolExecutor(threads, thread_name_prefix="init-rows") as pool:
        pending: deque[tuple[tuple[int, int], Future[torch.Tensor]]] = deque()
        for cut in cuts:
            pending.append((cut, pool.submit(make, cut)))
            if len(pending) >= 2 * threads:  # bounded: staged cuts wait for their copy
                _finish(pending.popleft(), out, row_start, in_place)
        while pending:
            _finish(pending.popleft(), out, row_start, in_place)
    return out


def _finish(item: tuple[tuple[int, int], Future[torch.Tensor]], out: torch.Tensor, row_start: int,
            in_place: bool) -> None:
    """Wait for a cut; a staged one is copied (converted) into its rows of ``out``."""
    (lo, hi), future = item
    made = future.result()
    if not in_place:
        out[lo - row_start : hi - row_start].copy_(made)


def _fill(target: torch.Tensor, table: str, table_rows: int, dim: int, seed: int,
          row_start: int, row_end: int, col_start: int, col_end: int) -> None:
    """Rows [row_start, row_end) x cols [col_start, col_end) into fp32 ``target``."""
    bound = math.sqrt(1.0 / table_rows)
    first, last = row_start // INIT_BLOCK_ROWS, (row_end - 1) // INIT_BLOCK_ROWS
    block_values = torch.empty(INIT_BLOCK_ROWS, dim)  # reused: no allocation per block
    for block in range(first, last + 1):
        b0 = block * INIT_BLOCK_ROWS
        b1 = min(b0 + INIT_BLOCK_ROWS, table_rows)
        gen = torch.Generator().manual_seed(_block_seed(seed, table, block))
        values = block_values[: b1 - b0].uniform_(-bound, bound, generator=gen)
        lo, hi = max(row_start, b0), min(row_end, b1)
        target[lo - row_start : hi - row_start] = values[lo - b0 : hi - b0, col_start:col_end]
