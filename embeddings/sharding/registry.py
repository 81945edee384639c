"""The strategy of each :class:`~embeddings.plan.types.ShardingType`.

A new strategy is a file in this folder with a :class:`Strategy` subclass, a value
in ``ShardingType`` and one line below.
"""

from __future__ import annotations

from embeddings.plan.types import ShardingType
from embeddings.sharding.base import Strategy
from embeddings.sharding.column_wise import ColumnWise
from embeddings.sharding.data_parallel import DataParallel
from embeddings.sharding.row_wise import RowWise
from embeddings.sharding.table_wise import TableWise

_STRATEGIES: dict[ShardingType, Strategy] = {
    s.type: s
    for s in (
        TableWise(),
        ColumnWise(),
        RowWise(),
        DataParallel(),
    )
}


def strategy(sharding: ShardingType | str) -> Strategy:
    """The strategy named by ``sharding`` ("row_wise" or ShardingType.ROW_WISE)."""
    return _STRATEGIES[ShardingType(sharding)]
