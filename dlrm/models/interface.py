"""What the trainer, evaluation and checkpoints ask of a model: both backends (our
``DLRM`` over any embedding collection, and ``TorchRecDLRM``) answer the same calls.

    model(dense, sparse) ─► logits [B]
    begin_step(sparse_lr) · forward/backward (under no_sync() but on the step's last
    micro-batch) · dense optimizer step · end_step()
    state_for_checkpoint() ─► (tensors for state.pt, tables written shard by shard or None)
    restore(state, read_tables) ◄─ the same, read back
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from data.jagged import KeyedJagged
    from embeddings.interface import Prefetched, TableState
    from embeddings.plan.types import ShardingPlan


class RecModel(Protocol):
    """A trainable recommendation model, whatever its backend and placement."""

    def __call__(self, dense: torch.Tensor, sparse: KeyedJagged | Prefetched) -> torch.Tensor:
        """Logits [B] of dense [B, n_dense] and the sparse features of the same B samples."""
        ...

    @property
    def plan(self) -> ShardingPlan | None:
        """Where the embedding tables live across ranks (None: one process, or TorchRec's own)."""
        ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...

    def dense_parameters(self) -> list[torch.nn.Parameter]:
        """What the dense optimizer updates (and DDP synchronises)."""
        ...

    def begin_step(self, sparse_lr: float) -> None:
        """Before the step's first forward: the lr of the (possibly fused) sparse update."""
        ...

    def end_step(self) -> None:
        """After the step's last backward: apply kept embedding gradients."""
        ...

    def no_sync(self) -> AbstractContextManager:
        """A micro-batch that is not the step's last: no dense gradient all-reduce yet."""
        ...

    def state_for_checkpoint(self) -> tuple[dict[str, Any], TableState | None]:
        """Tensors for ``state.pt`` and the embedding tables to write shard by shard
        (None: they are in the first part, whole)."""
        ...

    def restore(self, state: dict[str, Any], read_tables: Callable[[TableState], None]) -> None:
        """Load :meth:`state_for_checkpoint`'s parts; ``read_tables`` fills a TableState
        in place. KeyError/ValueError name what does not fit."""
        ...

    def close(self) -> None:
        """Release what the model holds outside itself (TorchRec: its process group)."""
        ...
