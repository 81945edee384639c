"""Table-wise: the whole table on one rank; every id goes there, the pooled
vector comes back whole.

    feature f ids ──► rank k (holds all rows, all columns) ──► pooled [B, D]
"""

from __future__ import annotations

import torch

from embeddings.plan.types import PlanError, Shard, ShardingType, TablePlan
from embeddings.sharding.base import ModelParallel, Router, whole_shard
from embeddings.table import TableSpec


class TableWiseRouter:
    accumulates = False  # one piece (embeddings/pooled_layout.py)

    def route(self, ids: torch.Tensor, lengths: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(lengths, ids)]


class TableWise(ModelParallel):
    """One shard, the whole table, on ranks[0]."""

    type = ShardingType.TABLE_WISE

    def shards(self, table: TableSpec, ranks: list[int]) -> list[Shard]:
        return [whole_shard(table, ranks[0])]

    def can_spread(self, table: TableSpec, n: int) -> bool:
        return n == 1

    def check_pin(self, table: TableSpec, ranks: list[int], world_size: int) -> None:
        """One rank, or none (the planner picks it)."""
        if len(ranks) > 1:
            raise PlanError(f"table {table.name}: table_wise takes one rank, not {ranks}")

    def unpinned_ranks(self, world_size: int) -> list[int] | None:
        return None

    def router(self, table_plan: TablePlan) -> Router:
        return TableWiseRouter()

    def describe_shapes(self, table_plan: TablePlan) -> str:
        """"200,000x64"."""
        s = table_plan.shards[0]
        return f"{s.rows:,}x{s.cols}"
