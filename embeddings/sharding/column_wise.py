"""Column-wise: the dim is split across ranks; every id goes to every column
shard, and the pooled pieces are concatenated side by side.

    ids ──┬─► rank a: cols [0, 22)   ─► [B, 22] ─┐
          ├─► rank b: cols [22, 43)  ─► [B, 21] ─┼─► cat ─► [B, 64]
          └─► rank c: cols [43, 64)  ─► [B, 21] ─┘
"""

from __future__ import annotations

import torch


class ColumnWiseRouter:
    accumulates = False  # pieces sit side by side (embeddings/pooled_layout.py)

    def __init__(self, num_shards: int) -> None:
        self.num_shards = num_shards

    def route(self, ids: torch.Tensor, lengths: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(lengths, ids)] * self.num_shards
