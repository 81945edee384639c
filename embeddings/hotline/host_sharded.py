"""The host tier of several ranks: a ``ShardedEmbeddingCollection`` over the ranks'
host memory (cold rows sharded by the plan), with the hot tier replicated:

    rank r:  hot ids ──► hot_weight (replica) ──────────────────────► Σ hot part ─┐
             cold ids ──ids all-to-all──► owners' host shards ──pooled all-to-all─┴► pooled
    step():  the hot tier all-gathers its gradients (every replica takes the same
             update; its own group, hot_tier.py); the host tier applies its shards'
             kept gradients (sharded step)

The host side pools by sum: a mean divides by the WHOLE bag's length, hot and cold
lookups together, after they are added up. Hot rows are read from their owners
by one all-reduce and written back locally (see ``sharded_rows.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import TYPE_CHECKING

import torch

from data.jagged import JaggedFeatures
from embeddings.hotline.hot_tier import HotTier
from embeddings.hotline.lookups import ColdPooled, ColdRows
from embeddings.hotline.sharded_rows import read_rows, write_rows
from embeddings.hotline.split import MicroLookups
from embeddings.kv import KVGradient
from embeddings.optim import SparseOptimizer
from embeddings.sharded import ShardedEmbeddingCollection
from embeddings.table import Pooling, TableSpec

if TYPE_CHECKING:
    import torch.distributed as dist

    from embeddings.plan.types import ShardingPlan


class ShardedHostTier:
    """``HostTier`` of several ranks (see host_tier.py); gradients are always kept."""

    collective = True
    gather_threads = 1  # a cold lookup is the owners' lookups, one collective

    def __init__(
        self,
        tables: list[TableSpec],
        plan: ShardingPlan,
        optimizer: SparseOptimizer,
        seed: int | None,
        group: dist.ProcessGroup | None,
        device: torch.device | str,
        rounding_seed: int | None = None,
    ) -> None:
        summed = [dataclasses.replace(t, pooling=Pooling.SUM) for t in tables]
        self.collection = ShardedEmbeddingCollection(
            summed, plan, lambda: copy.deepcopy(optimizer), fused=False, seed=seed,
            group=group, device=device, rounding_seed=rounding_seed,
        )
        self.plan = plan
        self.group = group
        self.device = torch.device(device)
        self.optimizer = optimizer
        self.features = [f for t in tables for f in t.features]
        self.mean = tables[0].pooling is Pooling.MEAN
        self.row_offsets: dict[str, int] = {}
        total = 0
        for t in tables:
            self.row_offsets[t.name] = total
            total += t.rows

    # ------------------------------------------------------------------ hot rows
    def read_rows(
        self, stacked_ids: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        fresh = self.optimizer.init_state(stacked_ids.numel(), self.collection.dim, torch.device("cpu"))
        weight = read_rows(self.collection, self.row_offsets, stacked_ids.cpu(), fresh,
                           self.optimizer.per_row_state())
        return weight.to(device), {name: tensor.to(device) for name, tensor in fresh.items()}

    def write_rows(
        self, stacked_ids: torch.Tensor, weight: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> None:
        write_rows(self.collection, self.row_offsets, stacked_ids, weight, state,
                   self.optimizer.per_row_state())

    def write_rows_later(
        self, stacked_ids: torch.Tensor, weight: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> None:
        """No update queue here (the cold updates run in the step): written now."""
        self.write_rows(stacked_ids, weight, state)

    # ------------------------------------------------------------------ cold bags
    def gather_cold(self, micro: MicroLookups, device: torch.device) -> ColdPooled:
        """The cold part of every bag, looked up by the owners of its rows (a
        collective: every rank calls it once per micro-batch, an empty one too)."""
        t0 = time.perf_counter()
        cold = JaggedFeatures(self.features, micro.cold_values.to(self.device),
                              micro.cold_lengths.to(self.device), micro.batch)
        pooled = self.collection(cold)
        t1 = time.perf_counter()
        pooled = pooled.to(device, non_blocking=True)
        return ColdPooled(pooled, t1 - t0, time.perf_counter() - t1)

    def hot_part(self, micro: MicroLookups, hot: HotTier) -> torch.Tensor:
        """Σ hot part per bag (the local replica), [F*B, D]; mean pooling divides after
        the cold part is added (``pool``)."""
        return hot.lookup(micro.hot_slots, micro.hot_lengths, micro.num_features)

    def pool(
        self, micro: MicroLookups, hot: HotTier, cold: ColdRows | ColdPooled | None,
        hot_part: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, int]:
        """Σ hot part (local replica) + Σ cold part (sharded), [B, F*D]; cold lookups.
        ``cold`` None: a popular micro-batch (every lookup hot, no collective);
        ``hot_part``: made already (``hot_part``)."""
        batch, features, dim = micro.batch, micro.num_features, self.collection.dim
        if hot_part is None:
            hot_part = self.hot_part(micro, hot)
        pooled = hot_part.view(features, batch, dim).transpose(0, 1)  # [B, F, D]
        if cold is not None:
            assert isinstance(cold, ColdPooled)
            pooled = pooled + cold.pooled.view(batch, features, dim)
        if self.mean:
            whole = micro.lengths.view(features, batch).t().clamp(min=1).to(pooled.dtype)
            pooled = pooled / whole.unsqueeze(2)
        return pooled.reshape(batch, features * dim), micro.cold_local.numel()

    # ------------------------------------------------------------------ updates
    def has_kept(self) -> bool:
        return False  # cold gradients are kept in the shards' stores

    def kv_gradients(self, hot: list[KVGradient]) -> dict[str, KVGradient]:
        raise RuntimeError("kv_gradients of a multi-rank Hotline collection: the cold "
                           "part lives in the host tier's shards (host.kv_gradients())")

    def set_lr(self, lr: float) -> None:
        self.collection.set_lr(lr)

    def step(self) -> None:
        self.collection.step()
