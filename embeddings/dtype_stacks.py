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
from embeddings.jagged import columns_in_order, in_feature_order, split_features
from embeddings.optim import SparseOptimizer
from embeddings.table import TableSpec

if TYPE_CHECKING:
    from data.jagged import KeyedJagged
    from embeddings.kernels.lookup import FeatureRoute
    from embeddings.kv import KVGradient

ROUTE_PARTS = ("row_base", "keys", "row_shift", "col0")


class DtypeStacks(EmbeddingCollection):
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
            pooled = [s(part) for s, part in zip(self.stacks, split_features(sparse, groups), strict=True)]
            return columns_in_order(pooled, groups, self.features, self.dim)
        values, lengths, batch = in_feature_order(sparse, self.features)
        out = self.stacks[0].pooled_among(values, lengths, batch, self._route(0))
        for i in range(1, len(self.stacks)):
            out = out + self.stacks[i].pooled_among(values, lengths, batch, self._route(i))
        return out

    # ------------------------------------------------------------------ updates
    def set_lr(self, lr: float) -> None:
        for s in self.stacks:
            s.set_lr(lr)

    def step(self) -> None:
        for s in self.stacks:
            s.step()

    def kv_gradients(self) -> dict[str, KVGradient]:
        return {name: grad for s in self.stacks for name, grad in s.kv_gradients().items()}

    # ------------------------------------------------------------------ state
    def export_tables(self) -> dict[str, torch.Tensor]:
        return {key: t for s in self.stacks for key, t in s.export_tables().items()}

    def import_tables(self, tensors: dict[str, torch.Tensor]) -> None:
        for s in self.stacks:  # each takes its own tables' keys
            s.import_tables(tensors)

    def table_state(self) -> TableState:
        """Every table whole, each in its stack's type (tables in their run order)."""
        held, sharding = [], {}
        for s in self.stacks:
            state = s.table_state()
            held += state.held
            sharding.update(state.sharding)
        return TableState(self.tables, held, sharding, self.optimizer)
