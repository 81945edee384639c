"""Table-wise: the whole table on one rank; every id goes there, the pooled
vector comes back whole.

    feature f ids ──► rank k (holds all rows, all columns) ──► pooled [B, D]
"""

from __future__ import annotations

import torch


class TableWiseRouter:
    accumulates = False  # one piece (embeddings/pooled_layout.py)

    def route(self, ids: torch.Tensor, lengths: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(lengths, ids)]
