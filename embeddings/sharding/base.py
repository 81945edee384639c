"""The contract of a sharding strategy (see the package docstring).

A :class:`Strategy` answers every question the rest of the code asks about one
way of cutting a table, so that no other file branches on the sharding type:

    placement     shards(table, ranks), check_pin, can_spread, unpinned_ranks
    routing       model_parallel, router(table_plan) (route ids; pieces add or not)
    cost          buffer_bytes (all-to-all), lookup_floats (per sample)
    description   describe_ranks, describe_shapes
    ownership     first_copy (which copy of an element a read takes)
    checkpoint    splits_columns / per_row_state_whole, saved_whole

:class:`ModelParallel` holds what the three model-parallel strategies share: ids
travel to the shard owners by all-to-all and pooled pieces travel back.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter
from typing import ClassVar, Protocol

import torch

from embeddings.plan.types import PlanError, Shard, ShardingType, TablePlan
from embeddings.table import TableSpec


class Router(Protocol):
    def route(
        self, ids: torch.Tensor, lengths: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """ids [N] of one feature, lengths [B] → per shard (lengths [B], ids)."""
        ...

    # How per-shard pooled pieces (shard order) make the pooled [B, D]: added
    # (True) or side by side (False); done by embeddings/pooled_layout.py.
    accumulates: bool


def even_splits(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of ``parts`` nearly equal pieces of ``total`` (first ones larger)."""
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def whole_shard(table: TableSpec, rank: int) -> Shard:
    """All rows and columns of ``table`` on ``rank``."""
    return Shard(table.name, rank, 0, table.rows, 0, table.dim)


class Strategy(ABC):
    """One way of cutting a table into shards, and everything that follows from it."""

    type: ClassVar[ShardingType]
    #: Ids travel to the shards by all-to-all and pooled pieces come back (True),
    #: or every rank holds a full copy and looks up locally (False).
    model_parallel: ClassVar[bool]
    #: The shards split the table's columns, each holding every row: a per-row
    #: optimizer state (row-wise Adagrad's mean g² over the whole row) needs every
    #: shard's partial sum, and is then the same on every shard.
    splits_columns: ClassVar[bool] = False

    # ---------------------------------------------------------------- placement
    @abstractmethod
    def shards(self, table: TableSpec, ranks: list[int]) -> list[Shard]:
        """The shards of ``table`` over ``ranks`` (non-empty, in that order)."""

    @abstractmethod
    def can_spread(self, table: TableSpec, n: int) -> bool:
        """Whether ``table`` can be cut into shards on ``n`` ranks."""

    def check_pin(self, table: TableSpec, ranks: list[int], world_size: int) -> None:
        """PlanError if ``table`` cannot be pinned to ``ranks`` (empty: all ranks)."""
        n = len(ranks) or world_size
        if not self.can_spread(table, n):
            raise PlanError(
                f"table {table.name}: {table.rows}x{table.dim} cannot be split "
                f"{self.type.value} over {n} ranks"
            )

    def unpinned_ranks(self, world_size: int) -> list[int] | None:
        """The ranks of a pin that names none: all of them (None: one rank that the
        planner picks)."""
        return list(range(world_size))

    # ---------------------------------------------------------------- routing
    @abstractmethod
    def router(self, table_plan: TablePlan) -> Router:
        """Routes one feature's ids to the shards of ``table_plan``."""

    # ---------------------------------------------------------------- cost
    @abstractmethod
    def buffer_bytes(self, shard: Shard, table: TableSpec, ids: float, batch_size: int) -> int:
        """All-to-all buffer bytes ``shard`` puts on its rank for a global batch of
        ``batch_size``, ``ids`` being the table's ids per sample."""

    @abstractmethod
    def lookup_floats(self, shard: Shard, table: TableSpec, ids: float, world_size: int) -> float:
        """Floats ``shard`` reads per sample of the global batch."""

    # ---------------------------------------------------------------- description
    def describe_ranks(self, table_plan: TablePlan, world_size: int) -> str:
        """"3", "0-3", or "2,0,1": the shards' ranks in shard order."""
        ranks = [s.rank for s in table_plan.shards]
        if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
            return f"{ranks[0]}-{ranks[-1]}"
        return ",".join(map(str, ranks))

    def describe_shapes(self, table_plan: TablePlan) -> str:
        """Shard shapes: "2 of 100,000x64" / "2 of 66,667x64, 1 of 66,666x64"."""
        shapes = Counter(f"{s.rows:,}x{s.cols}" for s in table_plan.shards)
        return ", ".join(f"{n} of {shape}" for shape, n in shapes.items())

    # ---------------------------------------------------------------- ownership
    def first_copy(self, shard: Shard, table_plan: TablePlan) -> bool:
        """Whether ``shard`` holds the copy of its elements that a read takes.
        Model-parallel shards hold theirs alone."""
        return True

    # ---------------------------------------------------------------- checkpoint
    def per_row_state_whole(self) -> bool:
        """Whether a shard's per-row optimizer state is the whole table's (every
        column shard keeps all rows of it): saved once, read in full by each shard."""
        return self.splits_columns

    def saved_whole(self, shards: list[Shard]) -> bool:
        """Whether the table is saved as plain whole-table tensors (one block is all
        of it) rather than split into the blocks of its shards."""
        return len(shards) == 1


class ModelParallel(Strategy):
    """Shards that get their ids by all-to-all and send pooled pieces back."""

    model_parallel = True

    def buffer_bytes(self, shard: Shard, table: TableSpec, ids: float, batch_size: int) -> int:
        """Per sample of the global batch the shard receives its ids (8 bytes each;
        its share of them taken as its share of the rows) and sends its pooled
        vectors and receives their gradients (features x cols floats, twice)."""
        shard_ids = ids * shard.rows / table.rows
        per_sample = shard_ids * 8 + len(table.features) * shard.cols * 4 * 2
        return math.ceil(batch_size * per_sample)

    def lookup_floats(self, shard: Shard, table: TableSpec, ids: float, world_size: int) -> float:
        """ids x share of the rows x cols."""
        return ids * shard.rows / table.rows * shard.cols
