"""What the model, the trainer and the checkpoint see of an embedding collection.

Every placement is used through this one interface: one process
(``collection.py``), sharded over ranks (``sharded.py``), Hotline's two tiers
(``hotline/``). Nobody asks which kind of collection it is.

    lookup     start(sparse) ─► handle ─► finish(handle) ─► pooled [B, F*D]
               (sharded: the ids all-to-all is in flight between the two calls, so
               the model runs its bottom MLP meanwhile; one process: nothing to wait for)
    training   set_lr(lr) · forward + backward (KV gradients: applied at once when
               fused, else kept) · step() (applies kept gradients)
    checkpoint table_state() ─► TableState (live views of this rank's shards) ─► written;
               loaded in place, then tables_loaded() (Hotline: hot rows re-read)

A sparse input is ``KeyedJagged`` (our ``data.jagged.JaggedFeatures``, or TorchRec's
``KeyedJaggedTensor``: the same accessors), or a ``Prefetched`` one: the same ids
with rows a collection gathered for them ahead of time (Hotline's cold rows, gathered
by a host thread while the previous micro-batch ran).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    import torch.distributed as dist

    from data.jagged import KeyedJagged
    from embeddings.kv import KVGradient
    from embeddings.optim import SparseOptimizer
    from embeddings.plan.types import Shard, ShardingPlan, ShardingType
    from embeddings.table import TableSpec


@dataclass
class Prefetched:
    """``sparse`` with ``rows``: what a collection gathered for exactly these ids
    ahead of time (for Hotline: its cold rows, or ``HOT_ONLY``)."""

    sparse: KeyedJagged
    rows: Any


@dataclass
class TableState:
    """What a collection holds of its tables on this rank, as live tensors: a
    checkpoint writes them and loads into them in place.

        held      [(shard, {"weight": [rows, cols], <optimizer state>: ...}), ...]
        sharding  table → (strategy, every rank's shards of it)

    One process holds every table whole (one table-wise shard on rank 0, no plan).
    """

    tables: list[TableSpec]
    held: list[tuple[Shard, dict[str, torch.Tensor]]]
    sharding: dict[str, tuple[ShardingType, list[Shard]]]
    optimizer: SparseOptimizer
    plan: ShardingPlan | None = None  # recorded in the checkpoint; None: one process
    group: dist.ProcessGroup | None = None  # None: one process, no collectives


class PooledEmbeddings(Protocol):
    """Pooled embeddings of ``features`` (in this order), each ``dim`` wide."""

    features: list[str]
    dim: int
    plan: ShardingPlan | None  # which rank holds what; None: every table in this process

    def start(self, sparse: KeyedJagged | Prefetched) -> Any:
        """Begin the lookup of a batch; the handle goes to :meth:`finish`."""
        ...

    def finish(self, started: Any) -> torch.Tensor:
        """Pooled [B, len(features) * dim] of a started batch."""
        ...

    def set_lr(self, lr: float) -> None: ...

    def step(self) -> None:
        """Apply kept KV gradients (nothing when fused)."""
        ...

    def kv_gradients(self) -> dict[str, KVGradient]:
        """Kept (not yet applied) gradients per table, ids local to the table."""
        ...

    def table_state(self) -> TableState:
        """This rank's tables and optimizer state as live tensors (up to date)."""
        ...

    def tables_loaded(self) -> None:
        """Called after a checkpoint was loaded into :meth:`table_state`'s tensors."""
        ...

    def export_tables(self) -> dict[str, torch.Tensor]:
        """``{table}.weight`` and ``{table}.{optimizer state}`` (per shard when sharded)."""
        ...

    def import_tables(self, tensors: dict[str, torch.Tensor]) -> None: ...


@runtime_checkable
class HotSetHolder(Protocol):
    """A Hotline collection as a checkpoint sees it: its hot set (one sorted tensor of
    stacked ids per dtype group), reloaded after its tables on resume, and
    ``refresh_state``, the trainer's refresh inputs (dlrm/train/hotline.py), kept with
    it. Both change a run's micro-batches, so a resume equal to a run never stopped
    needs both."""

    refresh_state: dict[str, Any] | None

    def hot_ids_by_group(self) -> list[torch.Tensor]: ...

    def load_hot_ids(self, ids: list[torch.Tensor]) -> None: ...
