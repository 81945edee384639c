"""Hotline's lookup with every shape fixed by the batch: what a captured step reads.

    split of mini-batch t (split.py)            host gather of its U cold rows (host_local.py)
        │ is_hot, slot, cold_local [N]             │ rows [U, D] on the device (copy stream)
        ▼ copied into (``load``)                   ▼ copied into rows 0..U-1
    StaticLookups   is_hot, slot, cold_local [N], lengths [F*B], cold_rows [C, D]
        │ forward   kernels/two_tier.py: one launch over both tiers
        │ backward  one sort of both tiers' lookups (kernels/two_tier.py, tier_ids);
        │           hot rows: the fused update (as the eager step's held one, in the kernel);
        │           cold rows: their gradient by cold row into cold_grad [C, D]
        ▼
    after the step: cold_grad[:U] D2H to the host tier (its update thread applies it);
    or, staged (cold_stage.py: hotline.cold_update=device, the default), the cold rows
    patched, updated on the device and rows[:U] with their state D2H, stored as they are

F*B and the capacity C (lookups and cold rows: U <= N, at most every lookup cold and
distinct) are the captured batch's, so a CUDA graph of the whole step
(dlrm/train/hotline_graph.py) replays for any split of a batch of B samples and at
most C lookups: C = N single-hot, N + N/4 multi-hot (N varies by batch). Lookups
past a batch's N are stale and never read (no bag reaches them; the update's sort
puts them last, unapplied), nor are cold rows past U (every cold lookup's
``cold_local`` is below U; the host reads ``cold_grad[:U]`` only).

Exact as the eager step: the same rows, the same sums (the update's kernels sum
each run in lookup order), one optimizer step per tier per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from embeddings.hotline.cold_stage import ColdStage
from embeddings.jagged import bag_offsets

if TYPE_CHECKING:
    from collections.abc import Callable

    from data.jagged import JaggedFeatures
    from embeddings.hotline.hot_tier import HotTier
    from embeddings.hotline.lookups import ColdRows
    from embeddings.hotline.split import DeviceSplit, JointSplit


@dataclass
class StaticLookups:
    """A captured step's lookup buffers (see the module docstring)."""

    is_hot: torch.Tensor  # [N] bool
    slot: torch.Tensor  # [N] int64, read where hot
    cold_local: torch.Tensor  # [N] int64, read where cold
    lengths: torch.Tensor  # [F*B] int64
    cold_rows: torch.Tensor  # [C, D] the tables' dtype, first U staged
    cold_grad: torch.Tensor  # [C, D] fp32, first U written by the backward
    batch: int
    num_features: int
    stage: ColdStage | None = None  # the cold rows updated on the device (cold_stage.py)

    @classmethod
    def like(cls, split: DeviceSplit, dim: int, dtype: torch.dtype,
             stage: Callable[[int], ColdStage] | None = None) -> StaticLookups:
        """Buffers for batches of ``split``'s shapes (not its values: ``load`` copies
        them): B samples, F features, N lookups; multi-hot (N varies by batch) a
        quarter more lookups, so most later batches fit too. ``stage(capacity)``: the
        cold rows' stage (cold_stage.py; None: their gradient goes home)."""
        lookups = split.lookups
        n, device = lookups.ids.numel(), lookups.ids.device
        bags = lookups.lengths.numel()
        capacity = max(n if n == bags else n + n // 4, 1)
        return cls(torch.zeros(capacity, dtype=torch.bool, device=device),
                   torch.zeros(capacity, dtype=torch.int64, device=device),
                   torch.zeros(capacity, dtype=torch.int64, device=device), torch.zeros_like(lookups.lengths),
                   torch.zeros(capacity, dim, dtype=dtype, device=device),
                   torch.zeros(capacity, dim, dtype=torch.float32, device=device),
                   lookups.batch, lookups.num_features, None if stage is None else stage(capacity))

    @property
    def capacity(self) -> int:
        """Lookups (and cold rows) the buffers hold."""
        return self.is_hot.numel()

    def fits(self, batch: int, features: int, lookups: int) -> bool:
        """Whether a batch of ``batch`` samples, ``features`` features and ``lookups``
        ids fits these buffers."""
        return batch == self.batch and features == self.num_features and lookups <= self.capacity

    def fits_batch(self, sparse: JaggedFeatures) -> bool:
        """``fits`` for a host batch's sparse features."""
        return self.fits(sparse.stride(), len(sparse.keys()), sparse.values().numel())

    def load(self, split: DeviceSplit, cold: ColdRows | None) -> None:
        """``split``'s lookups and ``cold``'s U rows (None: no cold lookup) copied in,
        on the current stream (device to device; the cold rows' copy waits for their
        H2D copy's event, the host does not)."""
        lookups = split.lookups
        n = lookups.ids.numel()  # past n: stale, never read (no bag reaches them)
        self.is_hot[:n].copy_(lookups.is_hot, non_blocking=True)
        self.slot[:n].copy_(lookups.slot, non_blocking=True)
        self.cold_local[:n].copy_(split.cold_local, non_blocking=True)
        self.lengths.copy_(lookups.lengths, non_blocking=True)
        staged = cold is not None and cold.rows.shape[0] > 0
        if staged and cold.rows.device.type == "cuda":  # copied on the gather's side stream
            current = torch.cuda.current_stream(cold.rows.device)
            if cold.ready is not None:
                current.wait_event(cold.ready)
            for t in [cold.rows, *(cold.state or {}).values()]:
                t.record_stream(current)
        if self.stage is not None:
            self.stage.load(cold.ids if staged else None, cold.state if staged else None)
        if staged:
            self.cold_rows[:cold.rows.shape[0]].copy_(cold.rows.detach(), non_blocking=True)


@dataclass
class MixedStatic:
    """A captured step's buffers for tables of several dtypes: one ``StaticLookups`` per
    dtype group (embeddings/hotline/mixed.py), each with its group's lookups and cold
    rows in its type; ``features`` [g]: group g's features (a host batch's lookups per
    group, for ``fits_batch``)."""

    parts: list[StaticLookups]
    features: list[list[str]]

    def fits_batch(self, sparse: JaggedFeatures) -> bool:
        """Whether a host batch fits every group's buffers (its lookups counted per group
        from the host lengths: no device read)."""
        batch = sparse.stride()
        if any(batch != part.batch for part in self.parts):
            return False
        per_feature = dict(zip(sparse.keys(), sparse.length_per_key(), strict=True))
        return all(set(names) <= per_feature.keys() and part.fits(batch, len(names), sum(per_feature[f] for f in names))
                   for part, names in zip(self.parts, self.features, strict=True))

    def load(self, split: JointSplit, cold: Any) -> None:
        """Each group's part of ``split`` (a ``JointSplit``) and of ``cold`` (a
        ``GroupCold``, or None: no cold lookup) copied in, as ``StaticLookups.load``."""
        for i, (part, group_split) in enumerate(zip(self.parts, split.parts, strict=True)):
            part.load(group_split, None if cold is None else cold.parts[i])  # one process: ColdRows


def static_pooled(hot: HotTier, static: StaticLookups, mean: bool) -> torch.Tensor:
    """Pooled [B, F*D] of ``static``'s lookups over the hot tier and the staged cold
    rows; the backward updates the hot rows and writes the cold rows' gradient."""
    from embeddings.kernels.two_tier import two_tier_lookup  # imports triton

    offsets = bag_offsets(static.lengths)
    if static.stage is not None:  # rows the last static step updated: its results
        static.stage.patch(static.cold_rows)
    backward = partial(_backward, hot, static, offsets, mean)
    return two_tier_lookup(hot.weight, static.cold_rows, static.is_hot, static.slot, static.cold_local,
                           offsets, static.num_features, static.batch, mean, backward)


def _backward(hot: HotTier, static: StaticLookups, offsets: torch.Tensor, mean: bool,
              grad_pooled: torch.Tensor) -> None:
    """One pass of the update's kernels over the bags, both tiers' lookups in one key
    space (one sort): the hot rows updated, the cold rows' gradient by cold row."""
    from embeddings.kernels.two_tier import tier_ids

    ids = tier_ids(static.is_hot, static.slot, static.cold_local, hot.weight.shape[0])
    hot.update_static(grad_pooled, ids, offsets, static.num_features, static.batch, mean, static.cold_grad)
    stage = static.stage
    if stage is not None:
        hot.update_staged(stage, static.cold_rows, static.cold_grad)
        stage.keep(static.cold_rows)
