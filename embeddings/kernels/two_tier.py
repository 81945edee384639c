"""Hotline's lookup over both tiers in one launch, every shape fixed by the batch.

A Hotline mini-batch's lookups, each either in the hot tier (a slot of the device's
hot rows) or cold (a row of the step's staged cold rows, gathered by the host):

    is_hot     [N]        [ 1 0 1 | 1 1 | 0 ]       feature-major bags, as the reader's
    slot       [N]        hot-tier slot              (read where hot)
    cold_local [N]        row of ``cold_rows``       (read where cold; < U)
    offsets    [F*B + 1]  bag p = f*B + b holds lookups offsets[p]:offsets[p+1]
    hot_weight [H, D]     the hot tier               cold_rows [C, D]  first U staged
        │ bag p: acc = Σ (hot_weight[slot[j]] if is_hot[j] else cold_rows[cold_local[j]])
        │            in fp32; mean: acc / max(len, 1) (the WHOLE bag: both tiers' lookups)
        ▼
    pooled [B, F*D] fp32, sample-major

Nothing is sized by the data: N, F*B and C (>= U) are the captured step's, so the
lookup runs inside a CUDA graph (dlrm/train/hotline_graph.py) whatever the split
of a step. The backward is the sparse update's kernels (sparse_update.py) run once
over the bags, in one key space (``tier_ids``): a hot lookup's key is its slot, a cold
one's H + its ``cold_local`` (H hot rows). One sort puts each row's lookups together;
the runs below H are the hot rows, updated in the kernel (the fused update), those
from H on the staged cold rows, whose summed gradient is written by cold row (it goes
home to the host tier):

    keys    [ 2 H+1 0 | 2 3 | H+0 ]  ─sort─►  [0 | 2 2 | 3 | H+0 | H+1]
                                               └ hot: updated ┘ └ cold_grad[0], [1] ┘
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from embeddings.kernels.pooled import bags_a_program, block_d, row_tile


@triton.jit
def _two_tier_kernel(
    hot_ptr, cold_ptr, is_hot_ptr, slot_ptr, cold_local_ptr, offsets_ptr, out_ptr,
    batch, dim, stride_b, stride_f, bags, MEAN: tl.constexpr, BLOCK_D: tl.constexpr, BAGS: tl.constexpr,
):
    bag = tl.program_id(0).to(tl.int64) * BAGS + tl.arange(0, BAGS)
    inside = bag < bags
    feature = bag // batch
    sample = bag % batch
    start = tl.load(offsets_ptr + bag, mask=inside, other=0)
    length = tl.load(offsets_ptr + bag + 1, mask=inside, other=0) - start
    cols = tl.arange(0, BLOCK_D)
    in_row = (cols < dim)[None, :]
    acc = tl.zeros([BAGS, BLOCK_D], dtype=tl.float32)
    for k in range(tl.max(length, axis=0)):  # the k-th lookup of every bag that has one
        live = k < length
        j = start + k
        hot = live & (tl.load(is_hot_ptr + j, mask=live, other=0) != 0)
        cold = live & (hot == 0)
        slot = tl.load(slot_ptr + j, mask=hot, other=0).to(tl.int64)
        row = tl.load(cold_local_ptr + j, mask=cold, other=0).to(tl.int64)
        from_hot = row_tile(hot_ptr, slot, hot, cols, dim)  # (pooled.py: why not written inline)
        from_cold = row_tile(cold_ptr, row, cold, cols, dim)
        acc += tl.where(hot[:, None], from_hot, from_cold)
    if MEAN:
        acc = tl.div_rn(acc, tl.maximum(length, 1).to(tl.float32)[:, None])
    dst = out_ptr + sample[:, None] * stride_b + feature[:, None] * stride_f + cols[None, :]
    tl.store(dst, acc, mask=inside[:, None] & in_row)


def two_tier_forward(hot_weight: torch.Tensor, cold_rows: torch.Tensor, is_hot: torch.Tensor,
                     slot: torch.Tensor, cold_local: torch.Tensor, offsets: torch.Tensor,
                     features: int, batch: int, mean: bool) -> torch.Tensor:
    """Pooled [B, F*D] fp32 of both tiers' lookups (see the module docstring);
    ``is_hot`` as uint8 or bool."""
    dim = cold_rows.shape[1]
    out = torch.empty(batch, features * dim, dtype=torch.float32, device=cold_rows.device)
    if features * batch:
        bags, per = features * batch, bags_a_program(dim)
        _two_tier_kernel[(triton.cdiv(bags, per),)](
            hot_weight, cold_rows, is_hot.view(torch.uint8), slot, cold_local, offsets, out,
            batch, dim, features * dim, dim, bags, MEAN=mean, BLOCK_D=block_d(dim), BAGS=per, num_warps=4,
        )
    return out


def tier_ids(is_hot: torch.Tensor, slot: torch.Tensor, cold_local: torch.Tensor, hot_rows: int) -> torch.Tensor:
    """[N] int64, both tiers' lookups in one key space: a hot lookup's slot, a cold
    one's ``hot_rows`` + its row of the staged cold rows (the ids the update's kernels
    sort once, applying the keys below ``hot_rows``)."""
    return torch.where(is_hot, slot, cold_local + hot_rows)


BackwardHandler = Callable[[torch.Tensor], None]


class _TwoTierLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hot_weight: torch.Tensor, cold_rows: torch.Tensor, is_hot: torch.Tensor,
                slot: torch.Tensor, cold_local: torch.Tensor, offsets: torch.Tensor, features: int,
                batch: int, mean: bool, on_backward: BackwardHandler) -> torch.Tensor:  # type: ignore[override]
        ctx.on_backward = on_backward
        return two_tier_forward(hot_weight, cold_rows, is_hot, slot, cold_local, offsets, features, batch, mean)

    @staticmethod
    def backward(ctx: Any, grad_pooled: torch.Tensor) -> tuple[None, ...]:  # type: ignore[override]
        ctx.on_backward(grad_pooled.contiguous())
        return (None,) * 10


def two_tier_lookup(hot_weight: torch.Tensor, cold_rows: torch.Tensor, is_hot: torch.Tensor,
                    slot: torch.Tensor, cold_local: torch.Tensor, offsets: torch.Tensor, features: int,
                    batch: int, mean: bool, on_backward: BackwardHandler) -> torch.Tensor:
    """``two_tier_forward`` under autograd: the backward hands the pooled gradient
    [B, F*D] to ``on_backward`` (which updates both tiers; no autograd gradient)."""
    return _TwoTierLookup.apply(hot_weight, cold_rows, is_hot, slot, cold_local, offsets, features,
                                batch, mean, on_backward)
