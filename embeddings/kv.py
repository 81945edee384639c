"""Key-value gradients: the gradient of an embedding table as (unique ids, rows).

A step touches a few thousand rows of tables with millions; the gradient is kept
as those rows only, never as a dense table-sized tensor:

    lookups   ids  [N]      = [7, 3, 7, 9]        one entry per id looked up
              rows [N, D]   = [g0, g1, g2, g3]    d loss / d (that lookup's row)
                  │ coalesce: unique + index_add
                  ▼
    KVGradient ids  [U]     = [3, 7, 9]           unique, ascending
               rows [U, D]  = [g1, g0+g2, g3]

This is what sparse optimizers apply, what replicated tables exchange between
ranks, and what Hotline sends back to host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVGradient:
    ids: torch.Tensor  # [U] int64, unique, ascending
    rows: torch.Tensor  # [U, D]

    @staticmethod
    def from_lookups(ids: torch.Tensor, rows: torch.Tensor) -> KVGradient:
        """Sum the gradient rows of repeated ids. ids [N], rows [N, D]."""
        unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        summed = rows.new_zeros((unique.numel(), rows.shape[1]))
        summed.index_add_(0, inverse, rows)
        return KVGradient(unique, summed)

    @staticmethod
    def cat(grads: list[KVGradient]) -> KVGradient:
        """Merge several gradients of one table (accumulation, all-gather)."""
        if len(grads) == 1:
            return grads[0]
        return KVGradient.from_lookups(
            torch.cat([g.ids for g in grads]), torch.cat([g.rows for g in grads])
        )

    @property
    def dim(self) -> int:
        return int(self.rows.shape[1])

    def __len__(self) -> int:
        return int(self.ids.numel())

    def slice_rows(self, start: int, end: int) -> KVGradient:
        """The part of this gradient for rows [start, end), rebased to start at 0."""
        lo = int(torch.searchsorted(self.ids, start))
        hi = int(torch.searchsorted(self.ids, end))
        return KVGradient(self.ids[lo:hi] - start, self.rows[lo:hi])
