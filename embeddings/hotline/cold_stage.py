"""A static Hotline step's cold rows updated on the device and written back to the host.

Before, the captured step wrote each staged cold row's gradient, the host tier applied
it on its update thread, and the next step's gather waited for that update to reread
the rows both steps share. On the 2026-11-27 H200 that chain (replay, gradient D2H,
host update, reread, H2D, launch) left the GPU idle for 2 of every 3.4 ms a step.
Here the device updates the staged rows itself and the host only stores them:

    step t, one replay (this module's parts marked *)          host
    * patch: staged rows that step t-1 also staged ◄─ prev (t-1's updated rows, state)
      two-tier lookup; backward: hot rows updated, cold rows' gradient [C, D]
    * update: the staged rows and their state, by the optimizer's own kernel
    * prev ← t's ids, rows, state
    after the replay: rows[:U], state[:U] D2H ────────────────► write-back thread:
                                                                index_copy into the tables
    gather of t+1 (during replay t): the host rows as they are; a row that t writes
    back may be read before or after its write: it is one that t+1 patches from prev.

Exact: each row's value after step t is the one the device computed (the host stores
it, never recomputes it), and step t+1 reads either the host's copy after every
earlier write or, for the rows step t updated, that update's own result. The patch
holds only while nothing else wrote host rows since this stage's write-back (an
eager step's update, a refresh, a sync of the hot rows): the host tier counts its
writes, and a stage whose count is behind forgets ``prev`` (``invalidate``); the
stale rows of such a step's gather are then read again on the host before use.

Per-table counts (Adam's step, the rounding step) are the hot tier's: each tier counts
every step once, so the host's equal them, and the host goes on counting its own (its
update of the static step is empty). Staged: every table type (fp16 and bf16 rounded
stochastically by the kernel at the rows' full-table coordinates; fp16's values the
rounding made inf counted into the hot tier's per-feature counts, at their table's first
feature, which its overflow warning reads), every optimizer.

The update is the hot rows' kernel over an identity layout, one "feature" per staged
row (batch 1), so each row has its own rounding key and full-table row:

    bag i = [i] for i < U, empty past U     values = 0..C-1     grad[i] = bag i's row
    keys[i], full_rows[i]: table key and full-table row of ids[i]

    ids         [C]     host stacked ids of the staged rows, ascending; SENTINEL past U
    state[name] [C] or [C, D]  their optimizer state, staged with them
    prev_*      the same, as the last static step left them (its first ``prev_count``)

The patch and the keep are one Triton launch each over the U staged rows
(embeddings/kernels/stage_rows.py: a binary search of the last step's ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embeddings.optim import SparseOptimizer

SENTINEL = torch.iinfo(torch.int64).max  # past U: above every id, so ``ids`` stays sorted


@dataclass
class ColdStage:
    """The staged cold rows' ids and state, and the last static step's (see the module
    docstring); the rows themselves are the static buffers' ``cold_rows``."""

    ids: torch.Tensor
    count: torch.Tensor  # [1] U
    state: dict[str, torch.Tensor]  # per row only (staged, patched, written back)
    prev_ids: torch.Tensor
    prev_count: torch.Tensor  # [1] how many of ``prev_ids`` hold the last step's
    prev_rows: torch.Tensor
    prev_state: dict[str, torch.Tensor]
    positions: torch.Tensor  # [C + 1] 0..C: the update's identity lookups and bounds
    zeros: torch.Tensor  # [C] each row's "feature" starts at row 0, column 0
    table_starts: torch.Tensor  # [T] each table's first stacked id
    table_keys: torch.Tensor  # [T] each table's rounding key
    keys: torch.Tensor  # [C] the staged rows' tables' keys (``locate``)
    full_rows: torch.Tensor  # [C] their rows in their full tables
    tables: torch.Tensor  # [C] their tables (``locate``)
    overflow: torch.Tensor | None = None  # [C] int32, fp16: each row's values rounded to inf
    serial: int = -1  # the host tier's write count after this stage's last write-back

    @classmethod
    def like(cls, capacity: int, dim: int, dtype: torch.dtype, optimizer: SparseOptimizer,
             device: torch.device, table_starts: torch.Tensor, table_keys: torch.Tensor) -> ColdStage:
        """Buffers for ``capacity`` staged rows of ``dim`` in ``dtype``; ``prev`` empty.
        ``table_starts``, ``table_keys`` [T]: the stack's tables (where a row's rounding
        coordinates come from)."""
        per_row = optimizer.per_row_state()  # the hot tier's counts are the ones counted
        state = {name: t for name, t in optimizer.init_state(capacity, dim, device).items() if name in per_row}
        overflow = torch.zeros(capacity, dtype=torch.int32, device=device) if dtype == torch.float16 else None

        def ids() -> torch.Tensor:
            return torch.full((capacity,), SENTINEL, dtype=torch.int64, device=device)

        def rows() -> torch.Tensor:
            return torch.zeros(capacity, dtype=torch.int64, device=device)

        return cls(ids(), torch.zeros(1, dtype=torch.int64, device=device), state, ids(),
                   torch.zeros(1, dtype=torch.int64, device=device),
                   torch.zeros(capacity, dim, dtype=dtype, device=device),
                   {name: torch.zeros_like(t) for name, t in state.items()},
                   torch.arange(capacity + 1, dtype=torch.int64, device=device), rows(),
                   table_starts.to(device), table_keys.to(device), rows(), rows(), rows(), overflow)

    @property
    def capacity(self) -> int:
        return self.ids.numel()

    def load(self, ids: torch.Tensor | None, state: dict[str, torch.Tensor] | None) -> None:
        """This step's U staged ids (on the device, ascending; None: no cold row) and
        their state rows, copied in on the current stream (the host does not wait)."""
        unique = 0 if ids is None else ids.numel()
        if unique:
            self.ids[:unique].copy_(ids, non_blocking=True)
            for name, rows in (state or {}).items():
                self.state[name][:unique].copy_(rows, non_blocking=True)
        self.ids[unique:].fill_(SENTINEL)
        self.count.fill_(unique)

    def invalidate(self) -> None:
        """Forget the last static step's rows: host rows were written since (module
        docstring), so none of its results may stand in for a host read."""
        self.prev_count.fill_(0)

    def _carried(self, rows: torch.Tensor) -> tuple:
        """The arguments of embeddings/kernels/stage_rows.py's launches."""
        names = list(self.state)
        return (self.ids, self.count, self.prev_ids, self.prev_count, rows, self.prev_rows,
                [self.state[n] for n in names], [self.prev_state[n] for n in names])

    @torch.no_grad()
    def patch(self, rows: torch.Tensor) -> None:
        """In the replay, before the lookup: each staged row that the last static step
        also staged takes that step's result, rows and state (one launch over the U
        rows: a binary search of each id in the last step's)."""
        from embeddings.kernels.stage_rows import patch_rows  # imports triton

        patch_rows(*self._carried(rows))

    @torch.no_grad()
    def keep(self, rows: torch.Tensor) -> None:
        """In the replay, after the update: this step's ids, rows and state become
        ``prev`` for the next (one launch over the U rows)."""
        from embeddings.kernels.stage_rows import keep_rows  # imports triton

        keep_rows(*self._carried(rows))

    def update_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(values, offsets, row_base) that make the update kernel apply ``grad[i]`` to
        row i for i < U: C features of one sample, bag i = [i], bags past U empty
        (their lookups unapplied). Buffers made outside any capture (a tensor first
        made in a capture holds nothing until a replay)."""
        return self.positions[:self.capacity], torch.minimum(self.positions, self.count), self.zeros

    @torch.no_grad()
    def locate(self) -> None:
        """In the replay: each staged row's table key and full-table row (``keys``,
        ``full_rows``), for the stochastic rounding of half rows."""
        last = self.table_starts.numel() - 1
        table = (torch.searchsorted(self.table_starts, self.ids, right=True) - 1).clamp_(0, last)
        self.tables.copy_(table)
        self.keys.copy_(self.table_keys.index_select(0, table))
        self.full_rows.copy_(self.ids - self.table_starts.index_select(0, table))
