"""The hot tier: the hot rows on the device, authoritative while they are hot.

    ids    [H]     stacked ids of the hot rows, sorted: slot = searchsorted(ids, id)
    weight [H, D]  their rows (a parameter: autograd calls the lookup's backward)
    state  [H, ..] their optimizer state (per-table scalars: this tier's own copy)

id → slot: a searchsorted on the sorted hot ids, not a [sum(rows)] table of
slots: device memory then grows with the hot set only (8 B per hot row) instead of
8 B per row of every table, which is what Hotline exists to save; the cost is
log2(H) comparisons per lookup.

fp16/bf16 tables: the hot rows are stored in the table's type and updated as the
host tier (and a plain collection) updates them: computed in fp32, written back with
stochastic rounding keyed by (seed, update count, full table, row, column), the row
that of the full table (slot → stacked id → table, row): Hotline rounds every element
as a single-process collection does, bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from embeddings.jagged import bag_offsets
from embeddings.kv import KVGradient
from embeddings.lookup import pooled_lookup
from embeddings.optim import SparseOptimizer
from embeddings.rounding import RowRounding, table_key
from embeddings.table import TableSpec


class HotTier(nn.Module):
    """Hot rows, their optimizer state and their kept gradients (slot ids)."""

    def __init__(self, optimizer: SparseOptimizer, fused: bool, tables: list[TableSpec] | None = None,
                 rounding_seed: int = 0) -> None:
        """``tables`` (all of them, in stacking order) and ``rounding_seed``: where a
        stacked id's rounding coordinates come from (half tables or state)."""
        super().__init__()
        self.optimizer = optimizer
        self.rounding_seed = rounding_seed
        starts, total = [], 0
        for t in tables or []:
            starts.append(total)
            total += t.rows
        self.register_buffer("_sr_starts", torch.tensor(starts, dtype=torch.int64), persistent=False)
        self.register_buffer("_sr_keys", torch.tensor([table_key(t.name) for t in tables or []],
                                                      dtype=torch.int64), persistent=False)
        self.fused = fused
        self.lr = 0.0
        self.kept: list[KVGradient] = []
        self._state_names: list[str] = []
        self._ids_on: dict[torch.device, torch.Tensor] = {}

    def load(self, ids: torch.Tensor, weight: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Hold rows ``weight`` [H, D] of stacked ``ids`` [H] (sorted), with ``state``."""
        self.register_buffer("ids", ids, persistent=False)
        # Copies of the hot ids where ids arrive (the host classifies every batch
        # before it goes to the device): one copy per refresh, not one per lookup.
        self._ids_on = {}
        self.weight = nn.Parameter(weight)
        for name, tensor in state.items():
            self.register_buffer(f"optim_{name}", tensor)
        self._state_names = list(state)

    @property
    def state(self) -> dict[str, torch.Tensor]:
        return {name: self.get_buffer(f"optim_{name}") for name in self._state_names}

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def locate(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hot mask [N], slot [N]; slot is meaningless where not hot)."""
        hot_ids = self._ids_on.get(ids.device)
        if hot_ids is None:
            hot_ids = self._ids_on[ids.device] = self.ids.to(ids.device)
        if hot_ids.numel() == 0:
            return torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids)
        slot = torch.searchsorted(hot_ids, ids).clamp_(max=hot_ids.numel() - 1)
        return hot_ids[slot] == ids, slot

    def lookup(
        self, slots: torch.Tensor, lengths: torch.Tensor, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pooled [S, D] of bags ``lengths`` [S] over hot ``slots``; gradients come
        back to ``receive``."""
        return pooled_lookup(self.weight, slots, bag_offsets(lengths), self.receive, scale)

    def receive(self, grad: KVGradient) -> None:
        if self.fused:
            self.apply(grad)
        else:
            self.kept.append(grad)

    def apply(self, grad: KVGradient) -> None:
        """One optimizer step (an empty ``grad`` counts too), as the host tier takes it."""
        rounder = None
        if self.optimizer.rounding:  # half weight or state: rounded at full-table coordinates
            self.state["rounding_step"] += 1
            rounder = self._round_rows
        self.optimizer.apply(self.weight.data, self.state, grad, self.lr, rounder=rounder)

    def _round_rows(self, slots: torch.Tensor) -> RowRounding:
        """Where hot ``slots`` sit in their full tables: slot → stacked id → (table
        key, row); column 0 (a hot row is whole)."""
        stacked = self.ids[slots]
        starts, keys = self._sr_starts.to(stacked.device), self._sr_keys.to(stacked.device)
        t = torch.searchsorted(starts, stacked, right=True) - 1
        rows = stacked - starts[t]
        return RowRounding(self.weight.dtype, self.rounding_seed, int(self.state["rounding_step"]), keys[t], rows,
                           torch.zeros_like(rows))

    def take(self) -> KVGradient:
        """The kept gradients merged (empty if none), then forgotten."""
        kept, self.kept = self.kept, []
        if kept:
            return KVGradient.cat(kept)
        ids = torch.zeros(0, dtype=torch.int64, device=self.weight.device)
        return KVGradient(ids, self.weight.new_zeros(0, self.weight.shape[1]))

    def kept_by_stacked_id(self) -> list[KVGradient]:
        """The kept gradients with stacked ids instead of slots (not forgotten)."""
        return [KVGradient(self.ids[g.ids], g.rows) for g in self.kept]
