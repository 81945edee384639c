"""Sparse optimizers: apply a KVGradient to the touched rows of a table, only.

Each optimizer keeps its state beside the weight (same row count) and updates
the state and weight of the rows in ``grad.ids``; untouched rows, and their
state, are left exactly as they were ("lazy" updates).

    SGD              w[i] -= lr * g[i]
    row-wise Adagrad s[i] += mean(g[i]^2);   w[i] -= lr * g[i] / (sqrt(s[i]) + eps)
                     (fbgemm's EXACT_ROWWISE_ADAGRAD: one scalar of state per row)
    Adam (lazy)      as torch.optim.SparseAdam: moments of touched rows only,
                     bias correction from the table's step count
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from enum import Enum

import torch

from embeddings.kv import KVGradient


class SparseOptimizerType(str, Enum):
    SGD = "sgd"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAM = "adam"


class SparseOptimizer(ABC):
    """Stateless rule; the state tensors live with the table (see ``init_state``)."""

    def __init__(self, eps: float = 1e-8) -> None:
        self.eps = eps

    @abstractmethod
    def init_state(self, rows: int, dim: int, device: torch.device) -> dict[str, torch.Tensor]:
        """State for a table of ``rows`` x ``dim``; a tensor per name, rows first."""

    @abstractmethod
    def apply(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        grad: KVGradient,
        lr: float,
        row_sq_mean: torch.Tensor | None = None,
    ) -> None:
        """Update ``weight[grad.ids]`` and their state in place.

        ``row_sq_mean`` [U]: mean of g² over the FULL row, for a column shard whose
        ``grad.rows`` hold only some columns (row-wise Adagrad needs the whole row).
        """

    def state_bytes_per_row(self, dim: int) -> int:
        """Bytes of per-row state (per-table scalars such as Adam's step excluded)."""
        state = self.init_state(2, dim, torch.device("cpu"))
        return sum(t[0].numel() * t.element_size() for t in state.values() if t.shape[0] == 2)


def add_rows(weight: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, alpha: float) -> None:
    """``weight[ids] += alpha * rows`` for UNIQUE ``ids`` (a KVGradient's).

    Gather, add, scatter back: the same arithmetic as ``index_add_`` (one add per
    element, bit-equal), which on the CPU adds row by row: 36.7k rows of a
    5.2M x 64 table took 10.1 ms with ``index_add_``, 4.4 ms this way (2 threads).
    """
    weight.index_copy_(0, ids, weight.index_select(0, ids).add_(rows, alpha=alpha))


class SparseSGD(SparseOptimizer):
    def init_state(self, rows: int, dim: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {}

    @torch.no_grad()
    def apply(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        grad: KVGradient,
        lr: float,
        row_sq_mean: torch.Tensor | None = None,
    ) -> None:
        add_rows(weight, grad.ids, grad.rows, -lr)


class RowWiseAdagrad(SparseOptimizer):
    def init_state(self, rows: int, dim: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {"sum": torch.zeros(rows, device=device)}

    @torch.no_grad()
    def apply(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        grad: KVGradient,
        lr: float,
        row_sq_mean: torch.Tensor | None = None,
    ) -> None:
        acc = state["sum"]
        if row_sq_mean is None:
            row_sq_mean = grad.rows.square().mean(dim=1)
        new = acc.index_select(0, grad.ids) + row_sq_mean
        acc.index_copy_(0, grad.ids, new)
        step = grad.rows * (lr / (new.sqrt() + self.eps)).unsqueeze(1)
        add_rows(weight, grad.ids, step, -1.0)


class SparseAdam(SparseOptimizer):
    def __init__(self, eps: float = 1e-8, betas: tuple[float, float] = (0.9, 0.999)) -> None:
        super().__init__(eps)
        self.betas = betas

    def init_state(self, rows: int, dim: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {
            "exp_avg": torch.zeros(rows, dim, device=device),
            "exp_avg_sq": torch.zeros(rows, dim, device=device),
            # Steps taken by this table, as torch.optim.SparseAdam counts them.
            "step": torch.zeros(1, dtype=torch.int64),
        }

    @torch.no_grad()
    def apply(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        grad: KVGradient,
        lr: float,
        row_sq_mean: torch.Tensor | None = None,
    ) -> None:
        b1, b2 = self.betas
        state["step"] += 1
        step = int(state["step"])
        ids, g = grad.ids, grad.rows
        m = state["exp_avg"].index_select(0, ids).lerp_(g, 1 - b1)
        v = state["exp_avg_sq"].index_select(0, ids).lerp_(g.square(), 1 - b2)
        state["exp_avg"].index_copy_(0, ids, m)
        state["exp_avg_sq"].index_copy_(0, ids, v)
        step_size = lr * math.sqrt(1 - b2**step) / (1 - b1**step)
        add_rows(weight, ids, m / (v.sqrt() + self.eps), -step_size)


def make_sparse_optimizer(kind: str | SparseOptimizerType, eps: float = 1e-8) -> SparseOptimizer:
    kind = SparseOptimizerType(kind)
    if kind is SparseOptimizerType.SGD:
        return SparseSGD(eps)
    if kind is SparseOptimizerType.ROWWISE_ADAGRAD:
        return RowWiseAdagrad(eps)
    return SparseAdam(eps)
