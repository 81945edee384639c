"""Small random batches for the Triton kernel tests (tests/test_kernels_*.py).

Importing this module sets ``TRITON_INTERPRET=1`` where there is no GPU, before
triton is imported: CI runs the kernels on the CPU in Triton's interpreter; on a GPU
machine the same tests run compiled, on CUDA tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tests import triton_interpreter

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    triton_interpreter.install()  # one language patch per launch (see there)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Two tables stacked: table A (6 rows) serves features 0 and 1, table B (4 rows)
# serves feature 2. Few rows, so ids repeat within and across samples and tables.
TABLE_ROWS = (6, 6, 4)  # rows of each feature's table
ROW_BASE = (0, 0, 6)  # first row of each feature's table in the stacked weight
STACKED_ROWS = 10
BATCH = 5


@dataclass
class Case:
    weight: torch.Tensor  # [STACKED_ROWS, dim]
    values: torch.Tensor  # [N]
    offsets: torch.Tensor  # [F*B + 1]
    row_base: torch.Tensor  # [F]
    batch: int


def make_case(dim: int, multi_hot: bool, seed: int = 0, batch: int = BATCH) -> Case:
    """Feature-major bags; multi-hot ones hold 0-3 ids (empty bags included)."""
    gen = torch.Generator().manual_seed(seed)
    bags = len(TABLE_ROWS) * batch
    if multi_hot:
        lengths = torch.randint(0, 4, (bags,), generator=gen)
        lengths[1] = 0  # at least one empty bag, whatever the seed
    else:
        lengths = torch.ones(bags, dtype=torch.int64)
    values = torch.cat([
        torch.randint(0, TABLE_ROWS[bag // batch], (int(lengths[bag]),), generator=gen)
        for bag in range(bags)
    ])
    offsets = torch.zeros(bags + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    weight = torch.randn(STACKED_ROWS, dim, generator=gen)
    return Case(weight.to(DEVICE), values.to(DEVICE), offsets.to(DEVICE),
                torch.tensor(ROW_BASE, device=DEVICE), batch)
