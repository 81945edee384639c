"""Which rank holds which part of which table.

A table is cut into shards; a shard is a block of rows x columns on one rank:

    table_wise      column_wise (3 ranks)     row_wise (3 ranks)     data_parallel
    ┌────────┐      ┌──┬──┬──┐                ┌────────┐ rank 0      ┌────────┐ every
    │ rank 2 │      │r0│r1│r2│                ├────────┤ rank 1      │  all   │ rank,
    │        │      │  │  │  │                ├────────┤ rank 2      │        │ a full
    └────────┘      └──┴──┴──┘                └────────┘             └────────┘ copy

Model-parallel shards (the first three) receive ids by all-to-all and send pooled
vectors back; replicated tables look up locally and exchange KV gradients.

The planner (:func:`auto_plan`) picks a strategy for every table that is not
pinned: tiny tables are replicated, a table too big for one rank is row_wise over
all ranks, the rest are table_wise, placed greedily to balance a cost that adds a
rank's share of the lookup work to its share of the memory (see :func:`rank_costs`).
:func:`plan_memory` estimates each rank's bytes; :func:`describe_plan` prints both.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from data.errors import UserError
from embeddings.table import TableSpec

if TYPE_CHECKING:
    from embeddings.optim import SparseOptimizer


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
    full = {"table": table.name, "row_start": 0, "row_end": table.rows, "col_start": 0,
            "col_end": table.dim}
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


# --------------------------------------------------------------------------- sizes


class PlanError(UserError):
    """A plan that cannot be made: a bad size or pin, a table that does not fit."""


_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int | None:
    """Bytes in ``text``: "16GB", "16 GiB", "512MiB", "1.5G", "4096"; "" → None (no limit).

    Without an "i" the units are powers of 1000 (16GB = 16e9 bytes), with one
    powers of 1024 (16GiB = 16 * 2^30), as Kubernetes reads them. A budget given as
    "16GB" is then the smaller reading, the safe side for a memory limit.
    """
    if not text.strip():
        return None
    m = _SIZE.match(text)
    if m is None or (m[3] and not m[2]):
        raise PlanError(f"size {text!r}: expected a number and a unit, like 16GB, 512MiB or 1.5G")
    power = "kmgtp".index(m[2].lower()) + 1 if m[2] else 0
    size = round(float(m[1]) * (1024 if m[3] else 1000) ** power)
    if size <= 0:
        raise PlanError(f"size {text!r} must be more than 0 bytes")
    return size


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: "512 B", "1.5 KiB", "3.2 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# --------------------------------------------------------------------------- estimates


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


class _Estimator:
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
        self.tables = _by_name(tables)
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
        """What ``shard`` adds to its rank: weights, state, and its all-to-all buffers.

        Per sample of the global batch a model-parallel shard receives its ids (8
        bytes each; row_wise: the share that falls in its rows, taken as its share
        of the rows) and sends its pooled vectors and receives their gradients
        (features x cols floats, twice). Replicated shards exchange nothing.
        """
        table = self.tables[shard.table]
        buffers = 0
        if sharding is not ShardingType.DATA_PARALLEL:
            ids = self.ids[table.name] * shard.rows / table.rows
            per_sample = ids * 8 + len(table.features) * shard.cols * 4 * 2
            buffers = math.ceil(self.batch_size * per_sample)
        state = shard.rows * self.state_bytes(shard.cols)
        return RankMemory(shard.rows * shard.cols * 4, state, buffers)

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
        """Floats ``shard`` reads per sample of the global batch: ids x share x cols.

        A replicated table looks up only its rank's slice of the batch (1/W of it).
        """
        table = self.tables[shard.table]
        if sharding is ShardingType.DATA_PARALLEL:
            return self.ids[table.name] * table.dim / self.world_size
        return self.ids[table.name] * shard.rows / table.rows * shard.cols

    def cost(self, shard: Shard, sharding: ShardingType) -> float:
        """The share of the model's lookup work plus the share of its weights and
        state that ``shard`` puts on its rank (so a perfectly balanced rank costs 2/W)."""
        mem = self.memory(shard, sharding)
        return (
            self.lookup(shard, sharding) / self.total_lookup
            + (mem.tables + mem.optimizer) / self.total_bytes
        )


def _by_name(tables: list[TableSpec]) -> dict[str, TableSpec]:
    out = {t.name: t for t in tables}
    if len(out) != len(tables):
        dup = next(n for n, c in Counter(t.name for t in tables).items() if c > 1)
        raise ValueError(f"table {dup!r} appears twice")
    return out


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
               ``_Estimator.memory`` and ``_Estimator.slice_buffers``). Activations of
               the MLPs and the KV gradients of replicated tables are not counted.

    data_parallel tables cost their full size on every rank.
    """
    est = _Estimator(tables, optimizer, batch_size, plan.world_size, pooling_factors)
    dp = ShardingType.DATA_PARALLEL
    model_parallel = [n for n, tp in plan.tables.items() if tp.sharding is not dp]
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
    est = _Estimator(tables, optimizer, 1, plan.world_size, pooling_factors)
    out = [0.0] * plan.world_size
    for tp in plan.tables.values():
        for s in tp.shards:
            out[s.rank] += est.cost(s, tp.sharding)
    return out


# --------------------------------------------------------------------------- planner


Pins = dict[str, tuple[ShardingType, list[int]]]


class _Ranks:
    """Memory and cost of every rank while the planner puts shards on them."""

    def __init__(self, est: _Estimator, budget: int | None, base_buffers: int) -> None:
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
                raise PlanError(
                    f"table {s.table}{note} needs {format_bytes(need.total)} on rank {s.rank} "
                    f"but only {format_bytes(max(left, 0))} is left of {format_bytes(self.budget)}"
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
    4. The rest are table_wise, largest cost first (see :func:`rank_costs`), each on
       the rank of lowest cost so far that has room for it; ties go to the lowest rank.

    No randomness and no dependence on dict order: the same inputs give the same
    plan. With a budget, a shard that does not fit raises :class:`PlanError` naming
    the table, the rank and the bytes needed and left; so does a bad pin.
    ``pooling_factors`` (feature → mean ids per sample, default 1) weigh lookups.
    """
    pins = _check_pins(tables, world_size, pinned or {})
    est = _Estimator(tables, optimizer, batch_size, world_size, pooling_factors)
    first = {t.name: _first_choice(t, pins, est, replicate_max_bytes) for t in tables}
    model_parallel = [
        t.name for t in tables
        if first[t.name] is None or first[t.name][0] is not ShardingType.DATA_PARALLEL
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
    tables: list[TableSpec], est: _Estimator, ranks: _Ranks, pins: Pins
) -> dict[str, TablePlan]:
    """Each of ``tables`` whole on one rank: largest cost first (ties: by name), on
    the rank of lowest cost that has room (ties: lowest rank) - greedy LPT."""
    whole = {t.name: Shard(t.name, 0, 0, t.rows, 0, t.dim) for t in tables}
    cost = {n: est.cost(shard, ShardingType.TABLE_WISE) for n, shard in whole.items()}
    order = sorted(tables, key=lambda t: (-cost[t.name], t.name))
    placed = {}
    for t in order:
        rank = ranks.pick(est.memory(whole[t.name], ShardingType.TABLE_WISE).total)
        placed[t.name] = shard_table(t, ShardingType.TABLE_WISE, [rank])
        ranks.add(placed[t.name], " (pinned)" if t.name in pins else "")
    return placed


def _check_pins(tables: list[TableSpec], world_size: int, pinned: Pins) -> Pins:
    """``pinned`` with ShardingType values, checked against the tables and ranks."""
    if world_size < 1:
        raise PlanError(f"world size {world_size} must be at least 1")
    specs = _by_name(tables)
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
        if sharding is ShardingType.TABLE_WISE and len(ranks) > 1:
            raise PlanError(f"table {name}: table_wise takes one rank, not {ranks}")
        n = len(ranks) or world_size
        t = specs[name]
        if (sharding is ShardingType.COLUMN_WISE and n > t.dim) or (
            sharding is ShardingType.ROW_WISE and n > t.rows
        ):
            raise PlanError(
                f"table {name}: {t.rows}x{t.dim} cannot be split {sharding.value} over {n} ranks"
            )
        out[name] = (sharding, ranks)
    return out


def _first_choice(
    t: TableSpec, pins: Pins, est: _Estimator, replicate_max_bytes: int
) -> tuple[ShardingType, list[int] | None] | None:
    """Strategy and ranks of a pinned, single-rank or tiny table (ranks None: one
    rank the greedy picks); None for a table to be sized up against the budget."""
    everyone = list(range(est.world_size))
    if t.name in pins:
        sharding, ranks = pins[t.name]
        if sharding is ShardingType.TABLE_WISE:
            return sharding, ranks or None
        return sharding, ranks or everyone
    if est.world_size == 1:
        return ShardingType.TABLE_WISE, [0]
    if est.full_bytes(t) <= replicate_max_bytes:
        return ShardingType.DATA_PARALLEL, everyone
    return None


def _size_choice(
    t: TableSpec, est: _Estimator, room: float | None
) -> tuple[ShardingType, list[int] | None]:
    """table_wise (rank to be picked) if ``t`` fits ``room`` bytes, else spread over all."""
    whole = Shard(t.name, 0, 0, t.rows, 0, t.dim)
    if room is None or est.memory(whole, ShardingType.TABLE_WISE).total <= room:
        return ShardingType.TABLE_WISE, None
    everyone = list(range(est.world_size))
    spreads = [
        s for s, n in ((ShardingType.ROW_WISE, t.rows), (ShardingType.COLUMN_WISE, t.dim))
        if n >= est.world_size
    ]
    if not spreads:
        raise PlanError(f"table {t.name} ({t.rows}x{t.dim}) does not fit one rank "
                        f"and cannot be split over {est.world_size}")
    for sharding in spreads:
        tp = shard_table(t, sharding, everyone)
        if max(est.memory(s, sharding).total for s in tp.shards) <= room:
            return sharding, everyone
    return spreads[0], everyone


# --------------------------------------------------------------------------- description


def describe_plan(
    plan: ShardingPlan,
    tables: list[TableSpec],
    memory: list[RankMemory],
    budget: int | None = None,
) -> str:
    """A readable account of ``plan``: every table's strategy, ranks and shard shapes
    (rows x cols), then every rank's memory (from :func:`plan_memory`) against ``budget``.

        sharding plan: 3 tables over 2 ranks (table_wise 1, row_wise 1, data_parallel 1)
        table  rows x dim         sharding       ranks  shards (rows x cols)
        big    1,000,000x64       row_wise       0-1    2 of 500,000x64
        ...
        rank  tables     optimizer  buffers   total      free of 8.0 GiB
        0     130.0 MiB  0 B        1.1 MiB   131.1 MiB  7.9 GiB
    """
    specs = _by_name(tables)
    counts = Counter(tp.sharding for tp in plan.tables.values())
    kinds = ", ".join(f"{k.value} {counts[k]}" for k in ShardingType if counts[k])
    head = f"sharding plan: {len(plan.tables)} tables over {plan.world_size} ranks ({kinds})"
    table_rows = [["table", "rows x dim", "sharding", "ranks", "shards (rows x cols)"]]
    for name, tp in plan.tables.items():
        size = f"{specs[name].rows:,}x{specs[name].dim}"
        ranks = _rank_list(tp, plan.world_size)
        table_rows.append([name, size, tp.sharding.value, ranks, _shapes(tp)])
    mem_rows = [["rank", "tables", "optimizer", "buffers", "total"]]
    if budget is not None:
        mem_rows[0].append(f"free of {format_bytes(budget)}")
    for r, m in enumerate(memory):
        row = [str(r), *(format_bytes(b) for b in (m.tables, m.optimizer, m.buffers, m.total))]
        if budget is not None:
            row.append(format_bytes(budget - m.total))
        mem_rows.append(row)
    return "\n".join([head, *_align(table_rows), "", *_align(mem_rows)])


def _rank_list(tp: TablePlan, world_size: int) -> str:
    """"all" (a copy on every rank), "3", "0-3", or "2,0,1" in shard order."""
    ranks = [s.rank for s in tp.shards]
    if tp.sharding is ShardingType.DATA_PARALLEL and sorted(ranks) == list(range(world_size)):
        return "all"
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _shapes(tp: TablePlan) -> str:
    """Shard shapes: "200,000x64", or "2 of 100,000x64" / "2 of 66,667x64, 1 of 66,666x64"."""
    shapes = Counter(f"{s.rows:,}x{s.cols}" for s in tp.shards)
    if tp.sharding is ShardingType.TABLE_WISE:
        return next(iter(shapes))
    if tp.sharding is ShardingType.DATA_PARALLEL:
        return f"{next(iter(shapes))} on each"
    return ", ".join(f"{n} of {shape}" for shape, n in shapes.items())


def _align(rows: list[list[str]]) -> list[str]:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
