"""The hot tier: the hot rows on the device, authoritative while they are hot.

    ids    [H]     stacked ids of the hot rows, sorted: slot = searchsorted(ids, id)
    weight [H, D]  their rows (a parameter: autograd calls the lookup's backward)
    state  [H, ..] their optimizer state (per-table scalars: this tier's own copy)

id → slot: a searchsorted on the sorted hot ids, not a [sum(rows)] table of
slots: device memory then grows with the hot set only (8 B per hot row) instead of
8 B per row of every table, which is what Hotline exists to save; the cost is
log2(H) comparisons per lookup.

Lookups: the torch path (``pooled_lookup``, KV gradients) or, with ``kernels``
Triton (one process, or several ranks with ``kernels=triton``: the held gradients
all-gathered first; fp32, fp16 or bf16 rows and state), the Triton kernels:
``hot_kernels.py``.

fp16/bf16 tables: the hot rows are stored in the table's type and updated as the
host tier (and a plain collection) updates them: computed in fp32, written back with
stochastic rounding keyed by (seed, update count, full table, row, column), the row
that of the full table (slot → stacked id → table, row): Hotline rounds every element
as a single-process collection does, bit for bit. The torch path finds a slot's table
by a searchsorted and reads the update count on the host; the Triton update reads the
count from the device (``rounding_step``, a [1] tensor incremented there before the
launch) and the row from ``row_map`` [H] (int64, the full-table row of each slot,
made at each load: 8 B per hot row), the table key from the lookup's feature.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from embeddings.hotline.hot_kernels import gather_ranks, in_split_order, join
from embeddings.jagged import bag_offsets
from embeddings.kernels import KernelChoice, use_triton
from embeddings.kv import KVGradient
from embeddings.lookup import pooled_lookup
from embeddings.narrow import say_fp16_overflow
from embeddings.optim import SparseOptimizer
from embeddings.rounding import RowRounding, table_key
from embeddings.table import TableSpec

if TYPE_CHECKING:
    import torch.distributed as dist

    from embeddings.hotline.cold_stage import ColdStage
    from embeddings.hotline.split import DeviceSplit
    from embeddings.kernels.lookup import Bags
    from embeddings.kernels.rounding import KernelRounding


class HotTier(nn.Module):
    """Hot rows, their optimizer state and their kept gradients (slot ids)."""

    def __init__(self, optimizer: SparseOptimizer, fused: bool, tables: list[TableSpec] | None = None,
                 rounding_seed: int = 0, kernels: str | KernelChoice = KernelChoice.AUTO,
                 one_process: bool = True, group: dist.ProcessGroup | None = None) -> None:
        """``tables`` (all of them, in stacking order) and ``rounding_seed``: where a
        stacked id's rounding coordinates come from (half tables or state).
        ``kernels``: the lookups' path (embeddings/kernels; ``auto``: Triton on CUDA),
        taken in one process, rows and state of any table type (several ranks
        all-gather KV gradients, which the torch path keeps)."""
        super().__init__()
        self.kernels = KernelChoice(kernels)
        self.one_process = one_process
        # several ranks: the replicas' group, on the run's backend (NCCL on GPUs), over
        # which the hot gradients are all-gathered (``shared``; Triton: ``gather_ranks``)
        self.group = group
        self._parts: list[tuple[torch.Tensor, Bags]] = []  # Triton, kept: held micro-batches
        self._sources: list[tuple[DeviceSplit, int] | None] = []  # the split and group of each
        self._lr_on_device: torch.Tensor | None = None
        self._row_base: dict[int, torch.Tensor] = {}
        self.optimizer = optimizer
        self.rounding_seed = rounding_seed
        starts, total = [], 0
        for t in tables or []:
            starts.append(total)
            total += t.rows
        self.register_buffer("_sr_starts", torch.tensor(starts, dtype=torch.int64), persistent=False)
        self.register_buffer("_sr_keys", torch.tensor([table_key(t.name) for t in tables or []],
                                                      dtype=torch.int64), persistent=False)
        # per feature (the lookups' order: tables' features in stacking order), for the
        # Triton update: its table's key; column 0 (a hot row is whole)
        feature_keys = [table_key(t.name) for t in tables or [] for _ in t.features]
        self.register_buffer("_sr_feature_keys", torch.tensor(feature_keys, dtype=torch.int64), persistent=False)
        self.register_buffer("_sr_feature_col0", torch.zeros(len(feature_keys), dtype=torch.int64),
                             persistent=False)
        # fp16 rows: per feature, the finite values an update rounded to inf (the Triton
        # update adds on the device; the torch path at its update), said by warn_fp16_overflow
        self._feature_tables = [t.name for t in tables or [] for _ in t.features]
        first_features, first = [], 0  # per table (stacking order): its first feature
        for t in tables or []:
            first_features.append(first)
            first += len(t.features)
        self.register_buffer("_first_features", torch.tensor(first_features, dtype=torch.int64), persistent=False)
        self._rounded: tuple[RowRounding, torch.Tensor, torch.Tensor] | None = None  # the torch path's last
        self.register_buffer("_overflow_counts", torch.zeros(len(feature_keys), dtype=torch.int32),
                             persistent=False)
        self._overflow_said: set[str] = set()
        self.fused = fused
        self.lr = 0.0
        self.kept: list[KVGradient] = []
        self._state_names: list[str] = []
        self._ids_on: dict[torch.device, torch.Tensor] = {}
        # loads that made new tensors (not copied into those held: see ``load``)
        self.storage_version = 0

    def load(self, ids: torch.Tensor, weight: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Hold rows ``weight`` [H, D] of stacked ``ids`` [H] (sorted), with ``state``.
        On the Triton path per-table scalars (Adam's step, the rounding step) move to the
        weight's device, where the update kernel reads and counts them.

        A hot set of the size, types and devices held (a refresh once the budget is
        full: the rows hot now fill what room a window leaves, profile.choose_hot_rows's
        ``keep``) is copied into the tensors held, so what reads
        them by address (a captured Hotline step, dlrm/train/hotline_graph.py) stays
        valid; otherwise new tensors are held and ``storage_version`` moves on."""
        on_device = self.on_triton() if hasattr(self, "weight") else False
        state = {n: t.to(weight.device) if on_device else t for n, t in state.items()}
        if self._fits_held(ids, weight, state):
            self.ids.copy_(ids)
            self._ids_on = {}
            self.weight.data.copy_(weight)
            for name, tensor in state.items():
                self.get_buffer(f"optim_{name}").copy_(tensor)
            self._row_map.copy_(self._full_rows(ids))
            return
        self.storage_version += 1
        self.register_buffer("ids", ids, persistent=False)
        # Copies of the hot ids on other devices where ids may arrive (the trainer
        # classifies on the hot tier's device; callers may classify host batches):
        # one copy per refresh, not one per lookup.
        self._ids_on = {}
        self.weight = nn.Parameter(weight)
        on_device = self.on_triton()
        for name, tensor in state.items():
            self.register_buffer(f"optim_{name}", tensor.to(weight.device) if on_device else tensor)
        self._state_names = list(state)
        self.register_buffer("_row_map", self._full_rows(ids), persistent=False)
        for name in ("_sr_feature_keys", "_sr_feature_col0", "_overflow_counts", "_first_features"):
            self.register_buffer(name, self.get_buffer(name).to(weight.device), persistent=False)

    def _fits_held(self, ids: torch.Tensor, weight: torch.Tensor, state: dict[str, torch.Tensor]) -> bool:
        """Whether ``load``'s tensors have the shapes, types and devices of those held."""
        if not hasattr(self, "weight") or set(state) != set(self._state_names):
            return False
        pairs = [(ids, self.ids), (weight, self.weight.data),
                 *((t, self.get_buffer(f"optim_{n}")) for n, t in state.items())]
        return all(a.shape == b.shape and a.dtype == b.dtype and a.device == b.device for a, b in pairs)

    def _full_rows(self, stacked: torch.Tensor) -> torch.Tensor:
        """The full-table row of each stacked id (no tables given: one table from row 0)."""
        if self._sr_starts.numel() == 0:
            return stacked.clone()
        starts = self._sr_starts.to(stacked.device)
        return stacked - starts[torch.searchsorted(starts, stacked, right=True) - 1]

    @property
    def state(self) -> dict[str, torch.Tensor]:
        return {name: self.get_buffer(f"optim_{name}") for name in self._state_names}

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def locate(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hot mask [N], slot [N]; slot is meaningless where not hot)."""
        hot_ids = self._ids_on.get(ids.device)
        if hot_ids is None:
            hot_ids = self._ids_on[ids.device] = self.ids.to(ids.device)
        if hot_ids.numel() == 0:
            return torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids)
        slot = torch.searchsorted(hot_ids, ids).clamp_(max=hot_ids.numel() - 1)
        return hot_ids[slot] == ids, slot

    def on_triton(self) -> bool:
        """Whether the lookups take the Triton kernels (see ``__init__``): ``auto`` in one
        process on CUDA; ``triton`` on several ranks too (each rank's held gradient is
        all-gathered before the one fused update: ``gather_ranks``)."""
        if not self.one_process and self.kernels is not KernelChoice.TRITON:
            return False
        return use_triton(self.kernels, self.device)

    def lookup(
        self, slots: torch.Tensor, lengths: torch.Tensor, features: int,
        scale: torch.Tensor | None = None, whole_lengths: torch.Tensor | None = None,
        source: tuple[DeviceSplit, int] | None = None,
    ) -> torch.Tensor:
        """Pooled [F*b, D] of bags ``lengths`` [F*b] (feature-major) over hot ``slots``;
        ``scale`` [N] (mean pooling): 1 / ``whole_lengths`` of each lookup's bag.
        Gradients come back to ``receive`` (torch) or ``_held`` (Triton). ``source``:
        the split and group the micro-batch was cut from (``MicroLookups.source``)."""
        if self.on_triton():
            return self._triton_lookup(slots, lengths, features, scale is not None, whole_lengths, source)
        return pooled_lookup(self.weight, slots, bag_offsets(lengths), self.receive, scale)

    def _triton_lookup(self, slots: torch.Tensor, lengths: torch.Tensor, features: int, mean: bool,
                       whole_lengths: torch.Tensor | None, source: tuple[DeviceSplit, int] | None
                       ) -> torch.Tensor:
        from embeddings.kernels.lookup import Bags, triton_pooled_lookup  # imports triton

        row_base = self.zero_row_base(features)
        bags = Bags(slots, bag_offsets(lengths), row_base, lengths.numel() // max(features, 1), False, True)
        held = partial(self._held, source)
        pooled = triton_pooled_lookup(self.weight, bags, held).view(-1, self.weight.shape[1])
        if mean:  # a bag's hot part over its whole length: the cold lookups count too
            assert whole_lengths is not None
            pooled = pooled * (1.0 / whole_lengths.clamp(min=1).to(torch.float32)).unsqueeze(1)
        return pooled

    def zero_row_base(self, features: int) -> torch.Tensor:
        """[F] zeros on the device: every feature's first row in the hot weight (slots
        are rows of it), made once per feature count."""
        row_base = self._row_base.get(features)
        if row_base is None or row_base.device != self.device:
            row_base = self._row_base[features] = torch.zeros(features, dtype=torch.int64, device=self.device)
        return row_base

    def update_static(self, grad_pooled: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                      features: int, batch: int, mean: bool, cold_grad: torch.Tensor) -> None:
        """A captured step's update (static_step.py): the fused update over a whole
        mini-batch's bags [B, F*D], ``ids`` [N] both tiers' keys (a slot, or the hot
        rows + a staged cold row: kernels/two_tier.py's ``tier_ids``); the hot rows
        updated, each cold row's summed gradient written at ``cold_grad[row]``. Counts
        as ``update_held`` counts (Adam's step, the rounding step: on the device)."""
        from embeddings.kernels.sparse_update import backward_update

        backward_update(grad_pooled, ids, offsets, self.zero_row_base(features), batch, mean, False,
                        self.weight.data, self.optimizer, self.state, self._device_lr(), self._kernel_rounding(),
                        rows_by_id=(self.weight.shape[0], cold_grad))

    def cold_stage(self, capacity: int, dim: int) -> ColdStage:
        """A stage for ``capacity`` cold rows of this tier's type (cold_stage.py), with
        the stack's tables, where its rows' rounding coordinates come from."""
        from embeddings.hotline.cold_stage import ColdStage

        return ColdStage.like(capacity, dim, self.weight.dtype, self.optimizer, self.device, self._sr_starts,
                              self._sr_keys)

    def update_staged(self, stage: ColdStage, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """A static step's staged cold ``rows`` [C, D] and ``stage.state`` updated with
        their summed ``grad`` [C, D] by the hot rows' own kernel, lr and rounding step
        (this step's: ``update_static`` counted it): row i by grad[i], for i below the
        stage's count; half rows rounded at their full-table coordinates (cold_stage.py)."""
        from embeddings.kernels.sparse_update import backward_update

        values, offsets, zeros = stage.update_layout()
        # Adam: this step's count, the hot tier's (``update_static`` counted it)
        state = {**stage.state, "step": self.state["step"]} if "step" in self.state else stage.state
        rounding = None
        if self.optimizer.rounding:
            from embeddings.kernels.rounding import KernelRounding

            stage.locate()
            if stage.overflow is not None:
                stage.overflow.zero_()
            rounding = KernelRounding(self.rounding_seed, self.state["rounding_step"], stage.keys, zeros, zeros,
                                      row_map=stage.full_rows, overflow=stage.overflow)
        backward_update(grad, values, offsets, zeros, 1, False, True, rows, self.optimizer, state,
                        self._device_lr(), rounding, presorted=True, count=False)  # row i's lookup is i
        if stage.overflow is not None:  # fp16: each row's count, at its table's first feature
            first = self._first_features.index_select(0, stage.tables)
            self._overflow_counts.index_add_(0, first, stage.overflow)

    def _device_lr(self) -> torch.Tensor:
        """The lr as a [1] device tensor the update kernel reads (``set_lr`` fills it):
        made before a capture, so a replay reads the step's lr."""
        if self._lr_on_device is None or self._lr_on_device.device != self.device:
            self._lr_on_device = torch.full((1,), self.lr, dtype=torch.float32, device=self.device)
        return self._lr_on_device

    def _held(self, source: tuple[DeviceSplit, int] | None, grad_pooled: torch.Tensor, bags: Bags) -> None:
        """Triton backward: fused, update now; kept, hold it for ``update_held``."""
        if self.fused:
            self._update([(grad_pooled, bags)])
        else:
            self._parts.append((grad_pooled, bags))
            self._sources.append(source)

    def update_held(self) -> None:
        """Triton, kept: one fused backward + update over every held micro-batch (one
        sort, one launch), applied once even when none was held (Adam counts steps)."""
        parts, self._parts = self._parts, []
        sources, self._sources = self._sources, []
        self._update(parts, sources)

    def _update(self, parts: list[tuple[torch.Tensor, Bags]],
                sources: list[tuple[DeviceSplit, int] | None] | None = None) -> None:
        from embeddings.kernels.sparse_update import backward_update

        lr = self._device_lr()
        if parts:
            row_base = parts[0][1].row_base
            joined = in_split_order(parts, sources or [])
            grad, slots, offsets, batch = joined if joined is not None else join(parts, row_base.numel())
        else:  # no hot lookup this step: the optimizer still counts it (Adam's step)
            row_base = slots = torch.zeros(0, dtype=torch.int64, device=self.device)
            grad, batch = self.weight.new_zeros(0, 0, self.weight.shape[1], dtype=torch.float32), 0
            offsets = torch.zeros(1, dtype=torch.int64, device=self.device)
        if not self.one_process:  # the replicas apply every rank's gradient, the same sum
            if not parts:
                raise RuntimeError("Hotline on several ranks: a step with no hot lookup pass")
            grad, slots, offsets, batch = gather_ranks((grad, slots, offsets, batch), row_base, self.group)
        backward_update(grad, slots, offsets, row_base, batch, False, True, self.weight.data,
                        self.optimizer, self.state, lr, self._kernel_rounding())

    def _kernel_rounding(self) -> KernelRounding | None:
        """Half weight or state (or an fp32 group beside half ones: it counts too): the
        update count goes up on the device, once per update as ``apply`` counts it (an
        empty one too), so both paths and the host tier keep the same step; rows at
        ``row_map``'s full-table coordinates."""
        if not self.optimizer.rounding:
            return None
        from embeddings.kernels.rounding import KernelRounding

        step = self.state["rounding_step"]
        step.add_(1)
        zeros = self._sr_feature_col0  # column 0 per feature; the row shift, unread beside a row map
        overflow = self._overflow_counts if self.weight.dtype == torch.float16 else None
        return KernelRounding(self.rounding_seed, step, self._sr_feature_keys, zeros, zeros,
                              overflow=overflow, row_map=self._row_map)

    def warn_fp16_overflow(self) -> None:
        """fp16 hot rows: one line per table whose update rounded finite values to inf,
        said once (embeddings/narrow.py's text). A host read of the [F] counts: call it
        where the host waits anyway (the trainer's log, checkpoint and end)."""
        if self.weight.dtype == torch.float16:
            say_fp16_overflow(self._overflow_counts.tolist(), self._feature_tables, self._overflow_said)

    def set_lr(self, lr: float) -> None:
        if lr == self.lr:  # the trainer sets it every step; most steps keep it
            return
        self.lr = lr
        if self._lr_on_device is not None:
            self._lr_on_device.fill_(lr)  # a device-side fill: no host wait

    def has_kept(self) -> bool:
        return bool(self.kept or self._parts)

    def receive(self, grad: KVGradient) -> None:
        if self.fused:
            self.apply(grad)
        else:
            self.kept.append(grad)

    def apply(self, grad: KVGradient) -> None:
        """One optimizer step (an empty ``grad`` counts too), as the host tier takes it."""
        rounder = None
        self._rounded = None
        if self.optimizer.rounding:  # half weight or state: rounded at full-table coordinates
            self.state["rounding_step"] += 1
            rounder = self._round_rows
        self.optimizer.apply(self.weight.data, self.state, grad, self.lr, rounder=rounder)
        if self._rounded is not None and self.weight.dtype == torch.float16:
            self._count_overflow(*self._rounded)

    def _round_rows(self, slots: torch.Tensor) -> RowRounding:
        """Where hot ``slots`` sit in their full tables: slot → stacked id → (table
        key, row); column 0 (a hot row is whole)."""
        stacked = self.ids[slots]
        starts, keys = self._sr_starts.to(stacked.device), self._sr_keys.to(stacked.device)
        t = torch.searchsorted(starts, stacked, right=True) - 1
        rows = stacked - starts[t]
        rounding = RowRounding(self.weight.dtype, self.rounding_seed, int(self.state["rounding_step"]), keys[t],
                               rows, torch.zeros_like(rows))
        self._rounded = (rounding, slots, t)
        return rounding

    def _count_overflow(self, rounding: RowRounding, slots: torch.Tensor, table: torch.Tensor) -> None:
        """The torch path's fp16 overflow (a host read, as the collection's torch path
        reads it): the infs of the rows that overflowed, added to each table's first
        feature's count (the warning sums a table's features)."""
        if rounding.overflow is None or not bool(rounding.overflow.any()):
            return
        infs = torch.isinf(self.weight.data.index_select(0, slots[rounding.overflow])).sum(dim=1)
        first = self._first_features.index_select(0, table[rounding.overflow].to(self._first_features.device))
        self._overflow_counts.index_add_(0, first, infs.to(self._overflow_counts))

    def shared(self, grad: KVGradient) -> KVGradient:
        """The torch path's hot gradient every replica applies: this rank's ``grad`` in
        one process; on several ranks every rank's, all-gathered over the replicas'
        ``group`` (the run's backend: NCCL keeps it on the GPU, no trip through the
        host) and merged, the same on every rank."""
        if self.one_process:
            return grad
        from embeddings.sharding.data_parallel import allgather_kv

        return allgather_kv(grad, self.group)

    def take(self) -> KVGradient:
        """The kept gradients merged (empty if none), then forgotten."""
        kept, self.kept = self.kept, []
        if kept:
            return KVGradient.cat(kept)
        return KVGradient.empty(self.weight.shape[1], self.weight.device)

    def kept_by_stacked_id(self) -> list[KVGradient]:
        """The kept gradients with stacked ids instead of slots (not forgotten; Triton:
        the held micro-batches' KV gradient, computed by the kernel)."""
        kept = list(self.kept)
        if self._parts:
            from embeddings.kernels.sparse_update import backward_kv

            grad, slots, offsets, batch = join(self._parts, self._parts[0][1].row_base.numel())
            kept.append(backward_kv(grad, slots, offsets, self._parts[0][1].row_base, batch, False, True))
        return [KVGradient(self.ids[g.ids], g.rows) for g in kept]
