"""The planner: a strategy and ranks for every table.

:func:`auto_plan` picks a strategy for every table that is not pinned: tiny tables
are replicated, a table too big for one rank is row_wise over all ranks, the rest
are table_wise, placed greedily to balance a cost that adds a rank's share of the
lookup work to its share of the memory (see embeddings/plan/estimate.py's
``rank_costs``). :func:`fixed_plan` follows given placements.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from embeddings.plan.estimate import Estimator, RankMemory
from embeddings.plan.sizes import format_bytes
from embeddings.plan.types import PlanError, ShardingPlan, ShardingType, TablePlan, tables_by_name
from embeddings.sharding.base import whole_shard
from embeddings.sharding.registry import strategy
from embeddings.table import TableSpec

if TYPE_CHECKING:
    from embeddings.optim import SparseOptimizer

Pins = dict[str, tuple[ShardingType, list[int]]]

# Tried in this order for a table too big for one rank.
_SPREADS = (ShardingType.ROW_WISE, ShardingType.COLUMN_WISE)


def shard_table(table: TableSpec, sharding: ShardingType, ranks: list[int]) -> TablePlan:
    """The shards of ``table`` under ``sharding`` over ``ranks`` (in that order).

    table_wise uses ranks[0]; column_wise splits the dim and row_wise the rows into
    len(ranks) nearly equal pieces; data_parallel puts a full copy on every rank.
    """
    if not ranks:
        raise ValueError(f"table {table.name}: no ranks to place it on")
    return TablePlan(table.name, sharding, strategy(sharding).shards(table, ranks))


def fixed_plan(
    tables: list[TableSpec], world_size: int, placements: dict[str, tuple[ShardingType, list[int]]]
) -> ShardingPlan:
    """A plan that follows ``placements`` (table → strategy, ranks; empty ranks = all)."""
    plan = ShardingPlan(world_size)
    for t in tables:
        sharding, ranks = placements[t.name]
        plan.tables[t.name] = shard_table(t, sharding, ranks or list(range(world_size)))
    return plan


class _Ranks:
    """Memory and cost of every rank while the planner puts shards on them."""

    def __init__(self, est: Estimator, budget: int | None, base_buffers: int) -> None:
        self.est, self.budget = est, budget
        self.memory = [RankMemory(0, 0, base_buffers) for _ in range(est.world_size)]
        self.cost = [0.0] * est.world_size
        if budget is not None and base_buffers > budget:
            raise PlanError(
                f"the all-to-all buffers alone need {format_bytes(base_buffers)} per rank, "
                f"more than the {format_bytes(budget)} budget (a smaller batch needs less)"
            )

    def left(self, rank: int) -> float:
        """Bytes still free on ``rank`` (infinite without a budget)."""
        return math.inf if self.budget is None else self.budget - self.memory[rank].total

    def add(self, tp: TablePlan, note: str = "") -> None:
        """Put the shards of ``tp`` on their ranks; PlanError where one does not fit."""
        for s in tp.shards:
            need = self.est.memory(s, tp.sharding)
            left = self.left(s.rank)
            if need.total > left:
                # the shortfall said too: need and room often print alike ("needs 1.3 GiB
                # ... only 1.3 GiB is left", bench_gpu.yaml at 2 ranks of 4GB)
                raise PlanError(
                    f"table {s.table}{note} needs {format_bytes(need.total)} on rank {s.rank} "
                    f"but only {format_bytes(max(left, 0))} is left of {format_bytes(self.budget)} "
                    f"(short by {format_bytes(need.total - max(left, 0))})"
                )
            self.memory[s.rank] = self.memory[s.rank] + need
            self.cost[s.rank] += self.est.cost(s, tp.sharding)

    def pick(self, need: int) -> int:
        """The rank of lowest cost with ``need`` bytes free (ties: the lowest rank);
        where none has, the one with the most free (adding there then raises)."""
        ranks = range(self.est.world_size)
        fits = [r for r in ranks if need <= self.left(r)]
        if not fits:
            return max(ranks, key=lambda r: (self.left(r), -r))
        return min(fits, key=lambda r: (round(self.cost[r], 12), r))


def auto_plan(
    tables: list[TableSpec],
    world_size: int,
    optimizer: SparseOptimizer,
    *,
    batch_size: int,
    memory_per_rank: int | None = None,
    replicate_max_bytes: int = 1 << 20,
    pinned: Pins | None = None,
    pooling_factors: dict[str, float] | None = None,
) -> ShardingPlan:
    """A plan for ``tables`` over ``world_size`` ranks, the same on every rank.

    1. Pinned tables go where ``pinned`` says (empty ranks: all ranks, or for
       table_wise one rank the greedy below picks). One rank: all table_wise on 0.
    2. Tables whose weights + state are at most ``replicate_max_bytes``: data_parallel.
    3. A table that does not fit an empty rank's budget (``memory_per_rank``, after
       the all-to-all buffers): row_wise over all ranks, or column_wise where only
       that fits (it needs less buffer, row_wise needs less state).
    4. The rest are table_wise, largest cost first (see ``rank_costs``), each on
       the rank of lowest cost so far that has room for it; ties go to the lowest rank.

    No randomness and no dependence on dict order: the same inputs give the same
    plan. With a budget, a shard that does not fit raises :class:`PlanError` naming
    the table, the rank and the bytes needed and left; so does a bad pin.
    ``pooling_factors`` (feature → mean ids per sample, default 1) weigh lookups.
    """
    pins = _check_pins(tables, world_size, pinned or {})
    est = Estimator(tables, optimizer, batch_size, world_size, pooling_factors)
    first = {t.name: _first_choice(t, pins, est, replicate_max_bytes) for t in tables}
    model_parallel = [
        t.name for t in tables
        if first[t.name] is None or strategy(first[t.name][0]).model_parallel
    ]
    ranks = _Ranks(est, memory_per_rank, est.slice_buffers(model_parallel))
    room = None if memory_per_rank is None else ranks.left(0)  # of an empty rank
    choice = {n: c or _size_choice(est.tables[n], est, room) for n, c in first.items()}
    placed: dict[str, TablePlan] = {}
    for t in tables:
        sharding, on = choice[t.name]
        if on is not None:
            placed[t.name] = shard_table(t, sharding, on)
            ranks.add(placed[t.name], " (pinned)" if t.name in pins else "")
    free = [t for t in tables if choice[t.name][1] is None]
    placed.update(_place_table_wise(free, est, ranks, pins))
    return ShardingPlan(world_size, {t.name: placed[t.name] for t in tables})


def _place_table_wise(
    tables: list[TableSpec], est: Estimator, ranks: _Ranks, pins: Pins
) -> dict[str, TablePlan]:
    """Each of ``tables`` whole on one rank: largest cost first (ties: by name), on
    the rank of lowest cost that has room (ties: lowest rank) - greedy LPT."""
    tw = ShardingType.TABLE_WISE
    whole = {t.name: whole_shard(t, 0) for t in tables}
    cost = {n: est.cost(shard, tw) for n, shard in whole.items()}
    order = sorted(tables, key=lambda t: (-cost[t.name], t.name))
    placed = {}
    for t in order:
        rank = ranks.pick(est.memory(whole[t.name], tw).total)
        placed[t.name] = shard_table(t, tw, [rank])
        ranks.add(placed[t.name], " (pinned)" if t.name in pins else "")
    return placed


def _check_pins(tables: list[TableSpec], world_size: int, pinned: Pins) -> Pins:
    """``pinned`` with ShardingType values, checked against the tables and ranks."""
    if world_size < 1:
        raise PlanError(f"world size {world_size} must be at least 1")
    specs = tables_by_name(tables)
    out: Pins = {}
    for name in sorted(pinned):
        sharding, ranks = ShardingType(pinned[name][0]), list(pinned[name][1])
        if name not in specs:
            known = ", ".join(list(specs)[:8]) + (", ..." if len(specs) > 8 else "")
            raise PlanError(f"pinned table {name!r} does not exist (tables: {known})")
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad:
            raise PlanError(f"table {name}: pinned rank {bad[0]} is not in [0, {world_size})")
        if len(set(ranks)) != len(ranks):
            raise PlanError(f"table {name}: pinned ranks {ranks} name a rank twice")
        strategy(sharding).check_pin(specs[name], ranks, world_size)
        out[name] = (sharding, ranks)
    return out


def _first_choice(
    t: TableSpec, pins: Pins, est: Estimator, replicate_max_bytes: int
) -> tuple[ShardingType, list[int] | None] | None:
    """Strategy and ranks of a pinned, single-rank or tiny table (ranks None: one
    rank the greedy picks); None for a table to be sized up against the budget."""
    if t.name in pins:
        sharding, ranks = pins[t.name]
        return sharding, ranks or strategy(sharding).unpinned_ranks(est.world_size)
    if est.world_size == 1:
        return ShardingType.TABLE_WISE, [0]
    if est.full_bytes(t) <= replicate_max_bytes:
        return ShardingType.DATA_PARALLEL, list(range(est.world_size))
    return None


def _size_choice(
    t: TableSpec, est: Estimator, room: float | None
) -> tuple[ShardingType, list[int] | None]:
    """table_wise (rank to be picked) if ``t`` fits ``room`` bytes, else spread over all."""
    if room is None or est.memory(whole_shard(t, 0), ShardingType.TABLE_WISE).total <= room:
        return ShardingType.TABLE_WISE, None
    everyone = list(range(est.world_size))
    spreads = [s for s in _SPREADS if strategy(s).can_spread(t, est.world_size)]
    if not spreads:
        raise PlanError(f"table {t.name} ({t.rows}x{t.dim}) does not fit one rank "
                        f"and cannot be split over {est.world_size}")
    for sharding in spreads:
        tp = shard_table(t, sharding, everyone)
        if max(est.memory(s, sharding).total for s in tp.shards) <= room:
            return sharding, everyone
    return spreads[0], everyone
