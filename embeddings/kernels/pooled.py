"""Pooled forward of every bag of a batch in one launch.

The batch arrives feature-major, as the reader and the all-to-all produce it; the
kernel reads it in place and writes each bag's pooled row wherever the caller's
layout wants it, so no permutation of the ids precedes the lookup:

    values   [N]        ids, local to their feature's table, bag after bag
    offsets  [F*B + 1]  bag p = f*B + b holds values[offsets[p]:offsets[p+1]]
    row_base [F]        first row of feature f's table in the stacked weight; -1: a
                        feature of another stack (one process with tables of several
                        dtypes, embeddings/dtype_stacks.py): its bags pool to zeros
    weight   [R, D]     the stacked tables
        │ program p: acc = Σ weight[row_base[f] + values[j]]   (fp32)
        │            mean: acc / max(len, 1);  empty bag: zeros
        ▼
    out[b * stride_b + f * stride_f + d]
        sample-major [B, F*D]: stride_b = F*D, stride_f = D
        feature-major [F, B, D]: stride_b = D,  stride_f = B*D

One program per bag, the row's columns across its lanes (``BLOCK_D``, the next power
of two of D, masked): a bag's rows are read whole, each once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pooled_kernel(
    weight_ptr, values_ptr, offsets_ptr, row_base_ptr, out_ptr,
    batch, dim, stride_b, stride_f,
    MEAN: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bag = tl.program_id(0)
    feature = bag // batch
    sample = bag % batch
    start = tl.load(offsets_ptr + bag)
    end = tl.load(offsets_ptr + bag + 1)
    base = tl.load(row_base_ptr + feature)
    end = tl.where(base < 0, start, end)  # another stack's feature: an empty bag here
    cols = tl.arange(0, BLOCK_D)
    in_row = cols < dim
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(start, end):
        row = tl.load(values_ptr + j).to(tl.int64) + base
        acc += tl.load(weight_ptr + row * dim + cols, mask=in_row, other=0.0).to(tl.float32)
    if MEAN:
        acc = tl.div_rn(acc, tl.maximum(end - start, 1).to(tl.float32))
    dst = out_ptr + sample.to(tl.int64) * stride_b + feature.to(tl.int64) * stride_f + cols
    tl.store(dst, acc, mask=in_row)


def block_d(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


def warps(dim: int) -> int:
    """Warps for a program holding one row: a warp per 64 columns (up to 4), so a
    64-wide row is one warp's two floats a lane, not four warps mostly replicated."""
    return min(4, max(1, block_d(dim) // 64))


def pooled_forward(
    weight: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    row_base: torch.Tensor,
    batch: int,
    mean: bool,
    feature_major: bool = False,
) -> torch.Tensor:
    """Pooled bags: [B, F*D] (sample-major) or [F, B, D] (``feature_major``), fp32."""
    num_features = row_base.numel()
    dim = weight.shape[1]
    if feature_major:
        out = torch.empty(num_features, batch, dim, dtype=torch.float32, device=weight.device)
        stride_b, stride_f = dim, batch * dim
    else:
        out = torch.empty(batch, num_features * dim, dtype=torch.float32, device=weight.device)
        stride_b, stride_f = num_features * dim, dim
    bags = num_features * batch
    if bags:
        _pooled_kernel[(bags,)](
            weight, values, offsets, row_base, out, batch, dim, stride_b, stride_f,
            MEAN=mean, BLOCK_D=block_d(dim), num_warps=warps(dim),
        )
    return out
