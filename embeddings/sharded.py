"""Hybrid-parallel embeddings: tables sharded across ranks, met by all-to-all.

One forward on rank r (local batch B_r), for model-parallel (TW/CW/RW) shards:

    local ids ──route──► per destination d: [lengths of d's slots | their ids]
        │  (0) all-to-all of counts: (B_r, #ids) to every d
        │  (1) all-to-all of ids         ──►  on d: bags of every source, reordered
        │                                     slot-major: (slot, source, sample)
        │                                     one pooled lookup per shard width
        │  (2) all-to-all of pooled  ◄──      per source s: [slot blocks of B_s rows]
        ▼
    per feature: combine its shards' pieces (TW: as is, CW: cat, RW: sum)
    replicated (DP) features: local lookup
    ──► pooled [B_r, F*D] in feature order

A "slot" is (feature, shard): the ids of one feature for one shard of its table.
Backward retraces (2) as a reverse all-to-all (autograd), then each shard's
lookup turns pooled gradients into KV gradients on the rank that owns the rows.
Replicated tables all-gather their KV gradients in ``step``.

Row-wise Adagrad keeps one state value per row, the mean of g² over the whole
row; column shards of a table all see the same ids, so in ``step`` they
all-gather per-row partial sums of g² (keyed by table and row) to stay exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from embeddings.alltoall import (
    Pending,
    alltoall_counts,
    alltoall_ids,
    alltoall_pooled,
    world,
)
from embeddings.collection import EmbeddingCollection, LocalEmbeddingCollection
from embeddings.interface import TableState
from embeddings.jagged import in_feature_order, permute_bags
from embeddings.kv import KVGradient
from embeddings.optim import RowWiseAdagrad, SparseOptimizer
from embeddings.plan.types import Shard, ShardingPlan
from embeddings.pooled_layout import Placement, pack_by_source, unpack_pooled
from embeddings.sharding.data_parallel import ReplicatedTables, allgather_kv
from embeddings.sharding.registry import strategy
from embeddings.table import Pooling, TableSpec
from embeddings.timing import section

if TYPE_CHECKING:
    from data.jagged import KeyedJagged

ROW_KEY_BITS = 40  # (table index << 40) | row: one key space for all tables


@dataclass
class Started:
    """A batch between :meth:`ShardedEmbeddingCollection.start` and ``finish``."""

    batch: int
    lengths: torch.Tensor
    ids_of: dict[str, torch.Tensor]
    lengths_of: dict[str, torch.Tensor]
    src_batch: list[int] = field(default_factory=list)  # B of every source rank
    recv_splits: list[int] = field(default_factory=list)
    ids: Pending | None = None  # the ids all-to-all in flight


@dataclass(frozen=True)
class Slot:
    feature: str
    piece: int  # index of the shard among its table's shards (router order)
    shard: Shard


def shard_name(shard: Shard) -> str:
    return f"{shard.table}/rows{shard.row_start}/cols{shard.col_start}"


class ShardedEmbeddingCollection(EmbeddingCollection):
    def __init__(
        self,
        tables: list[TableSpec],
        plan: ShardingPlan,
        make_optimizer: Callable[[], SparseOptimizer],
        fused: bool = True,
        seed: int | None = 0,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        rounding_seed: int | None = None,
        kernels: str = "auto",
    ) -> None:
        """``rounding_seed`` (default ``seed``): of fp16/bf16 tables' stochastic rounding."""
        super().__init__()
        self.rounding_seed = (seed or 0) if rounding_seed is None else rounding_seed
        self.kernels = kernels  # every store's lookup path (embeddings/kernels)
        self.rank, self.world_size = world(group)
        if plan.world_size != self.world_size:
            raise ValueError(f"plan is for {plan.world_size} ranks, running on {self.world_size}")
        dims = {t.dim for t in tables}
        if len(dims) != 1:
            raise ValueError(f"one collection needs one embedding dim, got {sorted(dims)}")
        self.dim = dims.pop()
        self.group = group
        self.tables = list(tables)
        self.plan = plan
        self.mean = tables[0].pooling is Pooling.MEAN
        self.features = [f for t in tables for f in t.features]
        self.grad_scale = 1.0  # several ranks: 1/W (see dlrm/parallel/ddp.py)
        self.table_index = {t.name: i for i, t in enumerate(tables)}
        self._dtype_of = {t.name: t.dtype for t in tables}
        make_optimizer = _rounding_everywhere(make_optimizer, tables)
        self._table_of = {f: t.name for t in tables for f in t.features}
        self.strategies = {name: strategy(tp.sharding) for name, tp in plan.tables.items()}
        self.routers = {
            name: how.router(plan.tables[name]) for name, how in self.strategies.items()
            if how.model_parallel
        }
        self.slots_on = self._slots_on_ranks()
        self.mp_features = [f for f in self.features if f in {s.feature for sl in self.slots_on for s in sl}]
        # the optimizer's rule and state layout, for a rank that may hold no store at all
        # (more ranks than table-wise tables): its checkpoint still lists every key
        self._optimizer = make_optimizer()
        column_rowwise = isinstance(self._optimizer, RowWiseAdagrad)
        self.column_rowwise = column_rowwise and any(
            how.splits_columns for how in self.strategies.values()
        )
        self.stores = torch.nn.ModuleList()
        self.store_slots: list[list[Slot]] = []
        self._build_stores(make_optimizer, fused, seed, device, defer_column_shards=column_rowwise)
        self._shards_by_name = {shard_name(s.shard): s.shard for s in self.slots_on[self.rank]}
        self._device = torch.device(device)
        self._no_shards: torch.Tensor | None = None  # the anchor of a rank holding no shard

        # ---- replicated tables: a full local copy (one stack per dtype), KV all-gather in step()
        dp_tables = [t for t in tables if not self.strategies[t.name].model_parallel]
        self.dp_features = [f for t in dp_tables for f in t.features]
        self.replicas = torch.nn.ModuleList(
            ReplicatedTables(
                LocalEmbeddingCollection([t for t in dp_tables if t.dtype == dtype], make_optimizer(), fused=False,
                                         seed=seed, device=device, rounding_seed=self.rounding_seed,
                                         kernels=kernels),
                group,
            )
            for dtype in dict.fromkeys(t.dtype for t in dp_tables)
        )

    def _slots_on_ranks(self) -> list[list[Slot]]:
        """Every rank's model-parallel slots, the same lists on every rank: grouped
        by store (width, dtype), then in table and feature order."""
        feature_index = {f: i for i, f in enumerate(self.features)}
        slots_on: list[list[Slot]] = [[] for _ in range(self.world_size)]
        for t in self.tables:
            if not self.strategies[t.name].model_parallel:
                continue
            for piece, shard in enumerate(self.plan.tables[t.name].shards):
                for f in t.features:
                    slots_on[shard.rank].append(Slot(f, piece, shard))
        for slots in slots_on:
            slots.sort(key=lambda s: (*self._store_key(s), self.table_index[s.shard.table], feature_index[s.feature]))
        return slots_on

    def _build_stores(
        self,
        make_optimizer: Callable[[], SparseOptimizer],
        fused: bool,
        seed: int | None,
        device: torch.device | str,
        defer_column_shards: bool,
    ) -> None:
        """This rank's shards: one stacked store per (width, dtype): a stack holds one
        type, so tables of several ``embeddings.dtypes`` are stacked apart. With
        ``defer_column_shards`` (row-wise Adagrad) a store holding a column shard
        applies after the partial-sum exchange in step(), not inside backward."""
        mine = self.slots_on[self.rank]
        for key in sorted({self._store_key(s) for s in mine}):
            slots = [s for s in mine if self._store_key(s) == key]
            shards = list(dict.fromkeys(s.shard for s in slots))
            specs = [
                TableSpec(shard_name(sh), rows=sh.rows, dim=sh.cols, pooling=Pooling.SUM, dtype=key[1],
                          features=tuple(f"{s.feature}@{shard_name(sh)}" for s in slots if s.shard == sh))
                for sh in shards
            ]
            has_cw = any(self.strategies[sh.table].splits_columns for sh in shards)
            store = LocalEmbeddingCollection(
                specs, make_optimizer(), fused=fused and not (defer_column_shards and has_cw), seed=seed,
                device=device,
                table_origin={shard_name(sh): (sh.table, plan_rows(self.plan, sh), sh.row_start, sh.col_start)
                              for sh in shards},
                init_dim={shard_name(sh): self.dim for sh in shards}, kernels=self.kernels,
                rounding_seed=self.rounding_seed,
            )
            self.stores.append(store)
            self.store_slots.append(slots)

    def _store_key(self, slot: Slot) -> tuple[int, str]:
        """(width, dtype): the store a slot's shard is stacked in."""
        return slot.shard.cols, self._dtype_of[slot.shard.table]

    # ------------------------------------------------------------------ forward
    def forward(self, sparse: KeyedJagged) -> torch.Tensor:
        return self.finish(self.start(sparse))

    def start(self, sparse: KeyedJagged) -> Started:
        """Route ids and start sending them (asynchronously): the caller may run the
        bottom MLP meanwhile, then call :meth:`finish`."""
        values, lengths, batch = in_feature_order(sparse, self.features)
        lengths2d = lengths.view(len(self.features), batch)
        per_feature = lengths2d.sum(dim=1).tolist()
        started = Started(batch, lengths, dict(zip(self.features, values.split(per_feature))),
                          dict(zip(self.features, lengths2d.unbind(0))))
        if self.mp_features:
            with section("input_alltoall"):
                self._send_ids(started)
        return started

    def finish(self, started: Started) -> torch.Tensor:
        """Pooled [B, F*D] of a :meth:`start`-ed batch."""
        batch, lengths_of = started.batch, started.lengths_of
        column_of = {f: i * self.dim for i, f in enumerate(self.features)}
        sources: list[torch.Tensor] = []
        placements: list[Placement] = []
        divisors: list[tuple[int, int, torch.Tensor]] = []
        if self.mp_features:
            sources.append(self._model_parallel(started))
            placements += self._received_placements(batch, column_of)
            if self.mean:  # over the whole bag, after the pieces are combined
                divisors = [(column_of[f], self.dim, lengths_of[f].clamp(min=1)) for f in self.mp_features]
        for replica in self.replicas:
            features = replica.store.features
            dp_lengths = (torch.cat([lengths_of[f] for f in features]) if batch
                          else started.lengths[:0])
            dp_values = torch.cat([started.ids_of[f] for f in features])
            dp_pooled = replica.store.lookup(dp_values, dp_lengths, batch)  # [n, B, D]
            sources.append(dp_pooled.contiguous())
            placements += [Placement(len(sources) - 1, i * batch * self.dim, column_of[f], self.dim, False)
                           for i, f in enumerate(features)]
        out = unpack_pooled(sources, placements, batch, len(self.features) * self.dim, divisors)
        return scale_grad(out, self.grad_scale)

    def _received_placements(self, batch: int, column_of: dict[str, int]) -> list[Placement]:
        """Where each block of the received buffer goes: owner by owner, slot by slot,
        [B, cols] each; a feature's pieces side by side, or added (row-wise), in
        piece order."""
        block_of: dict[tuple[str, int], tuple[int, int]] = {}
        offset = 0
        for d in range(self.world_size):
            for s in self.slots_on[d]:
                block_of[s.feature, s.piece] = (offset, s.shard.cols)
                offset += batch * s.shard.cols
        placements = []
        for f in self.mp_features:
            table = self._table_of[f]
            adds = self.routers[table].accumulates
            column = column_of[f]
            for piece in range(len(self.plan.tables[table].shards)):
                start, cols = block_of[f, piece]
                placements.append(Placement(0, start, column, cols, add=adds and piece > 0))
                if not adds:
                    column += cols
        return placements

    def _send_ids(self, started: Started) -> None:
        W, batch = self.world_size, started.batch
        routed = {
            f: self.routers[self._table_of[f]].route(started.ids_of[f], started.lengths_of[f])
            for f in self.mp_features
        }
        # (0) + (1): ids to the shard owners, [lengths of d's slots | ids] per destination d
        parts, counts = [], torch.zeros(W, 2, dtype=torch.int64)
        for d in range(W):
            ls = [routed[s.feature][s.piece][0] for s in self.slots_on[d]]
            vs = [routed[s.feature][s.piece][1] for s in self.slots_on[d]]
            part = torch.cat(ls + vs) if ls else started.lengths.new_zeros(0)
            counts[d, 0] = batch
            counts[d, 1] = sum(int(v.numel()) for v in vs)
            parts.append(part)
        recv_counts = alltoall_counts(counts, self.group)
        started.src_batch = recv_counts[:, 0].tolist()
        n = len(self.slots_on[self.rank])
        started.recv_splits = [
            n * b + int(c) for b, c in zip(started.src_batch, recv_counts[:, 1].tolist())
        ]
        started.ids = alltoall_ids(
            torch.cat(parts), [int(p.numel()) for p in parts], started.recv_splits, self.group
        )

    def _model_parallel(self, started: Started) -> torch.Tensor:
        """Look up this rank's shards for every source; the received pooled blocks (flat)."""
        W, batch = self.world_size, started.batch
        src_batch, recv_splits = started.src_batch, started.recv_splits
        n = len(self.slots_on[self.rank])
        recv = started.ids.wait()

        # On this rank as shard owner: bags of all sources, reordered slot-major.
        chunks = recv.split(recv_splits)
        src_lengths = torch.cat([c[: n * b] for c, b in zip(chunks, src_batch)])
        src_values = torch.cat([c[n * b :] for c, b in zip(chunks, src_batch)])
        total = sum(src_batch)
        bases = [0]
        for b in src_batch[:-1]:
            bases.append(bases[-1] + n * b)
        order = torch.cat(
            [torch.arange(n * b, device=recv.device).view(n, b) + base
             for b, base in zip(src_batch, bases)], dim=1
        ).flatten()
        lengths_sm, values_sm = permute_bags(src_lengths, src_values, order)

        first_slot, first_value = 0, 0
        per_store = []
        lengths_by_slot = lengths_sm.view(n, total) if n else lengths_sm.view(0, total)
        for store, slots in zip(self.stores, self.store_slots):
            k = len(slots)
            store_lengths = lengths_by_slot[first_slot : first_slot + k].reshape(-1)
            count = int(store_lengths.sum())
            store_values = values_sm[first_value : first_value + count]
            per_store.append(store.lookup(store_values, store_lengths, total))  # [k, total, w]
            first_slot += k
            first_value += count
        # (2): pooled pieces back to the sources, B_s rows of every slot each.
        send_splits = [
            sum(p.shape[0] * b * p.shape[2] for p in per_store) for b in src_batch
        ]
        recv_splits_f = [sum(batch * s.shard.cols for s in self.slots_on[d]) for d in range(W)]
        send_buffer = (pack_by_source(per_store, src_batch) if per_store
                       else torch.zeros(0, device=recv.device))
        if not send_buffer.requires_grad:
            # Every rank must take part in the backward all-to-all, even with nothing to send.
            send_buffer = send_buffer + self._anchor()
        return alltoall_pooled(send_buffer, send_splits, recv_splits_f, self.group)

    def _anchor(self) -> torch.Tensor:
        """A zero that carries autograd: any store's weight, or the replicated one's."""
        holders = self._all_stores()
        if holders:
            return holders[0].weight.sum() * 0.0
        # A rank holding no shard of these tables (Hotline's dtype groups: a group's
        # table-wise tables may all live elsewhere) still joins the backward all-to-all.
        if self._no_shards is None:
            self._no_shards = torch.zeros((), device=self._device, requires_grad=True)
        return self._no_shards * 0.0

    # ------------------------------------------------------------------ updates
    def set_lr(self, lr: float) -> None:
        for store in self.stores:
            store.set_lr(lr)
        for replica in self.replicas:
            replica.store.set_lr(lr)

    def step(self) -> None:
        kept = [None if store.fused else store.take_gradient() for store in self.stores]
        with section("embedding_update"):
            synced = self._column_row_sums(kept) if self.column_rowwise else None
        for store, slots, grad in zip(self.stores, self.store_slots, kept):
            if grad is None:
                continue
            store.apply_gradient(grad, self._row_sq_mean(store, grad, synced))
        for replica in self.replicas:
            replica.step()

    def _column_row_sums(self, kept: list[KVGradient | None]) -> KVGradient:
        """All-gather per-row partial sums of g² of column shards, keyed (table, row)."""
        device = self._device  # the empty start must sit where the grads are (a rank may hold no store)
        keys = [torch.zeros(0, dtype=torch.int64, device=device)]
        sums = [torch.zeros(0, 1, device=device)]
        for store, grad in zip(self.stores, kept):
            if grad is None:
                continue
            for spec in store.tables:
                shard = self._shard_of(spec.name)
                if not self.strategies[shard.table].splits_columns:
                    continue
                start = store.row_offsets[spec.name]
                part = grad.slice_rows(start, start + spec.rows)
                keys.append((self.table_index[shard.table] << ROW_KEY_BITS) + part.ids + shard.row_start)
                sums.append(part.rows.square().sum(dim=1, keepdim=True))
        local = KVGradient.from_lookups(torch.cat(keys), torch.cat(sums))
        return allgather_kv(local, self.group)

    def _row_sq_mean(
        self, store: LocalEmbeddingCollection, grad: KVGradient, synced: KVGradient | None
    ) -> torch.Tensor | None:
        if synced is None:
            return None
        row_sq = grad.rows.square().mean(dim=1)
        for spec in store.tables:
            shard = self._shard_of(spec.name)
            if not self.strategies[shard.table].splits_columns:
                continue
            start = store.row_offsets[spec.name]
            lo = int(torch.searchsorted(grad.ids, start))
            hi = int(torch.searchsorted(grad.ids, start + spec.rows))
            wanted = (self.table_index[shard.table] << ROW_KEY_BITS) + grad.ids[lo:hi] - start + shard.row_start
            where = torch.searchsorted(synced.ids, wanted)
            row_sq[lo:hi] = synced.rows[where, 0] / self.dim
        return row_sq

    def _all_stores(self) -> list[LocalEmbeddingCollection]:
        """Every stack on this rank: the model-parallel stores, then the replicas."""
        return list(self.stores) + [replica.store for replica in self.replicas]

    def _shard_of(self, name: str) -> Shard:
        return self._shards_by_name[name]

    def kv_gradients(self) -> dict[str, KVGradient]:
        out: dict[str, KVGradient] = {}
        for store in self.stores:
            out.update(store.kv_gradients())
        for replica in self.replicas:
            out.update(replica.store.kv_gradients())
        return out

    # ------------------------------------------------------------------ state
    def local_shards(self) -> list[tuple[Shard, dict[str, torch.Tensor]]]:
        """(shard, {"weight": .., optimizer state: ..}) for every shard on this rank;
        replicated tables count as full-table shards."""
        out = []
        for store in self.stores:
            tensors = store.export_tables()
            for spec in store.tables:
                prefix = f"{spec.name}."
                out.append((self._shard_of(spec.name),
                            {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}))
        for replica in self.replicas:
            tensors = replica.store.export_tables()
            for t in replica.store.tables:
                shard = next(s for s in self.plan.tables[t.name].shards if s.rank == self.rank)
                prefix = f"{t.name}."
                out.append((shard, {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}))
        return out

    def export_tables(self) -> dict[str, torch.Tensor]:
        return {
            f"{shard_name(shard)}.{key}": tensor
            for shard, tensors in self.local_shards()
            for key, tensor in tensors.items()
        }

    def import_tables(self, tensors: dict[str, torch.Tensor]) -> None:
        for shard, mine in self.local_shards():
            for key, dst in mine.items():
                src = tensors[f"{shard_name(shard)}.{key}"]
                if src.shape != dst.shape:
                    raise ValueError(f"{shard_name(shard)}.{key}: shape {tuple(src.shape)} != {tuple(dst.shape)}")
                with torch.no_grad():
                    dst.copy_(src)

    def table_state(self) -> TableState:
        """This rank's shards (replicated tables: its full copy) as live tensors."""
        sharding = {name: (tp.sharding, tp.shards) for name, tp in self.plan.tables.items()}
        return TableState(self.tables, self.local_shards(), sharding, self._optimizer,
                          plan=self.plan, group=self.group)


def _rounding_everywhere(make: Callable[[], SparseOptimizer], tables: list[TableSpec]
                        ) -> Callable[[], SparseOptimizer]:
    """Where any table is fp16/bf16, every store keeps the rounding step (fp32 stores
    too): a rank's stores then hold the same state, checkpointed as one counter."""
    if all(t.dtype == "fp32" for t in tables):
        return make

    def with_rounding() -> SparseOptimizer:
        optimizer = make()
        optimizer.rounding = True
        return optimizer

    return with_rounding


def plan_rows(plan: ShardingPlan, shard: Shard) -> int:
    """Row count of the full table the shard belongs to."""
    return max(s.row_end for s in plan.tables[shard.table].shards)


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` in forward; its gradient times ``scale`` in backward (see dlrm/parallel/ddp.py)."""
    return _ScaleGrad.apply(x, scale) if scale != 1.0 else x


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx, x, scale):  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad * ctx.scale, None


def gather_tables(collection: ShardedEmbeddingCollection) -> dict[str, torch.Tensor]:
    """Whole tables (``{table}.weight`` and optimizer state) assembled from all
    ranks' shards, on every rank. For tests and small exports: it holds every
    table in memory at once; checkpoints write shards instead."""
    local = [(shard, {k: v.detach().cpu() for k, v in t.items()}) for shard, t in collection.local_shards()]
    if collection.world_size > 1:
        everything: list = [None] * collection.world_size
        dist.all_gather_object(everything, local, group=collection.group)
    else:
        everything = [local]
    rows = {t.name: t.rows for t in collection.tables}
    out: dict[str, torch.Tensor] = {}
    for shards in everything:
        for shard, tensors in shards:
            for key, tensor in tensors.items():
                name = f"{shard.table}.{key}"
                if tensor.dim() == 0 or tensor.shape[0] != shard.rows:  # scalar state (Adam's step)
                    out[name] = tensor
                    continue
                if name not in out:
                    shape = (rows[shard.table], *((collection.dim,) if tensor.dim() == 2 else ()))
                    out[name] = torch.zeros(shape, dtype=tensor.dtype)
                if tensor.dim() == 2:
                    out[name][shard.row_start : shard.row_end, shard.col_start : shard.col_end] = tensor
                else:
                    out[name][shard.row_start : shard.row_end] = tensor
    return out
