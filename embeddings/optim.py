"""Sparse optimizers: apply a KVGradient to the touched rows of a table, only.

Each optimizer keeps its state beside the weight (same row count) and updates
the state and weight of the rows in ``grad.ids``; untouched rows, and their
state, are left exactly as they were ("lazy" updates).

    SGD              w[i] -= lr * g[i]
    Adagrad          s[i] += g[i]^2;         w[i] -= lr * g[i] / (sqrt(s[i]) + eps)
                     (fbgemm's EXACT_ADAGRAD, torch.optim.Adagrad: state as big as the weight)
    row-wise Adagrad s[i] += mean(g[i]^2);   w[i] -= lr * g[i] / (sqrt(s[i]) + eps)
                     (fbgemm's EXACT_ROWWISE_ADAGRAD: one scalar of state per row)
    Adam (lazy)      as torch.optim.SparseAdam: moments of touched rows only,
                     bias correction from the table's step count

Each optimizer declares its state (``state_layout``): a name per tensor, and
whether it is a vector per row, a scalar per row or a scalar per table. Memory
sizing, the Hotline tiers and the checkpoint read that declaration.

State precision (``state_dtype``, ``embeddings.state_dtype``): the element-wise
state (Adagrad's sum, Adam's moments) may be stored in fp16/bf16, half its bytes;
the update reads it into fp32, computes in fp32 and writes it back with stochastic
rounding (at the weight's coordinates from ``rounder``, in a stream per state tensor).
Round-to-nearest would freeze it: Adam's v moves by (1 - 0.999) of its distance to
g² a step, under half a bf16 spacing (2^-9 relative), so v would stop following g²;
Adagrad's sum, once large, would stop growing. fbgemm keeps its momentum in the
weight's type with stochastic rounding for the same reason. Row-wise Adagrad's one
float per row stays fp32 (4 bytes a row: nothing to save).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from embeddings.huge_pages import advise_huge_pages
from embeddings.kv import KVGradient
from embeddings.rounding import (
    RowRounding,
    add_rows_rounded,
    stochastic_round,
    table_key,
    weight_dtype,
)


class SparseOptimizerType(str, Enum):
    SGD = "sgd"
    ADAGRAD = "adagrad"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAM = "adam"


class StateKind(str, Enum):
    """The shape of one optimizer-state tensor of a rows x dim table."""

    ROW_VECTOR = "element"  # [rows, dim]: one value per weight element (Adam's moments, Adagrad's sum)
    ROW_SCALAR = "row"  # [rows]: one value per row (row-wise Adagrad's sum)
    TABLE_SCALAR = "scalar"  # [1]: one value per table (Adam's step)


@dataclass(frozen=True)
class StateSpec:
    kind: StateKind
    dtype: torch.dtype = torch.float32

    @property
    def per_row(self) -> bool:
        """Whether the tensor has one entry per row (sliced with the rows)."""
        return self.kind is not StateKind.TABLE_SCALAR

    def row_bytes(self, dim: int) -> int:
        """Bytes per row (0 for a per-table scalar)."""
        per_row = {StateKind.ROW_VECTOR: dim, StateKind.ROW_SCALAR: 1}.get(self.kind, 0)
        return per_row * self.dtype.itemsize

    def zeros(self, rows: int, dim: int, device: torch.device) -> torch.Tensor:
        """The initial tensor. A per-table scalar is made on the CPU, where Python
        reads it every step without waiting for a device. Per-row state in host memory
        is advised onto 2 MiB pages before it is zeroed (embeddings/huge_pages.py): it is
        read and written a row here, a row there, as the weight is."""
        if self.kind is StateKind.TABLE_SCALAR:
            return torch.zeros(1, dtype=self.dtype)
        shape = (rows, dim) if self.kind is StateKind.ROW_VECTOR else (rows,)
        state = torch.empty(shape, dtype=self.dtype, device=device)
        advise_huge_pages(state)
        return state.zero_()


class SparseOptimizer(ABC):
    """Stateless rule; the state tensors live with the table (see ``init_state``)."""

    # Set by a collection whose weights are fp16/bf16: the table then also keeps the
    # count of its updates, the step of its stochastic rounding (embeddings/rounding.py),
    # checkpointed and resharded like Adam's step.
    rounding: bool = False

    def __init__(self, eps: float = 1e-8, state_dtype: torch.dtype = torch.float32) -> None:
        self.eps = eps
        self.state_dtype = state_dtype  # of element-wise state (ROW_VECTOR)
        if state_dtype != torch.float32:
            self.rounding = True  # half state is rounded stochastically: it needs the step count

    @abstractmethod
    def rule_layout(self) -> dict[str, StateSpec]:
        """The state tensors the update rule keeps per table, by name."""

    def state_layout(self) -> dict[str, StateSpec]:
        """The state tensors this optimizer keeps per table, by name."""
        layout = self.rule_layout()
        if self.rounding:
            layout["rounding_step"] = StateSpec(StateKind.TABLE_SCALAR, torch.int64)
        return layout

    def init_state(self, rows: int, dim: int, device: torch.device) -> dict[str, torch.Tensor]:
        """State for a table of ``rows`` x ``dim``: zeros, as ``state_layout`` says."""
        return {name: spec.zeros(rows, dim, device)
                for name, spec in self.state_layout().items()}

    @abstractmethod
    def apply(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        grad: KVGradient,
        lr: float,
        row_sq_mean: torch.Tensor | None = None,
        rounder: Rounder | None = None,
        count: bool = True,
    ) -> None:
        """Update ``weight[grad.ids]`` and their state in place.

        ``row_sq_mean`` [U]: mean of g² over the FULL row, for a column shard whose
        ``grad.rows`` hold only some columns (row-wise Adagrad needs the whole row).
        ``rounder``: a half-precision weight's rounding coordinates of ids (add_rows);
        half state (``state_dtype``) is rounded at the same coordinates, in a stream of
        its own (``put_state``). ``count`` False: the rest of a step applied in parts,
        whose first part counted it (Adam's step; the host tier applies the rows the
        next gather reads first, hotline/host_local.py).
        """

    def count_step(self, state: dict[str, torch.Tensor]) -> None:
        """A step with no row to update: what ``apply`` with an empty gradient changes,
        without its ops on no rows (the step counts it keeps: Adam's ``step``)."""

    def counts_steps(self) -> bool:
        """Whether an empty step changes the state (``count_step``, or the rounding
        step a half table keeps): else it may be skipped altogether."""
        return self.rounding or type(self).count_step is not SparseOptimizer.count_step

    def state_bytes_per_row(self, dim: int) -> int:
        """Bytes of per-row state (per-table scalars such as Adam's step excluded)."""
        return sum(spec.row_bytes(dim) for spec in self.state_layout().values())

    def per_row_state(self) -> list[str]:
        """Names of the state tensors with one entry per row."""
        return [name for name, spec in self.state_layout().items() if spec.per_row]


# ids → where they sit in their full tables, for a half weight's stochastic rounding
Rounder = Callable[[torch.Tensor], RowRounding]


def get_state(state: dict[str, torch.Tensor], name: str, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of state ``name`` in fp32 (a copy: computed on, then put back)."""
    return state[name].index_select(0, ids).float()


def put_state(state: dict[str, torch.Tensor], name: str, ids: torch.Tensor, rows: torch.Tensor,
              rounder: Rounder | None) -> None:
    """fp32 ``rows`` written into rows ``ids`` of state ``name``: as they are, or into a
    half state rounded stochastically at the weight's coordinates ``rounder(ids)`` with
    the table key xor crc32(name), a stream per state tensor (round-to-nearest without
    a rounder)."""
    tensor = state[name]
    if tensor.dtype != torch.float32:
        if rounder is None:
            rows = rows.to(tensor.dtype)
        else:
            at = rounder(ids)
            rows = stochastic_round(rows, tensor.dtype, at.seed, at.step, at.tables ^ table_key(name), at.rows,
                                    at.col0)
    tensor.index_copy_(0, ids, rows)


def add_rows(weight: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, alpha: float,
             rounder: Rounder | None = None) -> None:
    """``weight[ids] += alpha * rows`` for UNIQUE ``ids`` (a KVGradient's).

    Gather, add, scatter back: the same arithmetic as ``index_add_`` (one add per
    element, bit-equal); on the CPU ``index_add_`` adds row by row, which is slower
    for the many rows one step touches. A half-precision weight: the sum is taken in
    fp32 and written back stochastically rounded at the coordinates ``rounder(ids)``
    gives (round-to-nearest without a rounder).
    """
    if weight.dtype == torch.float32:
        weight.index_copy_(0, ids, weight.index_select(0, ids).add_(rows, alpha=alpha))
        return
    if rounder is None:
        weight.index_copy_(0, ids, weight.index_select(0, ids).float().add_(rows, alpha=alpha).to(weight.dtype))
        return
    add_rows_rounded(weight, ids, rows, alpha, rounder(ids))


class SparseSGD(SparseOptimizer):
    def rule_layout(self) -> dict[str, StateSpec]:
        return {}

    @torch.no_grad()
    def apply(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        grad: KVGradient,
        lr: float,
        row_sq_mean: torch.Tensor | None = None,
        rounder: Rounder | None = None,
        count: bool = True,
    ) -> None:
        add_rows(weight, grad.ids, grad.rows, -lr, rounder)


class SparseAdagrad(SparseOptimizer):
    """Element-wise Adagrad: each weight element has its own sum of squared gradients.

    Needs no whole-row statistic, so a column shard updates its columns alone; the
    state costs as much memory as the weight (row-wise Adagrad: one float per row).
    """

    def rule_layout(self) -> dict[str, StateSpec]:
        return {"sum": StateSpec(StateKind.ROW_VECTOR, self.state_dtype)}

    @torch.no_grad()
    def apply(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        grad: KVGradient,
        lr: float,
        row_sq_mean: torch.Tensor | None = None,
        rounder: Rounder | None = None,
        count: bool = True,
    ) -> None:
        new = get_state(state, "sum", grad.ids).addcmul_(grad.rows, grad.rows)
        put_state(state, "sum", grad.ids, new, rounder)
        add_rows(weight, grad.ids, grad.rows / new.sqrt().add_(self.eps), -lr, rounder)


class RowWiseAdagrad(SparseOptimizer):
    def rule_layout(self) -> dict[str, StateSpec]:
        return {"sum": StateSpec(StateKind.ROW_SCALAR)}

    @torch.no_grad()
    def apply(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        grad: KVGradient,
        lr: float,
        row_sq_mean: torch.Tensor | None = None,
        rounder: Rounder | None = None,
        count: bool = True,
    ) -> None:
        acc = state["sum"]
        if row_sq_mean is None:
            row_sq_mean = grad.rows.square().mean(dim=1)
        new = acc.index_select(0, grad.ids) + row_sq_mean
        acc.index_copy_(0, grad.ids, new)
        step = grad.rows * (lr / (new.sqrt() + self.eps)).unsqueeze(1)
        add_rows(weight, grad.ids, step, -1.0, rounder)


class SparseAdam(SparseOptimizer):
    def __init__(self, eps: float = 1e-8, betas: tuple[float, float] = (0.9, 0.999),
                 state_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(eps, state_dtype)
        self.betas = betas

    def rule_layout(self) -> dict[str, StateSpec]:
        return {
            "exp_avg": StateSpec(StateKind.ROW_VECTOR, self.state_dtype),
            "exp_avg_sq": StateSpec(StateKind.ROW_VECTOR, self.state_dtype),
            # Steps taken by this table, as torch.optim.SparseAdam counts them.
            "step": StateSpec(StateKind.TABLE_SCALAR, torch.int64),
        }

    def count_step(self, state: dict[str, torch.Tensor]) -> None:
        state["step"] += 1

    @torch.no_grad()
    def apply(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        grad: KVGradient,
        lr: float,
        row_sq_mean: torch.Tensor | None = None,
        rounder: Rounder | None = None,
        count: bool = True,
    ) -> None:
        b1, b2 = self.betas
        if count:
            self.count_step(state)
        step = int(state["step"])
        ids, g = grad.ids, grad.rows
        m = get_state(state, "exp_avg", ids).lerp_(g, 1 - b1)
        v = get_state(state, "exp_avg_sq", ids).lerp_(g.square(), 1 - b2)
        put_state(state, "exp_avg", ids, m, rounder)
        put_state(state, "exp_avg_sq", ids, v, rounder)
        step_size = lr * math.sqrt(1 - b2**step) / (1 - b1**step)
        add_rows(weight, ids, m / (v.sqrt() + self.eps), -step_size, rounder)


def make_sparse_optimizer(kind: str | SparseOptimizerType, eps: float = 1e-8,
                          state_dtype: str = "fp32") -> SparseOptimizer:
    """``state_dtype`` (fp32 | fp16 | bf16): of the element-wise state (adagrad, adam);
    sgd has none and row-wise Adagrad keeps its one float per row in fp32."""
    kind = SparseOptimizerType(kind)
    dtype = weight_dtype(state_dtype) if kind in (SparseOptimizerType.ADAGRAD, SparseOptimizerType.ADAM) \
        else torch.float32
    if kind is SparseOptimizerType.SGD:
        return SparseSGD(eps)
    if kind is SparseOptimizerType.ADAGRAD:
        return SparseAdagrad(eps, dtype)
    if kind is SparseOptimizerType.ROWWISE_ADAGRAD:
        return RowWiseAdagrad(eps)
    return SparseAdam(eps, state_dtype=dtype)
