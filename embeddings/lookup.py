"""Pooled lookup whose backward yields a KVGradient instead of a dense weight grad.

    weight [R, D]   one tensor holding one or more tables (row offsets apart)
    ids    [N]      row ids into weight, bag after bag
    offsets[S + 1]  bag s holds ids[offsets[s]:offsets[s+1]]
    scale  [N]|None per-id factor (1/bag length for mean pooling)
        │ forward: one fused embedding_bag call
        ▼
    pooled [S, D]   pooled[s] = sum_j scale[j] * weight[ids[j]] over bag s

    backward: grad_pooled [S, D] ──gather per id + coalesce (one embedding_bag)──► KVGradient
              handed to ``sink`` (apply it now, or keep it for later);
              weight's autograd gradient is None: nothing table-sized is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from embeddings import rounding_cpu
from embeddings.kv import KVGradient
from embeddings.timing import section

KVSink = Callable[[KVGradient], None]


class _PooledLookup(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        weight: torch.Tensor,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        scale: torch.Tensor | None,
        sink: KVSink,
        covers: int | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(ids, offsets, scale)
        ctx.sink, ctx.covers = sink, covers
        with section("lookup"):
            if weight.dtype != torch.float32:
                return _half_bags(weight, ids, offsets, scale)
            # detached: embedding_bag of a weight that requires grad takes its training
            # kernel, which also builds offset2bag and bag sizes for a backward we never
            # run (a bench step's 53k lookups on one core: 1.70-1.75 ms, 1.62-1.66
            # detached); the same sums
            return F.embedding_bag(
                ids, weight.detach(), offsets, mode="sum", include_last_offset=True, per_sample_weights=scale
            )

    @staticmethod
    def backward(ctx: Any, grad_pooled: torch.Tensor) -> tuple[None, ...]:  # type: ignore[override]
        ids, offsets, scale = ctx.saved_tensors
        with section("lookup"):
            lengths = offsets[1:] - offsets[:-1]
            bag_of_id = torch.repeat_interleave(
                torch.arange(lengths.numel(), device=ids.device), lengths, output_size=ids.numel()
            )
            if ctx.covers is None:
                grad = KVGradient.from_lookups(ids, grad_pooled, index=bag_of_id, weights=scale)
            else:
                grad = KVGradient.from_covering_lookups(ids, grad_pooled, ctx.covers, bag_of_id, scale)
        ctx.sink(grad)
        return None, None, None, None, None, None


def _half_bags(weight: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
               scale: torch.Tensor | None) -> torch.Tensor:
    """Bags of a fp16/bf16 weight summed in fp32 (pooled output fp32): the rows are
    gathered in their type (half the bytes), widened, then pooled in fp32.

    One id per bag (single-hot features): the pooled rows are the widened rows (a mean
    divides by 1), so no pooling pass. On the CPU: one compiled pass that gathers ahead
    and widens in registers (embeddings/rounding_cpu.py). Otherwise gather, widen,
    ``embedding_bag``."""
    compiled = weight.device.type == "cpu" and rounding_cpu.available()
    if weight.device.type == "cpu" and ids.numel() == offsets.numel() - 1 and torch.equal(
            offsets, torch.arange(ids.numel() + 1, device=offsets.device, dtype=offsets.dtype)):
        return rounding_cpu.widen_half_rows(weight, ids) if compiled else weight.index_select(0, ids).float()
    if compiled:
        return rounding_cpu.pool_half_bags(weight, ids, offsets, scale)
    rows = weight.index_select(0, ids).float()
    positions = torch.arange(ids.numel(), device=ids.device)
    return F.embedding_bag(
        positions, rows, offsets, mode="sum", include_last_offset=True, per_sample_weights=scale
    )


def pooled_lookup(
    weight: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    sink: KVSink,
    scale: torch.Tensor | None = None,
    covers: int | None = None,
) -> torch.Tensor:
    """[S, D] pooled bags; on backward, ``sink`` receives the KVGradient of ``weight``
    (``covers``: ``ids`` use every row 0..covers-1, so its ids are known, no sync)."""
    return _PooledLookup.apply(weight, ids, offsets, scale, sink, covers)
