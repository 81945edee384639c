"""Pooled lookup whose backward yields a KVGradient instead of a dense weight grad.

    weight [R, D]   one tensor holding one or more tables (row offsets apart)
    ids    [N]      row ids into weight, bag after bag
    offsets[S + 1]  bag s holds ids[offsets[s]:offsets[s+1]]
    scale  [N]|None per-id factor (1/bag length for mean pooling)
        │ forward: one fused embedding_bag call
        ▼
    pooled [S, D]   pooled[s] = sum_j scale[j] * weight[ids[j]] over bag s

    backward: grad_pooled [S, D] ──gather per id──► [N, D] ──coalesce──► KVGradient
              handed to ``sink`` (apply it now, or keep it for later);
              weight's autograd gradient is None: nothing table-sized is built.

    A linear update (SGD applied at once) may take the per-lookup rows as they
    are (``apply_lookups(ids, rows)``): adding every lookup's row is the same
    sum as adding the coalesced rows, without the unique's sort and second pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from embeddings.kv import KVGradient
from embeddings.timing import section

KVSink = Callable[[KVGradient], None]
LookupSink = Callable[[torch.Tensor, torch.Tensor], None]


class _PooledLookup(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        weight: torch.Tensor,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        scale: torch.Tensor | None,
        sink: KVSink,
        apply_lookups: LookupSink | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(ids, offsets, scale)
        ctx.sink = sink
        ctx.apply_lookups = apply_lookups
        with section("lookup"):
            return F.embedding_bag(
                ids, weight, offsets, mode="sum", include_last_offset=True, per_sample_weights=scale
            )

    @staticmethod
    def backward(ctx: Any, grad_pooled: torch.Tensor) -> tuple[None, ...]:  # type: ignore[override]
        ids, offsets, scale = ctx.saved_tensors
        with section("lookup"):
            lengths = offsets[1:] - offsets[:-1]
            bag_of_id = torch.repeat_interleave(
                torch.arange(lengths.numel(), device=ids.device), lengths, output_size=ids.numel()
            )
            rows = grad_pooled.index_select(0, bag_of_id)
            if scale is not None:
                rows = rows * scale.unsqueeze(1)
            if ctx.apply_lookups is None:
                grad = KVGradient.from_lookups(ids, rows)
        if ctx.apply_lookups is not None:
            ctx.apply_lookups(ids, rows)
        else:
            ctx.sink(grad)
        return None, None, None, None, None, None


def pooled_lookup(
    weight: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    sink: KVSink,
    scale: torch.Tensor | None = None,
    apply_lookups: LookupSink | None = None,
) -> torch.Tensor:
    """[S, D] pooled bags; on backward, ``sink`` receives the KVGradient of ``weight``
    (or ``apply_lookups`` its uncoalesced per-lookup rows, see above)."""
    return _PooledLookup.apply(weight, ids, offsets, scale, sink, apply_lookups)
