"""One process, tables of several dtypes (``embeddings.dtypes``): one stack per dtype.

A stack is one tensor, so it holds one type: each dtype's tables are a
``LocalEmbeddingCollection`` of their own (saved, updated and rounded as one). On the
Triton path the batch is not split by the host; every stack's kernels take all of it:

    values [N], lengths [F*B]   (the collection's feature order)
        │ stack s: row_base [F] with -1 at the other stacks' features
        │ (kernels/pooled.py: those bags pool to zeros; kernels/sparse_update.py:
        │  their lookups sort last and are not applied)
        ▼
    pooled = Σ_s pooled_s [B, F*D]   each column written by one stack, zeros in the
                                     others: the sum is exact

No shape depends on the data and the host reads nothing, so a CUDA graph captures the
step (dlrm/train/graphs.py); each stack sorts the whole batch (one sort per dtype).
The torch path splits the batch by stack (value counts read on the host, as that path
reads its batch anyway) and puts the pooled columns back in feature order.

Every stack keeps the rounding step (its fp32 one too, as the sharded collection's
stores do beside half ones), so every table's checkpoint holds the same state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from embeddings.collection import EmbeddingCollection, LocalEmbeddingCollection
from embeddings.interface import TableState
from embeddings.jagged import in_feature_order, split_features
from embeddings.optim import SparseOptimizer
from embeddings.table import TableSpec

if TYPE_CHECKING:
    from data.jagged import KeyedJagged
    from embeddings.kernels.lookup import FeatureRoute
    from embeddings.kv import KVGradient

ROUTE_PARTS = ("row_base", "keys", "row_shift", "col0")


class PerDtype(EmbeddingCollection):
    """What a collection of one part per table dtype (``parts()``, each a collection of
    its dtype's tables, in the order the dtypes first appear) does the same way, whatever
    the parts are: DtypeStacks here, Hotline's MixedHotlineCollection. Pooled columns
    come back in feature order through ``column_order`` (a buffer: made once, it
    follows ``.to(device)``; a tensor made per step would be a host-to-device copy)."""

    tables: list[TableSpec]
    features: list[str]
    dim: int

    def parts(self) -> list[EmbeddingCollection]:
        raise NotImplementedError

    def _order_columns(self, device: torch.device | str) -> None:
        """Register ``column_order`` on ``device`` (where the pooled columns are made):
        each feature's column among the parts' columns."""
        concat = [f for part in self.parts() for f in part.features]
        order = torch.tensor([concat.index(f) for f in self.features], device=device)
        self.register_buffer("column_order", order, persistent=False)

    def columns_in_feature_order(self, pooled: list[torch.Tensor]) -> torch.Tensor:
        """Each part's pooled [B, len(part.features)*D] as one [B, F*D], feature order."""
        batch = pooled[0].shape[0]
        columns = torch.cat([p.view(batch, len(part.features), self.dim)
                             for p, part in zip(pooled, self.parts(), strict=True)], dim=1)
        return columns.index_select(1, self.column_order).reshape(batch, len(self.features) * self.dim)

    def set_lr(self, lr: float) -> None:
        for part in self.parts():
            part.set_lr(lr)

    def step(self) -> None:
        for part in self.parts():
            part.step()

    def kv_gradients(self) -> dict[str, KVGradient]:
        return {name: grad for part in self.parts() for name, grad in part.kv_gradients().items()}

    def export_tables(self) -> dict[str, torch.Tensor]:
        return {key: t for part in self.parts() for key, t in part.export_tables().items()}

    def import_tables(self, tensors: dict[str, torch.Tensor]) -> None:
        for part in self.parts():  # each takes its own tables' keys
            part.import_tables(tensors)

    def _held(self) -> tuple[list, dict]:
        """The parts' held tables and their sharding, as one ``TableState`` lists them."""
        held, sharding = [], {}
        for part in self.parts():
            state = part.table_state()
            held += state.held
            sharding.update(state.sharding)
        return held, sharding


class DtypeStacks(PerDtype):
    """``LocalEmbeddingCollection``'s interface over tables of several dtypes: one
    stack per dtype (``stacks``, in the order the dtypes first appear)."""

    def __init__(self, tables: list[TableSpec], make_optimizer: Callable[[], SparseOptimizer], fused: bool = True,
                 seed: int | None = 0, device: torch.device | str = "cpu", rounding_seed: int | None = None,
                 kernels: str = "auto") -> None:
        super().__init__()
        self.tables = list(tables)
        self.dim = tables[0].dim
        self.features = [f for t in tables for f in t.features]
        self.fused = fused
        self.stacks = nn.ModuleList()
        for dtype in dict.fromkeys(t.dtype for t in tables):
            optimizer = make_optimizer()
            optimizer.rounding = True  # several dtypes: one is half, so every stack counts its updates
            self.stacks.append(LocalEmbeddingCollection(
                [t for t in tables if t.dtype == dtype], optimizer, fused=fused, seed=seed, device=device,
                rounding_seed=rounding_seed, kernels=kernels))
        self.optimizer = self.stacks[0].optimizer
        for i, stack in enumerate(self.stacks):  # buffers: they follow .to(device)
            route = stack.route_among(self.features)
            for part in ROUTE_PARTS:
                self.register_buffer(f"route{i}_{part}", getattr(route, part), persistent=False)
        self._order_columns(device)

    def parts(self) -> list[EmbeddingCollection]:
        return list(self.stacks)

    def _route(self, i: int) -> FeatureRoute:
        from embeddings.kernels.lookup import FeatureRoute

        return FeatureRoute(*(self.get_buffer(f"route{i}_{part}") for part in ROUTE_PARTS))

    def on_triton(self) -> bool:
        return all(s.on_triton() for s in self.stacks)

    def forward(self, sparse: KeyedJagged) -> torch.Tensor:
        """[B, F*D]: on the Triton path every stack pools the whole batch (its own
        columns, zeros elsewhere) and the parts are added; on the torch path the batch
        is split by stack."""
        groups = [s.features for s in self.stacks]
        if not self.on_triton():
            return self.columns_in_feature_order(
                [s(part) for s, part in zip(self.stacks, split_features(sparse, groups), strict=True)])
        values, lengths, batch = in_feature_order(sparse, self.features)
        out = self.stacks[0].pooled_among(values, lengths, batch, self._route(0))
        for i in range(1, len(self.stacks)):
            out = out + self.stacks[i].pooled_among(values, lengths, batch, self._route(i))
        return out

    # ------------------------------------------------------------------ state
    def table_state(self) -> TableState:
        """Every table whole, each in its stack's type (tables in their run order)."""
        return TableState(self.tables, *self._held(), self.optimizer)
