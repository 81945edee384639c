"""The Triton stochastic rounding (embeddings/kernels/rounding.py) against the torch
recipe of embeddings/rounding.py: the same bits for every input."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_cases import DEVICE
from tests.rounding_cases import bits_equal, coordinates, values

pytest.importorskip("triton")
pytestmark = pytest.mark.kernels

from embeddings.kernels.rounding import stochastic_round_triton
from embeddings.rounding import stochastic_round


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [1, 13, 64])
def test_triton_rounding_equals_the_torch_recipe(dtype: torch.dtype, dim: int) -> None:
    x = values(400, dim, seed=dim)
    x.view(-1)[20] = float("nan")
    tables, rows, col0 = coordinates(400, seed=2)
    for step in (1, 1 << 33):
        got = stochastic_round_triton(x.to(DEVICE), dtype, 5, step, tables.to(DEVICE), rows.to(DEVICE),
                                      col0.to(DEVICE))
        want = stochastic_round(x, dtype, 5, step, tables, rows, col0, compiled=False)
        assert got.dtype == dtype and bits_equal(got.cpu(), want)
