"""Two-tier embeddings: hot rows on the device, every row in host memory.

    host memory (authoritative for COLD rows)     device (authoritative for HOT rows)
    ┌──────────────────────────────────────┐      ┌────────────────────────────┐
    │ stacked weight [sum(rows), D]        │      │ hot_weight [H, D]          │
    │ + optimizer state, per row           │ ───► │ + optimizer state [H, ..]  │
    │ (hot rows here are stale until       │ load │ hot_ids [H] stacked ids,   │
    │  sync_to_host / export / refresh)    │ ◄─── │ sorted: slot = searchsorted│
    └──────────────────────────────────────┘ sync └────────────────────────────┘

    forward(KJT):  stacked id ──searchsorted(hot_ids)──► hot?  ─yes─► slot ─► hot_weight
                                                            └─no──► unique cold ids
                   gather cold rows on host ──copy──► ColdRows [U, D] on device
                   pooled bag = Σ hot part + Σ cold part  (mean: ÷ FULL bag length)
    backward:      hot KVGradient (slots)  ──► device optimizer
                   cold KVGradient (stacked ids, moved to host) ──► host optimizer
                   (applied at once when fused, else kept until step())

Every row has one authoritative copy and one optimizer state. Scalar optimizer
state (Adam's step) exists in both tiers; both tiers apply exactly once per step
(an empty gradient still counts), so both counters equal the single-process one.

id → slot map: a searchsorted on the sorted hot ids, not a [sum(rows)] table of
slots: device memory then grows with the hot set only (8 B per hot row) instead of
8 B per row of every table, which is what Hotline exists to save; the cost is
log2(H) comparisons per lookup.

Several ranks (a ``plan`` is given): the host tier is a ``ShardedEmbeddingCollection``
(cold rows sharded across the ranks' host memory by the plan, reached by all-to-all)
and the hot tier is replicated, the same rows on every rank:

    rank r:  hot ids ──► hot_weight (replica) ──────────────────────► Σ hot part ─┐
             cold ids ──ids all-to-all──► owners' host shards ──pooled all-to-all─┴► pooled
    step():  hot KV gradients all-gathered (every replica takes the same update);
             the host tier applies its shards' kept gradients (sharded step)

Hot rows are read from their owners by one all-reduce and written back locally
(see ``sharded_rows.py``).

Popular/non-popular micro-batches: with ``fused=False``, forward + backward on
each micro-batch then one ``step()`` equals one step on the whole mini-batch
(kept gradients are summed per row before the optimizer sees them).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from embeddings.collection import EmbeddingCollection, LocalEmbeddingCollection, naming_oom
from embeddings.hotline.profile import HotProfile
from embeddings.hotline.sharded_rows import read_rows, write_rows
from embeddings.kv import KVGradient
from embeddings.lookup import pooled_lookup
from embeddings.optim import SparseOptimizer
from embeddings.sharded import ShardedEmbeddingCollection, scale_grad
from embeddings.sharding.data_parallel import allgather_kv
from embeddings.table import Pooling, TableSpec

if TYPE_CHECKING:
    import torch.distributed as dist
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from embeddings.plan import ShardingPlan

HOT_ONLY = "hot-only"  # ``cold`` of a popular micro-batch: no cold lookup at all (no collective)


@dataclass
class ColdRows:
    """Copies of the cold rows one batch needs, on the device.

    ids [U] stacked ids (host stack numbering), unique ascending, on the device;
    rows [U, D] on the device, a leaf that requires grad (its KV gradient goes home).
    """

    ids: torch.Tensor
    rows: torch.Tensor
    gather_s: float = 0.0  # host time to gather the rows
    transfer_s: float = 0.0  # time to copy them to the device (0 when it is the host)


@dataclass
class ColdPooled:
    """Several ranks: the cold part of every bag, summed, [B, F*D] on the device,
    looked up by the sharded host tier (with autograd back to its shards)."""

    pooled: torch.Tensor
    gather_s: float = 0.0  # ids all-to-all, owners' host lookups, pooled all-to-all
    transfer_s: float = 0.0


class HotlineEmbeddingCollection(EmbeddingCollection):
    """``LocalEmbeddingCollection`` semantics, with the profile's hot rows on ``device``.

    The host tier is a ``LocalEmbeddingCollection`` (one process) or, given a
    ``plan``, a ``ShardedEmbeddingCollection`` over ``group``; it is kept out of the
    module tree, so ``.to(device)`` moves the hot tier only.
    """

    def __init__(
        self,
        tables: list[TableSpec],
        profile: HotProfile,
        optimizer: SparseOptimizer,
        fused: bool = True,
        seed: int = 0,
        device: torch.device | str = "cpu",
        host: torch.device | str = "cpu",
        plan: ShardingPlan | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.sharded = plan is not None
        host_tier: LocalEmbeddingCollection | ShardedEmbeddingCollection
        if plan is not None:
            if fused:
                raise ValueError("Hotline on several ranks keeps gradients: hot ones are all-gathered")
            # Sum pooling on the host side: a mean divides by the WHOLE bag's length,
            # hot and cold lookups together, after they are added up.
            summed = [dataclasses.replace(t, pooling=Pooling.SUM) for t in tables]
            host_tier = ShardedEmbeddingCollection(
                summed, plan, lambda: copy.deepcopy(optimizer), fused=False, seed=seed,
                group=group, device=host,
            )
        else:
            host_tier = LocalEmbeddingCollection(tables, optimizer, fused=True, seed=seed, device=host)
        object.__setattr__(self, "host", host_tier)  # not a submodule, on purpose
        self.tables = list(tables)
        self.dim = host_tier.dim
        self.pooling = tables[0].pooling
        self.features = [f for t in tables for f in t.features]
        self.row_offsets: dict[str, int] = {}
        total = 0
        for t in tables:
            self.row_offsets[t.name] = total
            total += t.rows
        self.optimizer = optimizer
        self.fused = fused
        self.lr = 0.0
        self.grad_scale = 1.0  # several ranks: 1/W (see dlrm/parallel.py)
        table_of = {f: t.name for t in tables for f in t.features}
        offsets = torch.tensor([self.row_offsets[table_of[f]] for f in self.features], dtype=torch.int64)
        self.register_buffer("feature_offsets", offsets.to(device), persistent=False)
        if device.type == "cuda" and not self.sharded:
            _pin(host_tier)
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        probe = optimizer.init_state(2, self.dim, torch.device("cpu"))
        self._row_state = [n for n, t in probe.items() if t.shape[0] == 2]
        self._state_names = list(probe)
        self._hot_kept: list[KVGradient] = []
        self._cold_kept: list[KVGradient] = []
        self._last: tuple[torch.Tensor, int, torch.Tensor, int, torch.Tensor | int] | None = None
        self.profile = profile
        self._load_hot(self._stacked_hot_ids(profile), device)

    # ------------------------------------------------------------------ tiers
    host: LocalEmbeddingCollection | ShardedEmbeddingCollection

    @property
    def plan(self) -> ShardingPlan | None:
        """The host tier's sharding plan (several ranks), else None."""
        return self.host.plan if self.sharded else None

    @property
    def hot_state(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, f"hot_optim_{name}") for name in self._state_names}

    def _stacked_hot_ids(self, profile: HotProfile) -> torch.Tensor:
        parts = []
        for t in self.tables:
            ids = profile.hot.get(t.name, torch.zeros(0, dtype=torch.int64)).to(torch.int64).cpu()
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= t.rows):
                raise ValueError(f"hot profile: table {t.name!r} has row ids outside [0, {t.rows})")
            parts.append(torch.unique(ids) + self.row_offsets[t.name])
        return torch.cat(parts)

    def _load_hot(self, stacked_ids: torch.Tensor, device: torch.device) -> None:
        """Copy rows ``stacked_ids`` (sorted) and their state from host to the device
        (several ranks: a collective, every rank reads the same rows); out of memory
        is one line naming the hot tier."""
        rows = stacked_ids.numel()
        nbytes = rows * (self.dim * 4 + self.optimizer.state_bytes_per_row(self.dim))
        what = (f"the Hotline hot tier ({rows:,} rows x {self.dim} with "
                f"{type(self.optimizer).__name__} state; see hotline.budget)")
        with naming_oom(what, nbytes, device):
            self._copy_hot(stacked_ids, device)

    @torch.no_grad()
    def _copy_hot(self, stacked_ids: torch.Tensor, device: torch.device) -> None:
        self.register_buffer("hot_ids", stacked_ids.to(device), persistent=False)
        if self.sharded:
            fresh = self.optimizer.init_state(stacked_ids.numel(), self.dim, torch.device("cpu"))
            weight = read_rows(self.host, self.row_offsets, stacked_ids.cpu(), fresh, self._row_state)
            self.hot_weight = nn.Parameter(weight.to(device))
            for name, tensor in fresh.items():
                self.register_buffer(f"hot_optim_{name}", tensor.to(device))
            return
        host_ids = stacked_ids.to(self.host.weight.device)
        self.hot_weight = nn.Parameter(self.host.weight.data.index_select(0, host_ids).to(device))
        fresh = self.optimizer.init_state(stacked_ids.numel(), self.dim, device)
        for name, tensor in fresh.items():
            src = self.host.state[name]
            tensor.copy_(src.index_select(0, host_ids) if name in self._row_state else src)
            self.register_buffer(f"hot_optim_{name}", tensor)

    @torch.no_grad()
    def sync_to_host(self) -> None:
        """Write the hot rows and their optimizer state into the host tier (several
        ranks: each into the shards it owns; no communication)."""
        if self.sharded:
            write_rows(self.host, self.row_offsets, self.hot_ids, self.hot_weight.data, self.hot_state,
                       self._row_state)
            return
        host_ids = self.hot_ids.to(self.host.weight.device)
        self.host.weight.data.index_copy_(0, host_ids, self.hot_weight.data.to(host_ids.device))
        for name, tensor in self.hot_state.items():
            dst = self.host.state[name]
            if name in self._row_state:
                dst.index_copy_(0, host_ids, tensor.to(dst.device))
            else:
                dst.copy_(tensor)

    def refresh(self, profile: HotProfile) -> None:
        """Move to ``profile``'s hot set; parameters and optimizer state are unchanged."""
        if self._hot_kept or self._cold_kept:
            raise RuntimeError("refresh between steps only: kept gradients are pending")
        self.sync_to_host()
        self.profile = profile
        self._load_hot(self._stacked_hot_ids(profile), self.hot_weight.device)

    # ------------------------------------------------------------------ ids
    def _ids(self, sparse: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(stacked ids [N], lengths [F*B], B) in the collection's feature order."""
        ids, _, lengths, batch = self._ids_values(sparse)
        return ids, lengths, batch

    def _ids_values(
        self, sparse: KeyedJaggedTensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(stacked ids [N], table-local ids [N], lengths [F*B], B), feature order."""
        if sparse.keys() != self.features:
            sparse = sparse.permute([sparse.keys().index(f) for f in self.features])
        batch = sparse.stride()
        values, lengths = sparse.values(), sparse.lengths()
        per_feature = lengths.view(len(self.features), batch).sum(dim=1)
        offsets = self.feature_offsets.to(values.device)
        ids = values + torch.repeat_interleave(offsets, per_feature, output_size=values.numel())
        return ids, values, lengths, batch

    def _is_hot(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hot mask [N], slot [N]; slot is meaningless where not hot)."""
        hot_ids = self.hot_ids.to(ids.device)
        if hot_ids.numel() == 0:
            return torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids)
        slot = torch.searchsorted(hot_ids, ids).clamp_(max=hot_ids.numel() - 1)
        return hot_ids[slot] == ids, slot

    def split(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Popular mask [B] (bool): samples whose every lookup hits a hot row."""
        return self.classify(sparse)[0]

    def classify(self, sparse: KeyedJaggedTensor) -> tuple[torch.Tensor, float]:
        """(popular mask [B], share of the lookups that hit a hot row)."""
        ids, lengths, batch = self._ids(sparse)
        is_hot, _ = self._is_hot(ids)
        popular = self._cold_lengths(lengths, is_hot).view(len(self.features), batch).sum(dim=0) == 0
        return popular, float(is_hot.sum()) / max(ids.numel(), 1)

    @staticmethod
    def _cold_lengths(lengths: torch.Tensor, is_hot: torch.Tensor) -> torch.Tensor:
        bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        return torch.bincount(bag[~is_hot], minlength=lengths.numel())

    def gather_cold(self, sparse: KeyedJaggedTensor) -> ColdRows | ColdPooled:
        """What ``forward(sparse)`` needs from the host tier, on the device; a pipeline
        calls this ahead of ``forward``, after the previous step's update.

        One process: the unique cold rows (``ColdRows``). Several ranks: the cold
        part of every bag looked up by the sharded host tier (``ColdPooled``), a
        collective: every rank calls it once per micro-batch, an empty one too."""
        ids, values, lengths, batch = self._ids_values(sparse)
        is_hot, _ = self._is_hot(ids)
        if self.sharded:
            return self._cold_pooled(values[~is_hot], self._cold_lengths(lengths, is_hot), batch)
        return self._gather(ids[~is_hot])

    def _gather(self, cold_ids: torch.Tensor) -> ColdRows:
        device = self.hot_weight.device
        t0 = time.perf_counter()
        unique = torch.unique(cold_ids)
        source = self.host.weight.data
        host_ids = unique.to(source.device)
        if device.type == "cuda" and source.device.type == "cpu":
            rows = torch.empty(unique.numel(), self.dim, dtype=source.dtype, pin_memory=True)
            torch.index_select(source, 0, host_ids, out=rows)
            t1 = time.perf_counter()
            with torch.cuda.stream(self._copy_stream):  # a side stream: compute goes on
                rows = rows.to(device, non_blocking=True)
            self._copy_stream.synchronize()  # this (gather) thread waits, not the trainer
        else:
            rows = source.index_select(0, host_ids)
            t1 = time.perf_counter()
            rows = rows.to(device)
        t2 = time.perf_counter()
        return ColdRows(unique.to(device), rows.requires_grad_(True), t1 - t0, t2 - t1)

    def _cold_pooled(self, values: torch.Tensor, lengths: torch.Tensor, batch: int) -> ColdPooled:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        t0 = time.perf_counter()
        home = self.host.stores[0].weight.device if len(self.host.stores) else torch.device("cpu")
        kjt = KeyedJaggedTensor(keys=self.features, values=values.to(home), lengths=lengths.to(home),
                                stride=batch)
        pooled = self.host(kjt)
        t1 = time.perf_counter()
        pooled = pooled.to(self.hot_weight.device, non_blocking=True)
        return ColdPooled(pooled, t1 - t0, time.perf_counter() - t1)

    # ------------------------------------------------------------------ forward
    def forward(
        self, sparse: KeyedJaggedTensor, cold: ColdRows | ColdPooled | str | None = None
    ) -> torch.Tensor:
        """[B, F*D]; ``cold``: from ``gather_cold(sparse)``, else looked up here;
        ``HOT_ONLY`` for a popular micro-batch (no host tier, no collective)."""
        if self.sharded:
            return self._forward_sharded(sparse, cold)
        ids, lengths, batch = self._ids(sparse)
        is_hot, slot = self._is_hot(ids)
        scale = None
        if self.pooling is Pooling.MEAN:
            inv = 1.0 / lengths.clamp(min=1).to(self.hot_weight.dtype)
            scale = torch.repeat_interleave(inv, lengths, output_size=ids.numel())
        cold_lengths = self._cold_lengths(lengths, is_hot)
        hot_lengths = lengths - cold_lengths
        cold_ids = ids[~is_hot]
        if cold is HOT_ONLY:
            _check_hot_only(cold_ids)
            cold = self._gather(cold_ids)  # empty
        elif cold is None:
            cold = self._gather(cold_ids)
        if cold.rows.device.type == "cuda":  # copied on the side stream, used on this one
            cold.rows.record_stream(torch.cuda.current_stream(cold.rows.device))
        local = torch.searchsorted(cold.ids, cold_ids)
        if cold_ids.numel() and not torch.equal(cold.ids[local.clamp(max=cold.ids.numel() - 1)], cold_ids):
            raise ValueError("ColdRows were gathered for another batch")
        hot_part = pooled_lookup(
            self.hot_weight, slot[is_hot], _offsets(hot_lengths), self._receive_hot,
            None if scale is None else scale[is_hot],
        )
        cold_part = pooled_lookup(
            cold.rows, local, _offsets(cold_lengths), partial(self._receive_cold, cold.ids),
            None if scale is None else scale[~is_hot],
        )
        self._note_stats(is_hot, cold_lengths, batch, cold.ids.numel())
        pooled = (hot_part + cold_part).view(len(self.features), batch, self.dim)
        return pooled.transpose(0, 1).reshape(batch, len(self.features) * self.dim)

    def _forward_sharded(self, sparse: KeyedJaggedTensor, cold: ColdPooled | str | None) -> torch.Tensor:
        """Several ranks: Σ hot part (local replica) + Σ cold part (sharded host tier)."""
        ids, values, lengths, batch = self._ids_values(sparse)
        is_hot, slot = self._is_hot(ids)
        cold_lengths = self._cold_lengths(lengths, is_hot)
        num_features = len(self.features)
        hot_part = pooled_lookup(self.hot_weight, slot[is_hot], _offsets(lengths - cold_lengths),
                                 self._receive_hot)
        pooled = hot_part.view(num_features, batch, self.dim).transpose(0, 1)  # [B, F, D]
        if cold is HOT_ONLY:
            _check_hot_only(ids[~is_hot])
        else:
            if cold is None:
                cold = self._cold_pooled(values[~is_hot], cold_lengths, batch)
            assert isinstance(cold, ColdPooled)
            pooled = pooled + cold.pooled.view(batch, num_features, self.dim)
        if self.pooling is Pooling.MEAN:
            whole = lengths.view(num_features, batch).t().clamp(min=1).to(pooled.dtype)
            pooled = pooled / whole.unsqueeze(2)
        self._note_stats(is_hot, cold_lengths, batch, (~is_hot).sum())
        return scale_grad(pooled.reshape(batch, num_features * self.dim), self.grad_scale)

    def _note_stats(self, is_hot: torch.Tensor, cold_lengths: torch.Tensor, batch: int,
                    cold_rows: torch.Tensor | int) -> None:
        """Kept as tensors: read through ``last_stats`` (no device sync per forward)."""
        popular = cold_lengths.view(len(self.features), batch).sum(dim=0) == 0
        self._last = (is_hot.sum(), is_hot.numel(), popular.sum(), batch, cold_rows)

    @property
    def last_stats(self) -> dict[str, float]:
        """Hit rate, popular share and cold rows of the last forward."""
        if self._last is None:
            return {}
        hits, lookups, popular, batch, cold_rows = self._last
        return {
            "hot_hit_rate": float(hits) / max(lookups, 1),
            "popular_share": float(popular) / max(batch, 1),
            "cold_rows": float(cold_rows),
        }

    # ------------------------------------------------------------------ updates
    def _receive_hot(self, grad: KVGradient) -> None:
        if self.fused:
            self._apply_hot(grad)
        else:
            self._hot_kept.append(grad)

    def _receive_cold(self, cold_ids: torch.Tensor, grad: KVGradient) -> None:
        home = self.host.weight.device
        grad = KVGradient(cold_ids[grad.ids].to(home), grad.rows.to(home))
        if self.fused:
            self.host.apply_gradient(grad)
        else:
            self._cold_kept.append(grad)

    def _apply_hot(self, grad: KVGradient) -> None:
        self.optimizer.apply(self.hot_weight.data, self.hot_state, grad, self.lr)

    def set_lr(self, lr: float) -> None:
        self.lr = lr
        self.host.set_lr(lr)

    def step(self) -> None:
        """Apply kept gradients: once per tier, even when empty (Adam counts steps).
        Several ranks: hot gradients are all-gathered first, so replicas stay equal."""
        if self.fused:
            return
        hot = _merge(self._hot_kept, self.hot_weight)
        if self.sharded:
            synced = allgather_kv(KVGradient(hot.ids.cpu(), hot.rows.cpu()), self.host.group)
            hot = KVGradient(synced.ids.to(hot.ids.device), synced.rows.to(hot.rows.device))
            self._apply_hot(hot)
            self.host.step()
        else:
            self._apply_hot(hot)
            self.host.apply_gradient(_merge(self._cold_kept, self.host.weight))
        self._hot_kept, self._cold_kept = [], []

    def kv_gradients(self) -> dict[str, KVGradient]:
        if self.sharded:
            raise RuntimeError("kv_gradients of a multi-rank Hotline collection: the cold "
                               "part lives in the host tier's shards (host.kv_gradients())")
        if not (self._hot_kept or self._cold_kept):
            return {}
        home = self.host.weight.device
        parts = [KVGradient(self.hot_ids[g.ids].to(home), g.rows.to(home)) for g in self._hot_kept]
        grad = KVGradient.cat(parts + self._cold_kept)
        out = {}
        for t in self.tables:
            start = self.host.row_offsets[t.name]
            part = grad.slice_rows(start, start + t.rows)
            if len(part):
                out[t.name] = part
        return out

    # ------------------------------------------------------------------ state
    def export_tables(self) -> dict[str, torch.Tensor]:
        """The host tier's ``export_tables`` (per table, or per shard on several
        ranks), hot rows merged in."""
        self.sync_to_host()
        return self.host.export_tables()

    def import_tables(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load the host tier, then the hot rows from it (several ranks: collective)."""
        self.host.import_tables(tensors)
        self._load_hot(self.hot_ids.cpu(), self.hot_weight.device)


def _check_hot_only(cold_ids: torch.Tensor) -> None:
    if cold_ids.numel():
        raise ValueError(f"a popular micro-batch has {cold_ids.numel()} cold lookups")


def _pin(host: LocalEmbeddingCollection) -> None:
    """Page-lock the host tables and state: copies to and from the GPU go by DMA."""
    host.weight.data = host.weight.data.pin_memory()
    for name, tensor in host.state.items():
        setattr(host, f"optim_{name}", tensor.pin_memory())


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    return offsets


def _merge(grads: list[KVGradient], like: torch.Tensor) -> KVGradient:
    if grads:
        return KVGradient.cat(grads)
    ids = torch.zeros(0, dtype=torch.int64, device=like.device)
    return KVGradient(ids, like.new_zeros(0, like.shape[1]))
