"""What the hot tier asks of the host tier: the interface of both implementations.

    LocalHostTier (host_local.py)      one process: every row in one stacked
                                       LocalEmbeddingCollection; cold rows gathered
                                       and copied to the device (ColdRows)
    ShardedHostTier (host_sharded.py)  several ranks: rows sharded over the ranks'
                                       host memory by a plan; cold bags looked up by
                                       all-to-all (ColdPooled)

Rows are named by stacked ids (all tables one after another, in table order).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from embeddings.collection import EmbeddingCollection
from embeddings.hotline.hot_tier import HotTier
from embeddings.hotline.lookups import ColdPooled, ColdRows
from embeddings.hotline.split import MicroLookups
from embeddings.kv import KVGradient

if TYPE_CHECKING:
    from embeddings.plan.types import ShardingPlan


class HostTier(Protocol):
    """Every row and its optimizer state in host memory, authoritative for the cold rows."""

    collection: EmbeddingCollection  # the tables: exported, imported, checkpointed
    plan: ShardingPlan | None  # how they are sharded (several ranks), else None
    collective: bool  # whether cold lookups are collectives (every rank takes part)
    gather_threads: int  # host threads of ours in one cold gather (0: one call over torch's intra-op threads)
    device: torch.device  # the home of the rows: cold gradients go here

    def read_rows(
        self, stacked_ids: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Rows [H, D] of sorted ``stacked_ids`` and their optimizer state, on
        ``device`` (several ranks: a collective)."""
        ...

    def write_rows(
        self, stacked_ids: torch.Tensor, weight: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> None:
        """Rows ``weight`` [H, D] and their state written back (no communication)."""
        ...

    def write_rows_later(
        self, stacked_ids: torch.Tensor, weight: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> None:
        """``write_rows`` behind the host updates queued (one process: on their thread,
        the caller going on; several ranks: now). Readers of the rows see it."""
        ...

    def gather_cold(self, micro: MicroLookups, device: torch.device) -> ColdRows | ColdPooled:
        """What ``micro``'s cold part needs from the host, on ``device``."""
        ...

    def hot_part(self, micro: MicroLookups, hot: HotTier) -> torch.Tensor:
        """``micro``'s hot lookups pooled, [F*B, D] (what ``pool`` adds the cold part
        to): it needs no host row, so it may run before the cold rows arrive."""
        ...

    def pool(
        self, micro: MicroLookups, hot: HotTier, cold: ColdRows | ColdPooled | None,
        hot_part: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, int]:
        """(pooled [B, F*D] of hot and cold parts, cold rows used); ``cold`` None: the
        batch has no cold lookup; ``hot_part``: ``hot_part(micro, hot)``, made
        already. Cold gradients go home through autograd."""
        ...

    def has_kept(self) -> bool:
        """Whether cold gradients are waiting for ``step``."""
        ...

    def kv_gradients(self, hot: list[KVGradient]) -> dict[str, KVGradient]:
        """Kept gradients per table: ``hot`` (stacked ids) with the cold ones."""
        ...

    def set_lr(self, lr: float) -> None: ...

    def step(self) -> None:
        """Apply the kept cold gradients (once, even when empty: Adam counts steps)."""
        ...
