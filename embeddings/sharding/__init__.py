"""One file per sharding strategy: how a feature's ids are routed to the shards of
its table, and how the shards' pooled pieces are put back together.

    route(ids, lengths)  → per shard (lengths [B], ids rebased to the shard)
    combine(pieces)      → pooled [B, D] from per-shard pooled pieces, shard order
"""

from __future__ import annotations

from embeddings.plan import ShardingType, TablePlan
from embeddings.sharding.base import Router
from embeddings.sharding.column_wise import ColumnWiseRouter
from embeddings.sharding.row_wise import RowWiseRouter
from embeddings.sharding.table_wise import TableWiseRouter


def router_for(table_plan: TablePlan) -> Router:
    if table_plan.sharding is ShardingType.TABLE_WISE:
        return TableWiseRouter()
    if table_plan.sharding is ShardingType.COLUMN_WISE:
        return ColumnWiseRouter(len(table_plan.shards))
    if table_plan.sharding is ShardingType.ROW_WISE:
        return RowWiseRouter([s.row_start for s in table_plan.shards])
    raise ValueError(f"{table_plan.table}: {table_plan.sharding.value} tables are not routed")
