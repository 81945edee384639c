"""What a plan costs each rank: bytes (:func:`plan_memory`) and the planner's
balance measure (:func:`rank_costs`). The per-shard pieces (all-to-all buffers,
floats read per sample) are the strategies' own (embeddings/sharding/).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from embeddings.plan.types import Shard, ShardingPlan, ShardingType, tables_by_name
from embeddings.sharding.registry import strategy
from embeddings.table import TableSpec

if TYPE_CHECKING:
    from embeddings.optim import SparseOptimizer


@dataclass
class RankMemory:
    """Bytes one rank needs: embedding weights, their optimizer state, exchange buffers."""

    tables: int
    optimizer: int
    buffers: int

    @property
    def total(self) -> int:
        return self.tables + self.optimizer + self.buffers

    def __add__(self, other: RankMemory) -> RankMemory:
        return RankMemory(
            self.tables + other.tables,
            self.optimizer + other.optimizer,
            self.buffers + other.buffers,
        )


class Estimator:
    """Memory and lookup work of shards, for given tables, optimizer and global batch.

    ``ids[table]`` is the table's ids per sample: the sum of its features' pooling
    factors (1.0 for a feature not in ``pooling_factors``, i.e. single-hot).
    """

    def __init__(
        self,
        tables: list[TableSpec],
        optimizer: SparseOptimizer,
        batch_size: int,
        world_size: int,
        pooling_factors: dict[str, float] | None,
    ) -> None:
        self.tables = tables_by_name(tables)
        self.optimizer = optimizer
        self.batch_size = batch_size
        self.world_size = world_size
        factors = pooling_factors or {}
        unknown = sorted(set(factors) - {f for t in tables for f in t.features})
        if unknown:
            raise ValueError(f"pooling factor given for {unknown[0]!r}, which no table serves")
        self.ids = {t.name: sum(factors.get(f, 1.0) for f in t.features) for t in tables}
        self._state: dict[int, int] = {}
        self.total_lookup = sum(self.ids[t.name] * t.dim for t in tables) or 1.0
        self.total_bytes = sum(self.full_bytes(t) for t in tables) or 1

    def state_bytes(self, cols: int) -> int:
        """Optimizer state bytes of one row of ``cols`` columns (cached)."""
        if cols not in self._state:
            self._state[cols] = self.optimizer.state_bytes_per_row(cols)
        return self._state[cols]

    def full_bytes(self, table: TableSpec) -> int:
        """Weights and optimizer state of the whole table."""
        return table.bytes + table.rows * self.state_bytes(table.dim)

    def memory(self, shard: Shard, sharding: ShardingType) -> RankMemory:
        """What ``shard`` adds to its rank: weights, state, and its all-to-all
        buffers (the strategy's ``buffer_bytes``; replicated shards exchange nothing)."""
        table = self.tables[shard.table]
        buffers = strategy(sharding).buffer_bytes(shard, table, self.ids[table.name], self.batch_size)
        state = shard.rows * self.state_bytes(shard.cols)
        return RankMemory(shard.rows * shard.cols * table.itemsize, state, buffers)

    def slice_buffers(self, model_parallel: list[str]) -> int:
        """Each rank's own side of the all-to-alls, for its slice of the global batch:
        the ids it sends and the pooled vectors (and gradients) it gets back, over all
        model-parallel tables. The same on every rank."""
        local = math.ceil(self.batch_size / self.world_size)
        per_sample = sum(
            self.ids[n] * 8 + len(self.tables[n].features) * self.tables[n].dim * 4 * 2
            for n in model_parallel
        )
        return math.ceil(local * per_sample)

    def lookup(self, shard: Shard, sharding: ShardingType) -> float:
        """Floats ``shard`` reads per sample of the global batch (the strategy's
        ``lookup_floats``: ids x share x cols; a replicated table 1/W of ids x dim)."""
        table = self.tables[shard.table]
        return strategy(sharding).lookup_floats(shard, table, self.ids[table.name], self.world_size)

    def cost(self, shard: Shard, sharding: ShardingType) -> float:
        """The share of the model's lookup work plus the share of its weights and
        state that ``shard`` puts on its rank (so a perfectly balanced rank costs 2/W)."""
        mem = self.memory(shard, sharding)
        return (
            self.lookup(shard, sharding) / self.total_lookup
            + (mem.tables + mem.optimizer) / self.total_bytes
        )


def plan_memory(
    plan: ShardingPlan,
    tables: list[TableSpec],
    optimizer: SparseOptimizer,
    batch_size: int,
    pooling_factors: dict[str, float] | None = None,
) -> list[RankMemory]:
    """Estimated bytes on each rank of ``plan`` (one entry per rank).

    tables:    rows x cols x 4 (fp32 weights) of every shard on the rank
    optimizer: rows x ``optimizer.state_bytes_per_row(cols)`` of every shard
    buffers:   the all-to-all buffers for a global batch of ``batch_size``: what
               the rank's model-parallel shards receive (ids, 8 bytes each) and send
               (pooled vectors and their gradients, 4 bytes a float, twice), plus the
               rank's own slice of the batch going the other way (see
               ``ModelParallel.buffer_bytes`` and ``Estimator.slice_buffers``).
               Activations of the MLPs and the KV gradients of replicated tables are
               not counted.

    data_parallel tables cost their full size on every rank.
    """
    est = Estimator(tables, optimizer, batch_size, plan.world_size, pooling_factors)
    model_parallel = [n for n, tp in plan.tables.items() if strategy(tp.sharding).model_parallel]
    base = est.slice_buffers(model_parallel)
    out = [RankMemory(0, 0, base) for _ in range(plan.world_size)]
    for tp in plan.tables.values():
        for s in tp.shards:
            out[s.rank] = out[s.rank] + est.memory(s, tp.sharding)
    return out


def rank_costs(
    plan: ShardingPlan,
    tables: list[TableSpec],
    optimizer: SparseOptimizer,
    pooling_factors: dict[str, float] | None = None,
) -> list[float]:
    """The planner's cost of each rank of ``plan``: the sum over its shards of

        cost(shard) = lookup(shard) / Σ_tables ids(t)·dim(t)
                    + (weights + state bytes of shard) / Σ_tables (weights + state bytes)

    where lookup(shard) = ids(t) x (shard rows / table rows) x shard cols is the
    floats it reads per sample (replicated: ids(t) x dim / W, its rank's slice), and
    ids(t) the table's ids per sample. Each term is a share of the whole model, so
    lookups and memory weigh the same and the batch size cancels out; an even plan
    puts about 2/W on every rank.
    """
    est = Estimator(tables, optimizer, 1, plan.world_size, pooling_factors)
    out = [0.0] * plan.world_size
    for tp in plan.tables.values():
        for s in tp.shards:
            out[s.rank] += est.cost(s, tp.sharding)
    return out
