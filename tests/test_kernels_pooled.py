"""The Triton pooled forward (embeddings/kernels/pooled.py) against torch's embedding_bag."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernel_cases import ROW_BASE, make_case

pytest.importorskip("triton")
pytestmark = pytest.mark.kernels

from embeddings.kernels.pooled import pooled_forward
from embeddings.kernels.reference import pooled_reference


def embedding_bag_per_feature(case, mean: bool) -> torch.Tensor:
    """[F, B, D] from one embedding_bag per feature over its own table: independent of
    the stacked layout and of the reference module."""
    lengths = case.offsets[1:] - case.offsets[:-1]
    out = []
    for f, base in enumerate(ROW_BASE):
        bag_lengths = lengths[f * case.batch:(f + 1) * case.batch]
        start = int(case.offsets[f * case.batch])
        ids = case.values[start:start + int(bag_lengths.sum())]
        offsets = torch.cat([bag_lengths.new_zeros(1), bag_lengths.cumsum(0)])
        table = case.weight[base:]
        out.append(F.embedding_bag(ids, table, offsets, mode="mean" if mean else "sum",
                                   include_last_offset=True))
    return torch.stack(out)


# 12: not a power of two (masked columns); 64 and 100 (a 128-wide tile, masked): the
# widths runs use (bench_gpu's 64, criteo_1tb's 128), their own tiles, warps and bags a
# program, which tests/test_kernels_compile.py then compiles
@pytest.mark.parametrize("dim", [8, 12, 64, 100])
@pytest.mark.parametrize("multi_hot", [False, True])
@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("batch", [5, 200])  # 600 bags: several programs, the last part-filled
def test_pooled_equals_embedding_bag(dim: int, multi_hot: bool, mean: bool, batch: int) -> None:
    case = make_case(dim, multi_hot, batch=batch)
    expected = embedding_bag_per_feature(case, mean)  # [F, B, D]
    feature_major = pooled_forward(case.weight, case.values, case.offsets, case.row_base,
                                   case.batch, mean, feature_major=True)
    sample_major = pooled_forward(case.weight, case.values, case.offsets, case.row_base,
                                  case.batch, mean)
    torch.testing.assert_close(feature_major, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sample_major, expected.transpose(0, 1).reshape(case.batch, -1),
                               rtol=1e-6, atol=1e-6)
    if multi_hot:  # empty bags pool to zeros, in both modes
        assert torch.equal(feature_major[0, 1], torch.zeros(dim, device=feature_major.device))
    torch.testing.assert_close(
        sample_major, pooled_reference(case.weight, case.values, case.offsets, case.row_base,
                                       case.batch, mean), rtol=1e-6, atol=1e-6)
