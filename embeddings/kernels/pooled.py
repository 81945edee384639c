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

One program per ``bags_a_program(D)`` bags (32 at D=64), a bag's row across a tile's
columns (``BLOCK_D``, the next power of two of D, masked): a bag's rows are read
whole, each once, and added in the bag's order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pooled_kernel(
    weight_ptr, values_ptr, offsets_ptr, row_base_ptr, out_ptr,
    batch, dim, stride_b, stride_f, bags,
    MEAN: tl.constexpr, BLOCK_D: tl.constexpr, BAGS: tl.constexpr,
):
    bag = tl.program_id(0).to(tl.int64) * BAGS + tl.arange(0, BAGS)
    inside = bag < bags
    feature = bag // batch
    sample = bag % batch
    start = tl.load(offsets_ptr + bag, mask=inside, other=0)
    end = tl.load(offsets_ptr + bag + 1, mask=inside, other=0)
    base = tl.load(row_base_ptr + feature, mask=inside, other=0)
    length = tl.where(base < 0, 0, end - start)  # another stack's feature: an empty bag here
    cols = tl.arange(0, BLOCK_D)
    in_row = cols < dim
    acc = tl.zeros([BAGS, BLOCK_D], dtype=tl.float32)
    for k in range(tl.max(length, axis=0)):  # the k-th lookup of every bag that has one
        live = k < length
        row = tl.load(values_ptr + start + k, mask=live, other=0).to(tl.int64) + base
        acc += row_tile(weight_ptr, row, live, cols, dim)
    if MEAN:
        acc = tl.div_rn(acc, tl.maximum(length, 1).to(tl.float32)[:, None])
    dst = out_ptr + sample[:, None] * stride_b + feature[:, None] * stride_f + cols[None, :]
    tl.store(dst, acc, mask=inside[:, None] & in_row[None, :])


@triton.jit
def row_tile(table_ptr, row, live, cols, dim):
    """[BAGS, BLOCK_D] fp32: row ``row[i]`` of a [R, dim] table where ``live[i]``, zeros
    elsewhere and past ``dim``. The pointers and the mask are made apart from the load:
    written inside it (``tl.load(ptr + row[:, None] * dim + cols[None, :], mask=live[:,
    None] & ...)``), triton 3.6 (the GPU machine's) failed to compile both lookups' loops
    wherever a 32- or 64-wide tile met a ``dim`` divisible by 16, D = 64 among them
    (``TritonGPURemoveLayoutConversions``: "mask type matches ptr type"); 3.9 compiled
    it. tests/test_kernels_compile.py compiles these widths, run under either version."""
    ptrs = table_ptr + row[:, None] * dim + cols[None, :]
    mask = live[:, None] & (cols < dim)[None, :]
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


def bags_a_program(dim: int) -> int:
    """Bags one program of a pooled lookup takes (a [bags, BLOCK_D] tile of 2,048
    values): a program per bag, 106,496 for bench_gpu's batch, spent its time being
    scheduled. Each bag's lookups are still added one at a time, in order."""
    return max(1, 2048 // block_d(dim))


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
        per = bags_a_program(dim)
        _pooled_kernel[(triton.cdiv(bags, per),)](
            weight, values, offsets, row_base, out, batch, dim, stride_b, stride_f, bags,
            MEAN=mean, BLOCK_D=block_d(dim), BAGS=per, num_warps=4,
        )
    return out
