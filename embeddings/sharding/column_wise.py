"""Column-wise: the dim is split across ranks; every id goes to every column
shard, and the pooled pieces are concatenated side by side.

    ids ──┬─► rank a: cols [0, 22)   ─► [B, 22] ─┐
          ├─► rank b: cols [22, 43)  ─► [B, 21] ─┼─► cat ─► [B, 64]
          └─► rank c: cols [43, 64)  ─► [B, 21] ─┘

Every column shard holds every row, so a per-row optimizer state (row-wise
Adagrad's mean g² over the whole row) is summed across the shards in the
collection's ``step`` and is the same on all of them; a checkpoint stores it once.
"""

from __future__ import annotations

import torch

from embeddings.plan.types import Shard, ShardingType, TablePlan
from embeddings.sharding.base import ModelParallel, Router, even_splits
from embeddings.table import TableSpec


class ColumnWiseRouter:
    accumulates = False  # pieces sit side by side (embeddings/pooled_layout.py)

    def __init__(self, num_shards: int) -> None:
        self.num_shards = num_shards

    def route(self, ids: torch.Tensor, lengths: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(lengths, ids)] * self.num_shards


class ColumnWise(ModelParallel):
    """len(ranks) nearly equal column ranges, all rows each."""

    type = ShardingType.COLUMN_WISE
    splits_columns = True

    def shards(self, table: TableSpec, ranks: list[int]) -> list[Shard]:
        if len(ranks) > table.dim:
            raise ValueError(f"table {table.name}: dim {table.dim} cannot split over {len(ranks)} ranks")
        return [
            Shard(table.name, r, 0, table.rows, c0, c1)
            for r, (c0, c1) in zip(ranks, even_splits(table.dim, len(ranks)))
        ]

    def can_spread(self, table: TableSpec, n: int) -> bool:
        return n <= table.dim

    def router(self, table_plan: TablePlan) -> Router:
        return ColumnWiseRouter(len(table_plan.shards))
