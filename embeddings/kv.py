"""Key-value gradients: the gradient of an embedding table as (unique ids, rows).

A step touches a few thousand rows of tables with millions; the gradient is kept
as those rows only, never as a dense table-sized tensor:

    lookups   ids  [N]      = [7, 3, 7, 9]        one entry per id looked up
              rows [N, D]   = [g0, g1, g2, g3]    d loss / d (that lookup's row)
                  │ coalesce: stable sort by id, then one segment sum
                  ▼
    KVGradient ids  [U]     = [3, 7, 9]           unique, ascending
               rows [U, D]  = [g1, g0+g2, g3]

This is what sparse optimizers apply, what replicated tables exchange between
ranks, and what Hotline sends back to host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class KVGradient:
    ids: torch.Tensor  # [U] int64, unique, ascending
    rows: torch.Tensor  # [U, D]

    @staticmethod
    def from_lookups(
        ids: torch.Tensor,
        rows: torch.Tensor,
        index: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ) -> KVGradient:
        """Sum the gradient rows of repeated ids. ids [N], rows [N, D].

        With ``index`` [N], lookup k's row is ``rows[index[k]]`` (scaled by
        ``weights[k]`` if given): a pooled gradient [S, D] is coalesced without
        first expanding it to one row per lookup.

        The sum is one ``embedding_bag`` over the lookups in (stable) id order:
        each id's rows are added in lookup order, as ``index_add_`` would, in one
        multi-threaded pass (``index_add_`` adds row by row on the CPU, which is
        slower for a step's lookups; the sums are bit-equal).
        """
        sorted_ids, order = torch.sort(ids, stable=True)
        unique, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
        offsets = torch.zeros(counts.numel() + 1, dtype=torch.long, device=ids.device)
        torch.cumsum(counts, 0, out=offsets[1:])
        source = order if index is None else index.index_select(0, order)
        summed = F.embedding_bag(
            source, rows, offsets, mode="sum", include_last_offset=True,
            per_sample_weights=None if weights is None else weights.index_select(0, order),
        )
        return KVGradient(unique, summed)

    @staticmethod
    def from_covering_lookups(
        ids: torch.Tensor,
        rows: torch.Tensor,
        num: int,
        index: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ) -> KVGradient:
        """``from_lookups`` where ``ids`` are known to cover 0..num-1 (every one used,
        as a batch's cold rows are): the unique ids are ``arange(num)`` and the counts a
        segment sum of known size, so nothing waits for the device (no
        ``unique_consecutive``). The same sums, bit for bit (the same embedding_bag)."""
        order = torch.sort(ids, stable=True).indices
        counts = torch.zeros(num, dtype=torch.int64, device=ids.device).index_add_(0, ids, torch.ones_like(ids))
        offsets = torch.zeros(num + 1, dtype=torch.long, device=ids.device)
        torch.cumsum(counts, 0, out=offsets[1:])
        source = order if index is None else index.index_select(0, order)
        summed = F.embedding_bag(
            source, rows, offsets, mode="sum", include_last_offset=True,
            per_sample_weights=None if weights is None else weights.index_select(0, order),
        )
        return KVGradient(torch.arange(num, device=ids.device), summed)

    @staticmethod
    def empty(dim: int, device: torch.device | str) -> KVGradient:
        """No rows: a step with no lookup (still applied: Adam counts it). fp32, as every
        gradient, whatever the table's type (a bf16 empty one stopped Adam's fp32 state)."""
        return KVGradient(torch.zeros(0, dtype=torch.int64, device=device),
                          torch.zeros(0, dim, dtype=torch.float32, device=device))

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
