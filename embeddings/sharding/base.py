"""The contract of a sharding strategy (see the package docstring)."""

from __future__ import annotations

from typing import Protocol

import torch


class Router(Protocol):
    def route(
        self, ids: torch.Tensor, lengths: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """ids [N] of one feature, lengths [B] → per shard (lengths [B], ids)."""
        ...

    def combine(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """Per-shard pooled pieces (shard order) → pooled [B, D]."""
        ...
