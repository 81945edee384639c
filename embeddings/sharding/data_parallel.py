"""Data-parallel (replicated) tables: a full copy on every rank, local lookups, and
KV gradients exchanged so that every copy takes the same step.

    rank 0: KV (ids₀, rows₀) ─┐  all-gather (sizes, then padded ids and rows)
    rank 1: KV (ids₁, rows₁) ─┴─► every rank: coalesce(ids₀ ∪ ids₁) ─► same update

Only touched rows travel: never a dense table-sized all-reduce.

    every rank ┌────────┐  one full copy each; ids never leave the rank, and
               │  all   │  each rank looks up only its slice of the batch
               └────────┘
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from embeddings.alltoall import comm_device, world
from embeddings.collection import LocalEmbeddingCollection
from embeddings.kv import KVGradient
from embeddings.plan.types import Shard, ShardingType, TablePlan
from embeddings.sharding.base import Router, Strategy, whole_shard
from embeddings.table import TableSpec
from embeddings.timing import section


def allgather_kv(grad: KVGradient, group: dist.ProcessGroup | None = None) -> KVGradient:
    """Every rank's KV gradient of one table, coalesced; identical on all ranks."""
    _, size = world(group)
    if size == 1:
        return grad
    device = comm_device(group)  # NCCL takes GPU tensors only, counts included
    count = torch.tensor([len(grad)], dtype=torch.int64, device=device)
    counts = [torch.zeros_like(count) for _ in range(size)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c) for c in counts]
    longest = max(sizes)
    ids = torch.zeros(longest, dtype=torch.int64, device=device)
    rows = torch.zeros(longest, grad.dim, dtype=grad.rows.dtype, device=device)
    ids[: len(grad)] = grad.ids
    rows[: len(grad)] = grad.rows
    all_ids = [torch.empty_like(ids) for _ in range(size)]
    all_rows = [torch.empty_like(rows) for _ in range(size)]
    dist.all_gather(all_ids, ids, group=group)
    dist.all_gather(all_rows, rows, group=group)
    home = grad.rows.device
    return KVGradient.from_lookups(
        torch.cat([i[:n] for i, n in zip(all_ids, sizes)]).to(home),
        torch.cat([r[:n] for r, n in zip(all_rows, sizes)]).to(home),
    )


class ReplicatedTables(torch.nn.Module):
    """Replicated tables: lookups stay local; ``step`` syncs KV gradients, then updates."""

    def __init__(self, store: LocalEmbeddingCollection, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        if store.fused:
            raise ValueError("replicated tables apply after the KV all-gather, not in backward")
        self.store = store
        self.group = group

    def step(self) -> None:
        local = self.store.take_gradient()
        with section("embedding_update"):
            synced = allgather_kv(local, self.group)
        self.store.apply_gradient(synced)


class DataParallel(Strategy):
    """A full copy of the table on every one of ``ranks``; no all-to-all."""

    type = ShardingType.DATA_PARALLEL
    model_parallel = False

    def shards(self, table: TableSpec, ranks: list[int]) -> list[Shard]:
        return [whole_shard(table, r) for r in ranks]

    def can_spread(self, table: TableSpec, n: int) -> bool:
        return True

    def router(self, table_plan: TablePlan) -> Router:
        raise ValueError(f"{table_plan.table}: {self.type.value} tables are not routed")

    def buffer_bytes(self, shard: Shard, table: TableSpec, ids: float, batch_size: int) -> int:
        """Nothing: the ids stay on their rank (KV gradients are not counted)."""
        return 0

    def lookup_floats(self, shard: Shard, table: TableSpec, ids: float, world_size: int) -> float:
        """ids x dim / W: a copy looks up only its rank's slice of the batch."""
        return ids * table.dim / world_size

    def describe_ranks(self, table_plan: TablePlan, world_size: int) -> str:
        """"all" for a copy on every rank."""
        if sorted(s.rank for s in table_plan.shards) == list(range(world_size)):
            return "all"
        return super().describe_ranks(table_plan, world_size)

    def describe_shapes(self, table_plan: TablePlan) -> str:
        """"200,000x64 on each"."""
        s = table_plan.shards[0]
        return f"{s.rows:,}x{s.cols} on each"

    def first_copy(self, shard: Shard, table_plan: TablePlan) -> bool:
        """Reads take the first copy; writes go to every copy."""
        return shard.rank == table_plan.shards[0].rank

    def saved_whole(self, shards: list[Shard]) -> bool:
        """Every copy is the whole table: saved once, read by every holder."""
        return True
