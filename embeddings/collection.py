"""Embedding collections: jagged ids in, pooled vectors [B, F*D] out, sparse updates.

``EmbeddingCollection`` is the interface the model sees; this file also holds the
single-process implementation. Sharded (hybrid-parallel) and Hotline (tiered)
collections implement the same interface elsewhere in this package.

    JaggedFeatures or KJT (feature-major)    pooled [B, F*D]
    values  [f0: b0 b1 ..| f1: b0 b1 ..| ..]  ──►  row b = [pool(f0,b) | pool(f1,b) | ..]
    lengths [F * B]
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from data.errors import UserError
from embeddings import rounding_cpu
from embeddings.huge_pages import advise_huge_pages
from embeddings.init import init_rows
from embeddings.interface import Prefetched, TableState
from embeddings.jagged import bag_offsets, in_feature_order, permute_bags, stacked_ids
from embeddings.kernels import KernelChoice, use_triton
from embeddings.kv import KVGradient
from embeddings.lookup import pooled_lookup
from embeddings.narrow import Fp16OverflowCounter, fp16_overflow, say_fp16_overflow, warn_once
from embeddings.optim import SparseOptimizer
from embeddings.plan.sizes import format_bytes
from embeddings.plan.types import Shard, ShardingPlan, ShardingType
from embeddings.rounding import RowRounding, table_key, weight_dtype
from embeddings.table import Pooling, TableSpec
from embeddings.timing import section

if TYPE_CHECKING:
    from data.jagged import KeyedJagged
    from embeddings.kernels.lookup import Bags, FeatureRoute
    from embeddings.kernels.rounding import KernelRounding


class EmbeddingCollection(nn.Module, ABC):
    """Pooled embeddings of ``features`` (in this order), each ``dim`` wide.

    Training contract, once per step: ``set_lr(lr)``; forward; backward (which
    produces KV gradients: applied at once when ``fused``, else kept); ``step()``
    (applies kept gradients and clears them).
    """

    features: list[str]
    dim: int
    plan: ShardingPlan | None = None  # which rank holds what; None: every table here

    @abstractmethod
    def forward(self, sparse: KeyedJagged) -> torch.Tensor:
        """[B, len(features) * dim]."""

    @abstractmethod
    def set_lr(self, lr: float) -> None: ...

    @abstractmethod
    def step(self) -> None: ...

    @abstractmethod
    def kv_gradients(self) -> dict[str, KVGradient]:
        """Kept (not yet applied) gradients per table, ids local to the table."""

    @abstractmethod
    def export_tables(self) -> dict[str, torch.Tensor]:
        """``{table}.weight`` and ``{table}.{optimizer state}`` tensors, rows first."""

    @abstractmethod
    def import_tables(self, tensors: dict[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def table_state(self) -> TableState:
        """This rank's tables as live tensors, for a checkpoint (embeddings/interface.py)."""

    def start(self, sparse: KeyedJagged | Prefetched) -> object:
        """Begin a lookup (embeddings/interface.py); here nothing is in flight."""
        return sparse

    def finish(self, started: object) -> torch.Tensor:
        return self(started)

    def tables_loaded(self) -> None:
        """Nothing is derived from the tables here."""


class LocalEmbeddingCollection(EmbeddingCollection):
    """All tables in one process, stacked in one [sum(rows), dim] weight.

    One ``embedding_bag`` call serves every feature; table t occupies rows
    [row_offset[t], row_offset[t] + rows[t]) of the stacked weight, and each
    feature's ids are shifted by its table's offset before the call.
    """

    def __init__(
        self,
        tables: list[TableSpec],
        optimizer: SparseOptimizer,
        fused: bool = True,
        seed: int | None = 0,
        device: torch.device | str = "cpu",
        table_origin: dict[str, tuple[str, int, int, int]] | None = None,
        init_dim: dict[str, int] | None = None,
        rounding_seed: int | None = None,
        kernels: str | KernelChoice = KernelChoice.AUTO,
    ) -> None:
        """``table_origin`` (for shards): table name → (full table name, its rows,
        first row, first column) and ``init_dim`` → the full table's dim, so a shard
        starts with its slice of the full table's initial values. ``seed=None``: no
        initial values (``torch.empty``, not even touched), for a collection that a
        checkpoint is about to fill: a resume skips the random init of every row.
        ``kernels``: the lookup's path (embeddings/kernels: ``auto`` is Triton on CUDA).

        Tables of fp16/bf16 (``TableSpec.dtype``; one type per collection: the stack is
        one tensor) are stored in that type; lookups accumulate in fp32 and pooled
        vectors are fp32; updates are computed in fp32 and written back with stochastic
        rounding keyed by (``rounding_seed``, default ``seed``; the table's update count;
        full table name, row, column) (embeddings/rounding.py).

        In host memory the weight and the per-row state are on 2 MiB pages where the
        kernel grants them (embeddings/huge_pages.py)."""
        super().__init__()
        table_origin = table_origin or {}
        init_dim = init_dim or {}
        self.tables = list(tables)
        self.dim, self.pooling, self.weight_dtype = _one_layout(self.tables)
        self.rounding_seed = (seed or 0) if rounding_seed is None else rounding_seed
        if self.weight_dtype != torch.float32:
            optimizer.rounding = True
        self.features = [f for t in self.tables for f in t.features]
        if len(set(self.features)) != len(self.features):
            raise ValueError("a feature is served by two tables")
        self.optimizer = optimizer
        self.fused = fused
        self.lr = 0.0
        self.kernels = KernelChoice(kernels)
        self._lr_on_device: torch.Tensor | None = None  # the Triton update reads lr here
        device = torch.device(device)

        self.row_offsets: dict[str, int] = {}
        total = 0
        for t in self.tables:
            self.row_offsets[t.name] = total
            total += t.rows
        self.total_rows = total
        table_of = {f: t for t in self.tables for f in t.features}
        # Offset of each feature's table, in feature order: shifts ids into the stack.
        self.register_buffer(
            "feature_offsets",
            torch.tensor([self.row_offsets[table_of[f].name] for f in self.features],
                         dtype=torch.int64, device=device),
            persistent=False,
        )

        weight, initial_state = self._allocate(device)
        if seed is not None:
            self._initial_rows(weight, seed, table_origin, init_dim)
        # requires_grad so autograd calls our backward; its .grad stays None.
        self.weight = nn.Parameter(weight)
        self._state_names = list(initial_state)
        for name, tensor in initial_state.items():
            self.register_buffer(f"optim_{name}", tensor)
        self._kept: list[KVGradient] = []
        self._rounding_keys(table_origin, device)
        rounding_cpu.compile_for(device, self.weight_dtype, [t.dtype for t in initial_state.values()])

    def _allocate(self, device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The stacked weight (not filled) and the optimizer's zero state; running out of
        memory for either is one line naming it and its bytes."""
        total, largest = self.total_rows, max(self.tables, key=lambda t: t.rows)
        stacked = (f"table {largest.name} ({total:,} rows x {self.dim})" if len(self.tables) == 1 else
                   f"{len(self.tables)} stacked tables ({total:,} rows x {self.dim}; the largest: "
                   f"{largest.name}, {largest.rows:,} rows)")
        itemsize = self.weight_dtype.itemsize
        with naming_oom(f"the embedding weight of {stacked}", total * self.dim * itemsize, device):
            weight = torch.empty(total, self.dim, device=device, dtype=self.weight_dtype)
            advise_huge_pages(weight)  # before the first write: rows are touched at random
        state_bytes = total * self.optimizer.state_bytes_per_row(self.dim)
        with naming_oom(f"the {type(self.optimizer).__name__} state of {stacked}", state_bytes, device):
            state = self.optimizer.init_state(total, self.dim, device)  # on 2 MiB pages too
        return weight, state

    def _initial_rows(self, weight: torch.Tensor, seed: int, table_origin: dict[str, tuple[str, int, int, int]],
                      init_dim: dict[str, int]) -> None:
        """Fill ``weight`` with every table's (or shard's slice of its table's) initial rows."""
        for t in self.tables:
            start = self.row_offsets[t.name]
            init_name, init_rows_total, r0, c0 = table_origin.get(t.name, (t.name, t.rows, 0, 0))
            with naming_oom(f"the initial rows of table {t.name}", t.bytes, weight.device):
                init_rows(init_name, init_rows_total, init_dim.get(t.name, t.dim), seed,
                          r0, r0 + t.rows, c0, c0 + t.dim, out=weight[start : start + t.rows])

    def _rounding_keys(self, table_origin: dict[str, tuple[str, int, int, int]], device: torch.device) -> None:
        """Per table of the stack: first stacked row, key of the full table, its first
        row and column there (a shard's offsets): stacked id → rounding coordinates."""
        self._rounding: RowRounding | None = None  # the last update's (fp16 overflow check)
        self._rounded_ids = torch.zeros(0, dtype=torch.int64)
        starts, keys, rows0, cols0 = [], [], [], []
        for t in self.tables:
            name, _, r0, c0 = table_origin.get(t.name, (t.name, t.rows, 0, 0))
            starts.append(self.row_offsets[t.name])
            keys.append(table_key(name))
            rows0.append(r0)
            cols0.append(c0)
        # per feature, for the Triton update (a run's feature names its table)
        index = {t.name: i for i, t in enumerate(self.tables)}
        of_feature = [index[t.name] for f in self.features for t in self.tables if f in t.features]
        by_feature = {
            "_sr_feature_keys": [keys[i] for i in of_feature],
            "_sr_feature_row_shift": [rows0[i] - starts[i] for i in of_feature],
            "_sr_feature_cols0": [cols0[i] for i in of_feature],
        }
        for buf, values in (("_sr_starts", starts), ("_sr_keys", keys), ("_sr_rows0", rows0),
                            ("_sr_cols0", cols0), *by_feature.items()):
            self.register_buffer(buf, torch.tensor(values, dtype=torch.int64, device=device), persistent=False)
        self._overflow_features: dict[str, list[str]] = {}  # counts buffer -> the features it counts
        self._overflow_said: set[str] = set()  # tables warned of (the Triton path)
        self._count_overflow_of("overflow_counts", self.features, device)

    def _count_overflow_of(self, buffer: str, features: list[str], device: torch.device) -> None:
        """The Triton update's fp16 overflow counts, per feature of its batches (``features``),
        made here, not at the first step: a captured graph must not zero them per replay."""
        self.register_buffer(buffer, torch.zeros(len(features), dtype=torch.int32, device=device),
                             persistent=False)
        self._overflow_features[buffer] = list(features)

    def _round_rows(self, ids: torch.Tensor) -> RowRounding:
        """Where stacked ``ids`` sit in their full tables: the stochastic rounding's
        coordinates for this update (kept to read its fp16 overflow afterwards)."""
        t = torch.searchsorted(self._sr_starts, ids, right=True) - 1
        self._rounded_ids = ids
        self._rounding = RowRounding(self.weight_dtype, self.rounding_seed, int(self.state["rounding_step"]),
                                     self._sr_keys[t], ids - self._sr_starts[t] + self._sr_rows0[t],
                                     self._sr_cols0[t])
        return self._rounding

    def warn_fp16_overflow(self) -> None:
        """The Triton path's fp16 overflow warning: one line per table whose update
        rounded finite values to inf, said once, with the same text as the torch path
        (which warns at its update). Reads the kernel's per-feature counts from the
        device: call it where the host waits for the device anyway (the trainer's log,
        checkpoint and end of training)."""
        if self.weight_dtype != torch.float16 or not self.on_triton():
            return
        table_of = {f: t.name for t in self.tables for f in t.features}
        counts: list[int] = []
        tables: list[str] = []
        for buffer, features in self._overflow_features.items():
            counts += self.get_buffer(buffer).tolist()
            # another stack's features (a routed batch) never count: no table of ours
            tables += [table_of.get(f, "") for f in features]
        say_fp16_overflow(counts, tables, self._overflow_said)

    def _warn_overflow(self) -> None:
        """One line per fp16 table whose update overflowed (finite values became inf)."""
        rounding, ids, self._rounding = self._rounding, self._rounded_ids, None
        if rounding is None or rounding.overflow is None or not bool(rounding.overflow.any()):
            return
        t = torch.searchsorted(self._sr_starts, ids, right=True) - 1
        for i in t[rounding.overflow].unique().tolist():
            rows = ids[rounding.overflow & (t == i)]
            warn_once(fp16_overflow(self.tables[i].name, self.weight.data.index_select(0, rows)) or "")

    # ------------------------------------------------------------------ forward
    def forward(self, sparse: KeyedJagged) -> torch.Tensor:
        values, lengths, batch = in_feature_order(sparse, self.features)
        if self.on_triton():
            return self._triton_pool(values, lengths, batch, feature_major=False)
        num_features = len(self.features)
        ids = stacked_ids(values, lengths, self.feature_offsets, batch)
        # Bags in sample-major order (b0f0, b0f1, .., b1f0, ..): the pooled rows then
        # come out as [B, F*D] already, instead of [F, B, D] copied by a transpose.
        order = torch.arange(num_features * batch, device=ids.device)
        order = order.view(num_features, batch).t().flatten()
        lengths, ids = permute_bags(lengths, ids, order)
        return self._pool(ids, lengths).view(batch, num_features * self.dim)

    def lookup(self, values: torch.Tensor, lengths: torch.Tensor, batch: int) -> torch.Tensor:
        """Feature-major jagged ids (lengths [F*B]) → pooled [F, B, D]."""
        if self.on_triton():
            return self._triton_pool(values, lengths, batch, feature_major=True)
        ids = stacked_ids(values, lengths, self.feature_offsets, batch)
        return self._pool(ids, lengths).view(len(self.features), batch, self.dim)

    def _pool(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Pooled [S, D] of the bags ``lengths`` [S] over stacked ``ids``."""
        offsets = bag_offsets(lengths)
        scale = None
        if self.pooling is Pooling.MEAN:
            inv = 1.0 / lengths.clamp(min=1).to(torch.float32)
            scale = torch.repeat_interleave(inv, lengths, output_size=ids.numel())
        return pooled_lookup(self.weight, ids, offsets, self._receive, scale)

    # ------------------------------------------------------------------ Triton path
    def on_triton(self) -> bool:
        """Whether lookups take the Triton kernels (embeddings/kernels) on this device.
        fp16/bf16 tables too: the kernels pool in fp32 and the fused update writes rows
        with the same stochastic rounding as the torch path (kernels/rounding.py). Half
        optimizer state (``embeddings.state_dtype``) too: read in its type, computed in
        fp32 and written back with the torch path's stochastic rounding."""
        return use_triton(self.kernels, self.weight.device)

    def _triton_pool(self, values: torch.Tensor, lengths: torch.Tensor, batch: int,
                     feature_major: bool, route: FeatureRoute | None = None) -> torch.Tensor:
        """The bags as they come (feature-major), pooled by one kernel launch straight
        into [B, F*D] (or [F, B, D]): no permutation, no stacked-id tensor; the backward
        sorts once and applies the optimizer in the same kernel when fused. ``route``:
        the batch's features are those of several stacks (``pooled_among``)."""
        from embeddings.kernels.lookup import Bags, triton_pooled_lookup  # imports triton

        self._device_scalars()
        bags = Bags(values, bag_offsets(lengths), self.feature_offsets if route is None else route.row_base,
                    batch, self.pooling is Pooling.MEAN, feature_major, route)
        with section("lookup"):
            return triton_pooled_lookup(self.weight, bags, self._triton_backward)

    def route_among(self, features: list[str]) -> FeatureRoute:
        """This stack's place in a batch of ``features``, its own among other stacks'
        (embeddings/dtype_stacks.py): row bases (-1 where another stack serves the
        feature) and rounding coordinates per feature, on this stack's device."""
        from embeddings.kernels.lookup import FeatureRoute

        mine = {f: i for i, f in enumerate(self.features)}
        index = torch.tensor([mine.get(f, -1) for f in features], device=self.feature_offsets.device)
        known, at = index >= 0, index.clamp(min=0)

        def pick(per_feature: torch.Tensor, other: int) -> torch.Tensor:
            return torch.where(known, per_feature[at], torch.full_like(per_feature[at], other))

        self._count_overflow_of("overflow_counts_routed", features, self.feature_offsets.device)
        return FeatureRoute(pick(self.feature_offsets, -1), pick(self._sr_feature_keys, 0),
                            pick(self._sr_feature_row_shift, 0), pick(self._sr_feature_cols0, 0))

    def pooled_among(self, values: torch.Tensor, lengths: torch.Tensor, batch: int,
                     route: FeatureRoute) -> torch.Tensor:
        """[B, F*D] of a feature-major batch of ``route``'s F features (Triton path):
        this stack's features pooled, zeros in the other stacks' columns; the backward
        updates this stack's rows only. No shape depends on the data."""
        return self._triton_pool(values, lengths, batch, feature_major=False, route=route)

    def _triton_backward(self, grad_pooled: torch.Tensor, bags: Bags) -> None:
        from embeddings.kernels.sparse_update import backward_kv, backward_update

        args = (grad_pooled, bags.values, bags.offsets, bags.row_base, bags.batch, bags.mean,
                bags.feature_major)
        if self.fused:
            assert self._lr_on_device is not None
            with section("embedding_update"):
                backward_update(*args, self.weight.data, self.optimizer, self.state, self._lr_on_device,
                                self._kernel_rounding(bags.route))
        else:
            with section("lookup"):
                self._receive(backward_kv(*args))

    def _kernel_rounding(self, route: FeatureRoute | None = None) -> KernelRounding | None:
        """The rounding of a half weight or half element-wise state for the fused Triton
        update: the update count goes up on the device (no host value in the launch;
        graphs replay it). It counts wherever the torch path counts (an fp32 stack beside
        half ones too), so both paths keep the same state."""
        if not self.optimizer.rounding:
            return None
        from embeddings.kernels.rounding import KernelRounding

        self.state["rounding_step"].add_(1)
        if route is not None:  # the batch's features, this stack's among others'
            return KernelRounding(self.rounding_seed, self.state["rounding_step"], route.keys, route.row_shift,
                                  route.col0, overflow=self.overflow_counts_routed)
        return KernelRounding(self.rounding_seed, self.state["rounding_step"], self._sr_feature_keys,
                              self._sr_feature_row_shift, self._sr_feature_cols0, overflow=self.overflow_counts)

    def _device_scalars(self) -> None:
        """lr and per-table scalar state (Adam's step) on the weight's device, where the
        update kernel reads them: no host value enters a launch, so nothing waits and a
        captured graph replays with the current values. Moved once, not per step."""
        device = self.weight.device
        if self._lr_on_device is None or self._lr_on_device.device != device:
            self._lr_on_device = torch.full((1,), self.lr, dtype=torch.float32, device=device)
        for name, tensor in self.state.items():
            if tensor.device != device:
                self.register_buffer(f"optim_{name}", tensor.to(device))

    # ------------------------------------------------------------------ updates
    @property
    def state(self) -> dict[str, torch.Tensor]:
        """Optimizer state tensors (buffers, so they follow ``.to(device)``)."""
        return {name: self.get_buffer(f"optim_{name}") for name in self._state_names}

    def _receive(self, grad: KVGradient) -> None:
        if self.fused:
            self.apply_gradient(grad)
        else:
            self._kept.append(grad)

    def set_lr(self, lr: float) -> None:
        self.lr = lr
        if self._lr_on_device is not None:
            self._lr_on_device.fill_(lr)  # a device-side fill: no host wait

    def step(self) -> None:
        if not self.fused:
            self.apply_gradient(self.take_gradient())

    def take_gradient(self) -> KVGradient:
        """The kept gradient of the stacked weight (ids across tables), then forget it."""
        if self._kept:
            grad = KVGradient.cat(self._kept)
        else:
            grad = KVGradient.empty(self.dim, self.weight.device)
        self._kept = []
        return grad

    def apply_gradient(self, grad: KVGradient, row_sq_mean: torch.Tensor | None = None,
                       count: bool = True) -> None:
        """One optimizer step with ``grad`` (an empty one still counts as a step);
        ``row_sq_mean``: see ``SparseOptimizer.apply``. ``count`` False: a later part
        of a step whose first part counted it (the rounding step and Adam's)."""
        with section("embedding_update"):
            rounder = None
            if self.optimizer.rounding:  # half weight or state; an fp32 stack beside half ones counts too
                if count:
                    self.state["rounding_step"] += 1
                rounder = self._round_rows  # an fp32 weight ignores it; a half state rounds with it
            if not len(grad):  # no row to touch: the step only counts (a host tier's empty update)
                if count:
                    self.optimizer.count_step(self.state)
                return
            self.optimizer.apply(self.weight.data, self.state, grad, self.lr, row_sq_mean=row_sq_mean,
                                 rounder=rounder, count=count)
            if self.weight_dtype == torch.float16:
                self._warn_overflow()

    def kv_gradients(self) -> dict[str, KVGradient]:
        if not self._kept:
            return {}
        grad = KVGradient.cat(self._kept)
        out = {}
        for t in self.tables:
            start = self.row_offsets[t.name]
            part = grad.slice_rows(start, start + t.rows)
            if len(part):
                out[t.name] = part
        return out

    # ------------------------------------------------------------------ state
    def export_tables(self) -> dict[str, torch.Tensor]:
        out = {}
        for t in self.tables:
            start, end = self.row_offsets[t.name], self.row_offsets[t.name] + t.rows
            out[f"{t.name}.weight"] = self.weight.data[start:end]
            for name, tensor in self.state.items():
                # Per-row state is cut per table; scalar state (Adam's step) is shared.
                out[f"{t.name}.{name}"] = tensor[start:end] if tensor.shape[0] == self.total_rows else tensor
        return out

    def import_tables(self, tensors: dict[str, torch.Tensor]) -> None:
        mine = self.export_tables()
        missing = sorted(set(mine) - set(tensors))
        if missing:
            raise KeyError(f"embedding state lacks {missing[0]}")
        with torch.no_grad():
            for key, dst in mine.items():
                src = tensors[key]
                if src.shape != dst.shape:
                    raise ValueError(f"{key}: shape {tuple(src.shape)} != {tuple(dst.shape)}")
                if dst.dtype == torch.float16 and key.endswith(".weight") and src.dtype != torch.float16:
                    said = fp16_overflow(key.removesuffix(".weight"), src)
                    if said:
                        warn_once(said)
                dst.copy_(src)

    def table_state(self) -> TableState:
        """Every table whole: one table-wise shard each, on this (the only) rank."""
        tensors = self.export_tables()
        held, sharding = [], {}
        for spec in self.tables:
            whole = Shard(spec.name, 0, 0, spec.rows, 0, spec.dim)
            prefix = f"{spec.name}."
            held.append((whole, {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}))
            sharding[spec.name] = (ShardingType.TABLE_WISE, [whole])
        return TableState(self.tables, held, sharding, self.optimizer)


def warn_fp16_overflow(model: nn.Module) -> None:
    """``warn_fp16_overflow`` of every module of ``model`` that counts fp16 overflow (a
    local collection: a stack, a shard store, a dtype's stack; a Hotline hot tier): a
    host read of fp16 tables' overflow counts."""
    for module in model.modules():
        if isinstance(module, Fp16OverflowCounter):
            module.warn_fp16_overflow()


def _one_layout(tables: list[TableSpec]) -> tuple[int, Pooling, torch.dtype]:
    """The dim, pooling and weight type that the tables of one stack share."""
    dims = {t.dim for t in tables}
    if len(dims) != 1:
        raise ValueError(f"one collection needs one embedding dim, got {sorted(dims)}")
    dtypes = {t.dtype for t in tables}
    if len(dtypes) != 1:
        raise ValueError(f"one collection needs one table dtype, got {sorted(dtypes)}")
    poolings = {t.pooling for t in tables}
    if len(poolings) != 1:
        raise ValueError("one collection needs one pooling mode")
    return dims.pop(), Pooling(poolings.pop()), weight_dtype(dtypes.pop())


class AllocationError(UserError):
    """A table or buffer that does not fit this process's memory."""


@contextmanager
def naming_oom(what: str, nbytes: int, device: torch.device) -> Iterator[None]:
    """Turn an allocator's out-of-memory error into one line naming ``what``."""
    try:
        yield
    except RuntimeError as e:  # torch.OutOfMemoryError (CUDA) is one too
        text = str(e)
        if not isinstance(e, torch.OutOfMemoryError) and not any(
            s in text for s in ("can't allocate memory", "not enough memory", "out of memory")
        ):
            raise
        rank = f"rank {dist.get_rank()}: " if dist.is_available() and dist.is_initialized() else ""
        asked = re.search(r"tried to allocate (\d+) bytes", text)
        also = (f"; the allocator was asked for {format_bytes(int(asked.group(1)))}"
                if asked and int(asked.group(1)) != nbytes else "")
        raise AllocationError(
            f"{rank}out of memory allocating {what}: {format_bytes(nbytes)} on {device}{also}"
        ) from None
