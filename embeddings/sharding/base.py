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

    # How per-shard pooled pieces (shard order) make the pooled [B, D]: added
    # (True) or side by side (False); done by embeddings/pooled_layout.py.
    accumulates: bool
