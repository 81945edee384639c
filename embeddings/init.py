"""Initial table values that any shard can make on its own.

A table is filled block by block (``INIT_BLOCK_ROWS`` rows each), every block from
its own generator seeded by (seed, table name, block index). A row-wise or
column-wise shard therefore makes exactly its slice of the table that a single
process would have, without building the rest:

    rows 0..4095 ← gen(seed, "C1", 0)   rows 4096..8191 ← gen(seed, "C1", 1)   ...

Values: uniform(-sqrt(1/rows), sqrt(1/rows)), DLRM's and TorchRec's default.
"""

from __future__ import annotations

import math
import zlib

import torch

INIT_BLOCK_ROWS = 4096


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
) -> torch.Tensor:
    """Rows [row_start, row_end) x cols [col_start, col_end) of the initial table."""
    row_end = table_rows if row_end is None else row_end
    col_end = dim if col_end is None else col_end
    bound = math.sqrt(1.0 / table_rows)
    out = torch.empty(row_end - row_start, col_end - col_start)
    first, last = row_start // INIT_BLOCK_ROWS, (row_end - 1) // INIT_BLOCK_ROWS
    for block in range(first, last + 1):
        b0 = block * INIT_BLOCK_ROWS
        b1 = min(b0 + INIT_BLOCK_ROWS, table_rows)
        gen = torch.Generator().manual_seed(_block_seed(seed, table, block))
        values = torch.empty(b1 - b0, dim).uniform_(-bound, bound, generator=gen)
        lo, hi = max(row_start, b0), min(row_end, b1)
        out[lo - row_start : hi - row_start] = values[lo - b0 : hi - b0, col_start:col_end]
    return out
