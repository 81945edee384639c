"""Autograd glue: the pooled lookup on the Triton kernels.

    forward   pooled_forward (one launch over every bag)
    backward  ``on_backward(grad_pooled, bags)``: the collection either applies its
              optimizer in the kernel (``backward_update``) or keeps the KV gradient
              (``backward_kv``); weight's autograd gradient stays None.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from embeddings.kernels.pooled import pooled_forward


@dataclass
class FeatureRoute:
    """Where each feature of a batch sits in one stack, for a batch that holds other
    stacks' features too (one process, tables of several dtypes): per feature [F], its
    table's first row in the stack (-1: another stack's feature, skipped by the kernels)
    and the stochastic rounding's coordinates (table key, stacked row → full-table row
    shift, first column; 0 where skipped)."""

    row_base: torch.Tensor
    keys: torch.Tensor
    row_shift: torch.Tensor
    col0: torch.Tensor


@dataclass
class Bags:
    """A batch's bags, feature-major: what the backward needs to retrace the forward."""

    values: torch.Tensor  # [N] ids local to each feature's table
    offsets: torch.Tensor  # [F*B + 1]
    row_base: torch.Tensor  # [F] first row of each feature's table in the stacked weight
    batch: int
    mean: bool
    feature_major: bool
    route: FeatureRoute | None = None  # the batch holds other stacks' features too


BackwardHandler = Callable[[torch.Tensor, Bags], None]


class _TritonPooledLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, bags: Bags, on_backward: BackwardHandler
                ) -> torch.Tensor:  # type: ignore[override]
        ctx.bags, ctx.on_backward = bags, on_backward
        return pooled_forward(weight, bags.values, bags.offsets, bags.row_base, bags.batch,
                              bags.mean, bags.feature_major)

    @staticmethod
    def backward(ctx: Any, grad_pooled: torch.Tensor) -> tuple[None, None, None]:  # type: ignore[override]
        ctx.on_backward(grad_pooled.contiguous(), ctx.bags)
        return None, None, None


def triton_pooled_lookup(weight: torch.Tensor, bags: Bags, on_backward: BackwardHandler) -> torch.Tensor:
    """Pooled [B, F*D] (or [F, B, D] with ``bags.feature_major``) of ``weight``."""
    return _TritonPooledLookup.apply(weight, bags, on_backward)
