"""Row-wise: row ranges across ranks; each id goes to the shard holding its row
(rebased to that shard's first row), and the partial sums of a bag are added.

    bag [3, 9, 12]   shards rows [0, 5) [5, 10) [10, 15)
      ──► shard 0: [3]      shard 1: [4] (= 9 - 5)    shard 2: [2] (= 12 - 10)
      ◄── pooled = p0 + p1 + p2   (sum pooling; mean divides by the full length later)
"""

from __future__ import annotations

import torch

from embeddings.plan.types import Shard, ShardingType, TablePlan
from embeddings.sharding.base import ModelParallel, Router, even_splits
from embeddings.table import TableSpec


class RowWiseRouter:
    accumulates = True  # partial sums are added (embeddings/pooled_layout.py)

    def __init__(self, row_starts: list[int]) -> None:
        self.row_starts = torch.tensor(row_starts, dtype=torch.int64)

    def route(self, ids: torch.Tensor, lengths: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batch, shards = lengths.numel(), self.row_starts.numel()
        starts = self.row_starts.to(ids.device)
        shard_of_id = torch.searchsorted(starts, ids, right=True) - 1
        sample_of_id = torch.repeat_interleave(
            torch.arange(batch, device=ids.device), lengths, output_size=ids.numel()
        )
        # Stable sort by shard keeps each shard's ids in sample order.
        order = torch.sort(shard_of_id, stable=True).indices
        local_ids = (ids - starts[shard_of_id]).index_select(0, order)
        per_sample = torch.bincount(shard_of_id * batch + sample_of_id, minlength=shards * batch)
        per_sample = per_sample.view(shards, batch)
        counts = per_sample.sum(dim=1).tolist()
        return list(zip(per_sample.unbind(0), local_ids.split(counts)))


class RowWise(ModelParallel):
    """len(ranks) nearly equal row ranges, all columns each."""

    type = ShardingType.ROW_WISE

    def shards(self, table: TableSpec, ranks: list[int]) -> list[Shard]:
        if len(ranks) > table.rows:
            raise ValueError(f"table {table.name}: {table.rows} rows cannot split over {len(ranks)} ranks")
        return [
            Shard(table.name, r, r0, r1, 0, table.dim)
            for r, (r0, r1) in zip(ranks, even_splits(table.rows, len(ranks)))
        ]

    def can_spread(self, table: TableSpec, n: int) -> bool:
        return n <= table.rows

    def router(self, table_plan: TablePlan) -> Router:
        return RowWiseRouter([s.row_start for s in table_plan.shards])
