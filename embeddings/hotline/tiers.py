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

Popular/non-popular micro-batches: with ``fused=False``, forward + backward on
each micro-batch then one ``step()`` equals one step on the whole mini-batch
(kept gradients are summed per row before the optimizer sees them).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from embeddings.collection import EmbeddingCollection, LocalEmbeddingCollection
from embeddings.hotline.profile import HotProfile
from embeddings.kv import KVGradient
from embeddings.lookup import pooled_lookup
from embeddings.optim import SparseOptimizer
from embeddings.table import Pooling, TableSpec

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


@dataclass
class ColdRows:
    """Copies of the cold rows one batch needs, on the device.

    ids [U] stacked ids (host stack numbering), unique ascending, on the device;
    rows [U, D] on the device, a leaf that requires grad (its KV gradient goes home).
    """

    ids: torch.Tensor
    rows: torch.Tensor


class HotlineEmbeddingCollection(EmbeddingCollection):
    """``LocalEmbeddingCollection`` semantics, with the profile's hot rows on ``device``.

    The host tier is a ``LocalEmbeddingCollection`` kept out of the module tree,
    so ``.to(device)`` moves the hot tier only.
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
    ) -> None:
        super().__init__()
        host_tier = LocalEmbeddingCollection(tables, optimizer, fused=True, seed=seed, device=host)
        object.__setattr__(self, "host", host_tier)  # not a submodule, on purpose
        self.tables = host_tier.tables
        self.dim = host_tier.dim
        self.pooling = host_tier.pooling
        self.features = host_tier.features
        self.optimizer = optimizer
        self.fused = fused
        self.lr = 0.0
        device = torch.device(device)
        self.register_buffer("feature_offsets", host_tier.feature_offsets.to(device), persistent=False)
        probe = optimizer.init_state(2, self.dim, torch.device("cpu"))
        self._row_state = [n for n, t in probe.items() if t.shape[0] == 2]
        self._state_names = list(probe)
        self._hot_kept: list[KVGradient] = []
        self._cold_kept: list[KVGradient] = []
        self.last_stats: dict[str, float] = {}
        self.profile = profile
        self._load_hot(self._stacked_hot_ids(profile), device)

    # ------------------------------------------------------------------ tiers
    host: LocalEmbeddingCollection

    @property
    def hot_state(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, f"hot_optim_{name}") for name in self._state_names}

    def _stacked_hot_ids(self, profile: HotProfile) -> torch.Tensor:
        parts = []
        for t in self.tables:
            ids = profile.hot.get(t.name, torch.zeros(0, dtype=torch.int64)).to(torch.int64).cpu()
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= t.rows):
                raise ValueError(f"hot profile: table {t.name!r} has row ids outside [0, {t.rows})")
            parts.append(torch.unique(ids) + self.host.row_offsets[t.name])
        return torch.cat(parts)

    @torch.no_grad()
    def _load_hot(self, stacked_ids: torch.Tensor, device: torch.device) -> None:
        """Copy rows ``stacked_ids`` (sorted) and their state from host to the device."""
        host_ids = stacked_ids.to(self.host.weight.device)
        self.register_buffer("hot_ids", stacked_ids.to(device), persistent=False)
        self.hot_weight = nn.Parameter(self.host.weight.data.index_select(0, host_ids).to(device))
        fresh = self.optimizer.init_state(stacked_ids.numel(), self.dim, device)
        for name, tensor in fresh.items():
            src = self.host.state[name]
            tensor.copy_(src.index_select(0, host_ids) if name in self._row_state else src)
            self.register_buffer(f"hot_optim_{name}", tensor)

    @torch.no_grad()
    def sync_to_host(self) -> None:
        """Write the hot rows and their optimizer state into the host tier."""
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
        if sparse.keys() != self.features:
            sparse = sparse.permute([sparse.keys().index(f) for f in self.features])
        batch = sparse.stride()
        values, lengths = sparse.values(), sparse.lengths()
        per_feature = lengths.view(len(self.features), batch).sum(dim=1)
        offsets = self.feature_offsets.to(values.device)
        ids = values + torch.repeat_interleave(offsets, per_feature, output_size=values.numel())
        return ids, lengths, batch

    def _is_hot(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hot mask [N], slot [N]; slot is meaningless where not hot)."""
        hot_ids = self.hot_ids.to(ids.device)
        if hot_ids.numel() == 0:
            return torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids)
        slot = torch.searchsorted(hot_ids, ids).clamp_(max=hot_ids.numel() - 1)
        return hot_ids[slot] == ids, slot

    def split(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Popular mask [B] (bool): samples whose every lookup hits a hot row."""
        ids, lengths, batch = self._ids(sparse)
        is_hot, _ = self._is_hot(ids)
        return self._cold_lengths(lengths, is_hot).view(-1, batch).sum(dim=0) == 0

    @staticmethod
    def _cold_lengths(lengths: torch.Tensor, is_hot: torch.Tensor) -> torch.Tensor:
        bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        return torch.bincount(bag[~is_hot], minlength=lengths.numel())

    def gather_cold(self, sparse: KeyedJaggedTensor) -> ColdRows:
        """The cold rows ``sparse`` needs, copied to the device (a pipeline may call
        this ahead of ``forward``, after the previous step's update)."""
        ids, _, _ = self._ids(sparse)
        is_hot, _ = self._is_hot(ids)
        return self._gather(ids[~is_hot])

    def _gather(self, cold_ids: torch.Tensor) -> ColdRows:
        device = self.hot_weight.device
        unique = torch.unique(cold_ids)
        rows = self.host.weight.data.index_select(0, unique.to(self.host.weight.device))
        if device.type == "cuda" and rows.device.type == "cpu":
            rows = rows.pin_memory().to(device, non_blocking=True)
        else:
            rows = rows.to(device)
        return ColdRows(unique.to(device), rows.requires_grad_(True))

    # ------------------------------------------------------------------ forward
    def forward(self, sparse: KeyedJaggedTensor, cold: ColdRows | None = None) -> torch.Tensor:
        """[B, F*D]; ``cold``: rows from ``gather_cold(sparse)``, else gathered here."""
        ids, lengths, batch = self._ids(sparse)
        is_hot, slot = self._is_hot(ids)
        scale = None
        if self.pooling is Pooling.MEAN:
            inv = 1.0 / lengths.clamp(min=1).to(self.hot_weight.dtype)
            scale = torch.repeat_interleave(inv, lengths, output_size=ids.numel())
        cold_lengths = self._cold_lengths(lengths, is_hot)
        hot_lengths = lengths - cold_lengths
        cold_ids = ids[~is_hot]
        if cold is None:
            cold = self._gather(cold_ids)
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
        popular = cold_lengths.view(-1, batch).sum(dim=0) == 0
        self.last_stats = {
            "hot_hit_rate": float(is_hot.sum()) / max(ids.numel(), 1),
            "popular_share": float(popular.sum()) / max(batch, 1),
            "cold_rows": float(cold.ids.numel()),
        }
        pooled = (hot_part + cold_part).view(len(self.features), batch, self.dim)
        return pooled.transpose(0, 1).reshape(batch, len(self.features) * self.dim)

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
        """Apply kept gradients: once per tier, even when empty (Adam counts steps)."""
        if self.fused:
            return
        self._apply_hot(_merge(self._hot_kept, self.hot_weight))
        self.host.apply_gradient(_merge(self._cold_kept, self.host.weight))
        self._hot_kept, self._cold_kept = [], []

    def kv_gradients(self) -> dict[str, KVGradient]:
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
        """As ``LocalEmbeddingCollection.export_tables``, hot rows merged in."""
        self.sync_to_host()
        return self.host.export_tables()

    def import_tables(self, tensors: dict[str, torch.Tensor]) -> None:
        self.host.import_tables(tensors)
        self._load_hot(self.hot_ids.cpu(), self.hot_weight.device)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    return offsets


def _merge(grads: list[KVGradient], like: torch.Tensor) -> KVGradient:
    if grads:
        return KVGradient.cat(grads)
    ids = torch.zeros(0, dtype=torch.int64, device=like.device)
    return KVGradient(ids, like.new_zeros(0, like.shape[1]))
