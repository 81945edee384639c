"""Which rank holds which part of which table.

A table is cut into shards; a shard is a block of rows x columns on one rank:

    table_wise      column_wise (3 ranks)     row_wise (3 ranks)     data_parallel
    ┌────────┐      ┌──┬──┬──┐                ┌────────┐ rank 0      ┌────────┐ every
    │ rank 2 │      │r0│r1│r2│                ├────────┤ rank 1      │  all   │ rank,
    │        │      │  │  │  │                ├────────┤ rank 2      │        │ a full
    └────────┘      └──┴──┴──┘                └────────┘             └────────┘ copy

Model-parallel shards (the first three) receive ids by all-to-all and send pooled
vectors back; replicated tables look up locally and exchange KV gradients.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum

from embeddings.table import TableSpec


class ShardingType(str, Enum):
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
    def from_json(text: str) -> "ShardingPlan":
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


def even_splits(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of ``parts`` nearly equal pieces of ``total`` (first ones larger)."""
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def shard_table(table: TableSpec, sharding: ShardingType, ranks: list[int]) -> TablePlan:
    """The shards of ``table`` under ``sharding`` over ``ranks`` (in that order).

    table_wise uses ranks[0]; column_wise splits the dim and row_wise the rows into
    len(ranks) nearly equal pieces; data_parallel puts a full copy on every rank.
    """
    if not ranks:
        raise ValueError(f"table {table.name}: no ranks to place it on")
    full = dict(table=table.name, row_start=0, row_end=table.rows, col_start=0, col_end=table.dim)
    if sharding is ShardingType.TABLE_WISE:
        shards = [Shard(rank=ranks[0], **full)]
    elif sharding is ShardingType.DATA_PARALLEL:
        shards = [Shard(rank=r, **full) for r in ranks]
    elif sharding is ShardingType.COLUMN_WISE:
        if len(ranks) > table.dim:
            raise ValueError(f"table {table.name}: dim {table.dim} cannot split over {len(ranks)} ranks")
        shards = [
            Shard(table.name, r, 0, table.rows, c0, c1)
            for r, (c0, c1) in zip(ranks, even_splits(table.dim, len(ranks)))
        ]
    else:
        if len(ranks) > table.rows:
            raise ValueError(f"table {table.name}: {table.rows} rows cannot split over {len(ranks)} ranks")
        shards = [
            Shard(table.name, r, r0, r1, 0, table.dim)
            for r, (r0, r1) in zip(ranks, even_splits(table.rows, len(ranks)))
        ]
    return TablePlan(table.name, sharding, shards)


def fixed_plan(
    tables: list[TableSpec], world_size: int, placements: dict[str, tuple[ShardingType, list[int]]]
) -> ShardingPlan:
    """A plan that follows ``placements`` (table → strategy, ranks; empty ranks = all)."""
    plan = ShardingPlan(world_size)
    for t in tables:
        sharding, ranks = placements[t.name]
        plan.tables[t.name] = shard_table(t, sharding, ranks or list(range(world_size)))
    return plan
