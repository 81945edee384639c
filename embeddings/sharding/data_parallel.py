"""Data-parallel (replicated) tables: a full copy on every rank, local lookups, and
KV gradients exchanged so that every copy takes the same step.

    rank 0: KV (ids₀, rows₀) ─┐  all-gather (sizes, then padded ids and rows)
    rank 1: KV (ids₁, rows₁) ─┴─► every rank: coalesce(ids₀ ∪ ids₁) ─► same update

Only touched rows travel: never a dense table-sized all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from embeddings.alltoall import world
from embeddings.collection import LocalEmbeddingCollection
from embeddings.kv import KVGradient
from embeddings.timing import section


def allgather_kv(grad: KVGradient, group: dist.ProcessGroup | None = None) -> KVGradient:
    """Every rank's KV gradient of one table, coalesced; identical on all ranks."""
    _, size = world(group)
    if size == 1:
        return grad
    count = torch.tensor([len(grad)], dtype=torch.int64)
    counts = [torch.zeros_like(count) for _ in range(size)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c) for c in counts]
    longest = max(sizes)
    ids = torch.zeros(longest, dtype=torch.int64)
    rows = grad.rows.new_zeros(longest, grad.dim)
    ids[: len(grad)] = grad.ids
    rows[: len(grad)] = grad.rows
    all_ids = [torch.empty_like(ids) for _ in range(size)]
    all_rows = [torch.empty_like(rows) for _ in range(size)]
    dist.all_gather(all_ids, ids, group=group)
    dist.all_gather(all_rows, rows, group=group)
    return KVGradient.from_lookups(
        torch.cat([i[:n] for i, n in zip(all_ids, sizes)]),
        torch.cat([r[:n] for r, n in zip(all_rows, sizes)]),
    )


class ReplicatedTables(torch.nn.Module):
    """Replicated tables: lookups stay local; ``step`` syncs KV gradients, then updates."""

    def __init__(self, store: LocalEmbeddingCollection, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        if store.fused:
            raise ValueError("replicated tables apply after the KV all-gather, not in backward")
        self.store = store
        self.group = group
        self.bytes_sent = 0  # KV bytes this rank contributed, for tests and logs

    def step(self) -> None:
        local = self.store.take_gradient()
        self.bytes_sent += local.ids.numel() * 8 + local.rows.numel() * local.rows.element_size()
        with section("embedding_update"):
            synced = allgather_kv(local, self.group)
        self.store.apply_gradient(synced)
