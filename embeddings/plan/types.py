"""A sharding plan: which rank holds which block of which table (JSON in RUN/plan.json).

    ShardingPlan(world_size=2)
      tables["big"]  = TablePlan("big", ROW_WISE, [Shard(big, rank 0, rows 0-500k, cols 0-64),
                                                   Shard(big, rank 1, rows 500k-1M, cols 0-64)])
      tables["tiny"] = TablePlan("tiny", DATA_PARALLEL, [a full Shard on rank 0, one on rank 1])

What each ShardingType does is its strategy's business (embeddings/sharding/).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from enum import Enum

from data.errors import UserError
from embeddings.table import TableSpec


class PlanError(UserError):
    """A plan that cannot be made: a bad size or pin, a table that does not fit."""


class ShardingType(str, Enum):
    """The strategies by their YAML / log names (embeddings/sharding/registry.py)."""

    TABLE_WISE = "table_wise"
    COLUMN_WISE = "column_wise"
    ROW_WISE = "row_wise"
    DATA_PARALLEL = "data_parallel"


@dataclass(frozen=True)
class Shard:
    """Rows [row_start, row_end) x columns [col_start, col_end) of ``table`` on ``rank``."""

    table: str
    rank: int
    row_start: int
    row_end: int
    col_start: int
    col_end: int

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def cols(self) -> int:
        return self.col_end - self.col_start


@dataclass
class TablePlan:
    table: str
    sharding: ShardingType
    shards: list[Shard]  # data_parallel: one full copy per rank


@dataclass
class ShardingPlan:
    world_size: int
    tables: dict[str, TablePlan] = field(default_factory=dict)

    def shards_on(self, rank: int) -> list[Shard]:
        """Shards held by ``rank``, in table order then column/row order."""
        return [s for tp in self.tables.values() for s in tp.shards if s.rank == rank]

    def by_type(self, sharding: ShardingType) -> list[str]:
        return [name for name, tp in self.tables.items() if tp.sharding is sharding]

    def to_json(self) -> str:
        return json.dumps(
            {
                "world_size": self.world_size,
                "tables": {
                    name: {"sharding": tp.sharding.value, "shards": [asdict(s) for s in tp.shards]}
                    for name, tp in self.tables.items()
                },
            },
            indent=1,
        )

    @staticmethod
    def from_json(text: str) -> ShardingPlan:
        raw = json.loads(text)
        return ShardingPlan(
            world_size=raw["world_size"],
            tables={
                name: TablePlan(
                    name, ShardingType(t["sharding"]), [Shard(**s) for s in t["shards"]]
                )
                for name, t in raw["tables"].items()
            },
        )


def tables_by_name(tables: list[TableSpec]) -> dict[str, TableSpec]:
    """``tables`` keyed by name; ValueError where a name appears twice."""
    out = {t.name: t for t in tables}
    if len(out) != len(tables):
        dup = next(n for n, c in Counter(t.name for t in tables).items() if c > 1)
        raise ValueError(f"table {dup!r} appears twice")
    return out
