"""The compiled CPU kernels for half tables (embeddings/rounding_cpu.py) against the
torch recipe of embeddings/rounding.py and torch's own embedding_bag: same bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from embeddings.lookup import _half_bags
from embeddings.rounding import stochastic_round
from tests.rounding_cases import bits_equal, coordinates, values

pytest.importorskip("numba")
from embeddings import rounding_cpu

HALF = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("dim", [1, 13, 64])
def test_compiled_rounding_equals_the_torch_recipe(dtype: torch.dtype, dim: int) -> None:
    x = values(3000, dim, seed=dim)
    x.view(-1)[20] = float("nan")
    tables, rows, col0 = coordinates(3000, seed=1)
    for step in (1, 2, 1 << 33):
        got = rounding_cpu.stochastic_round_cpu(x, dtype, 5, step, tables, rows, col0)
        want = stochastic_round(x, dtype, 5, step, tables, rows, col0, compiled=False)
        assert got.dtype == dtype and bits_equal(got, want)


@pytest.mark.parametrize("dtype", HALF)
def test_fused_update_equals_gather_add_round_scatter(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    weight = values(5000, 24, seed=4).to(dtype)
    ids = torch.randperm(5000, generator=g)[:1200]
    grad = torch.randn(1200, 24, generator=g) * torch.logspace(-6, 5, 1200).unsqueeze(1)
    tables, rows, col0 = coordinates(1200, seed=5)
    want = weight.clone()
    new = want.index_select(0, ids).float().add_(grad, alpha=-0.3)  # torch's fp32 fused multiply-add
    rounded = stochastic_round(new, dtype, 9, 4, tables, rows, col0, compiled=False)
    want.index_copy_(0, ids, rounded)
    got = weight.clone()
    overflow = rounding_cpu.add_rows_rounded(got, ids, grad, -0.3, 9, 4, tables, rows, col0)
    assert bits_equal(got, want)
    untouched = torch.ones(5000, dtype=torch.bool)
    untouched[ids] = False
    assert torch.equal(got[untouched].view(torch.int16), weight[untouched].view(torch.int16))
    if dtype == torch.float16:  # rows where a finite sum became inf, exactly
        expected = (torch.isinf(rounded) & torch.isfinite(new)).any(dim=1)
        assert expected.any() and torch.equal(overflow, expected)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("single_hot", [False, True])
def test_half_bags_equal_embedding_bag_of_the_widened_rows(dtype: torch.dtype, mean: bool,
                                                            single_hot: bool) -> None:
    """The lookup of half rows (embeddings/lookup.py): compiled for bf16, torch for fp16,
    a gather for bags of one id; each against embedding_bag over the widened rows."""
    g = torch.Generator().manual_seed(6)
    weight = (torch.randn(700, 20, generator=g)).to(dtype)
    lengths = torch.ones(300, dtype=torch.int64) if single_hot else torch.randint(0, 5, (300,), generator=g)
    ids = torch.randint(0, 700, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    scale = None
    if mean:
        scale = torch.repeat_interleave(1.0 / lengths.clamp(min=1).float(), lengths)
    got = _half_bags(weight, ids, offsets, scale)
    want = F.embedding_bag(ids, weight.float(), offsets, mode="sum", include_last_offset=True,
                           per_sample_weights=scale)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    one = lengths == 1  # a bag of one row is that row, widened exactly (mean: x 1.0)
    assert torch.equal(got[one], weight.float()[ids[offsets[:-1][one]]])
