"""Which rows are hot: count accesses on a sample of the data, keep the most used.

    sample of batches ──count_accesses──► counts per table [rows] int64
                                              │ choose_hot_rows (global ranking,
                                              ▼  weight + optimizer bytes ≤ budget)
                                          HotProfile: sorted hot row ids per table

Ranking is global: a row of a small, busy table beats a row of a big, quiet one.
Ties go to the earlier table, then the lower row id, so a profile is reproducible.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from data.atomic import atomic_path
from embeddings.optim import SparseOptimizer
from embeddings.table import TableSpec

if TYPE_CHECKING:
    from data.jagged import JaggedFeatures

DEFAULT_SAMPLE_FRACTION = 0.05
DEFAULT_MAX_SECONDS = 60.0


def default_max_batches(total_batches: int, fraction: float = DEFAULT_SAMPLE_FRACTION) -> int:
    """The default sample: 5% of the training batches (at least one)."""
    return max(1, int(total_batches * fraction))


def count_accesses(
    batches: Iterable[JaggedFeatures],
    tables: list[TableSpec],
    max_batches: int | None = None,
    max_seconds: float | None = DEFAULT_MAX_SECONDS,
) -> dict[str, torch.Tensor]:
    """Per table, how often each row was looked up in ``batches`` ([rows] int64).

    Features sharing a table add up. Stops after ``max_batches`` batches or once
    ``max_seconds`` have passed, whichever comes first (None: no bound). Default
    policy (the caller's): ``default_max_batches`` = 5% of the data, 60 s at most.

    A batch costs O(its ids), not O(the tables' rows): the ids are added in place
    (``index_add_``). A ``bincount(minlength=rows)`` per feature, then a new sum, made
    Hotline's per-step counting (``hotline.refresh_every``) walk every row of every
    table at every step: 8.5k samples/s instead of 220k with a 55M-row table. (A
    refresh's window is counted on the device since: access_window.py.)
    """
    counts = {t.name: torch.zeros(t.rows, dtype=torch.int64) for t in tables}
    table_of = {f: t.name for t in tables for f in t.features}
    start = time.monotonic()
    for i, sparse in enumerate(batches):
        if max_batches is not None and i >= max_batches:
            break
        for feature, jt in sparse.to_dict().items():
            name = table_of.get(feature)
            if name is not None:
                ids = jt.values().cpu()
                counts[name].index_add_(0, ids, torch.ones(ids.numel(), dtype=torch.int64))
        if max_seconds is not None and time.monotonic() - start >= max_seconds:
            break
    return counts


def row_bytes(table: TableSpec, optimizer: SparseOptimizer) -> int:
    """Device bytes of one hot row: the weight in the table's type (fp16/bf16: half of
    fp32, twice the rows in a budget) + per-row optimizer state."""
    return table.dim * table.itemsize + optimizer.state_bytes_per_row(table.dim)


def choose_hot_rows(
    counts: dict[str, torch.Tensor],
    tables: list[TableSpec],
    optimizer: SparseOptimizer,
    budget_bytes: int,
    keep: dict[str, torch.Tensor] | None = None,
    fill: bool = True,
) -> dict[str, torch.Tensor]:
    """The most-accessed rows over all tables whose bytes fit ``budget_bytes``.

    Rows are taken in ranking order (count desc, then table order, then row id)
    until the next one would exceed the budget. Zero-count rows come after: first
    those of ``keep`` (per table, row ids: a refresh's hot rows now), in table and
    row order, then, where room is still left, the others (``fill_unseen``; not with
    ``fill`` false). A refresh's window of steps may see fewer rows than the budget
    holds (bench_gpu's 30 steps: 333k distinct rows for a 500k-row budget): ``keep``
    holds the hot set at its size with the rows hot now, not with rows never seen.
    Returns per table the sorted hot row ids (int64, possibly empty).

    Only the rows counted at least once (and those of ``keep``) are ranked (a sort of
    them, not of every row of every table): memory and time follow the rows seen and
    the budget, not the tables' size.
    """
    keys, seen = _with_kept(*_candidates(counts, tables), tables, keep)
    return _choose(keys, seen, tables, optimizer, budget_bytes, fill)[0]


def table_starts(tables: list[TableSpec]) -> torch.Tensor:
    """[T + 1] int64: where each table's rows start when the tables are stacked in their
    order (the ranking's key: start + row id), then the total rows."""
    rows = torch.tensor([0] + [t.rows for t in tables], dtype=torch.int64)
    return torch.cumsum(rows, 0)


def stacked_keys(rows: dict[str, torch.Tensor], tables: list[TableSpec]) -> torch.Tensor:
    """Per-table row ids as one tensor of keys (``table_starts``), table after table
    (tables ``rows`` does not name: none), on the host."""
    starts = table_starts(tables).tolist()
    parts = [rows[t.name].to(torch.int64).cpu() + starts[i] for i, t in enumerate(tables) if t.name in rows]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def by_table(keys: torch.Tensor, tables: list[TableSpec], *alongside: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Ascending ``keys`` back to per-table row ids: per table [its row ids, then each
    tensor of ``alongside`` sliced alike], on the host."""
    keys, starts = keys.cpu(), table_starts(tables)
    alongside = tuple(t.cpu() for t in alongside)
    bounds = torch.searchsorted(keys, starts).tolist()
    return {t.name: [keys[lo:hi] - int(starts[i]), *(a[lo:hi] for a in alongside)]
            for i, (t, lo, hi) in enumerate(zip(tables, bounds[:-1], bounds[1:], strict=True))}


def in_sorted(values: torch.Tensor, sorted_ids: torch.Tensor) -> torch.Tensor:
    """``torch.isin(values, sorted_ids)`` for ascending ``sorted_ids``: a sorted search
    (500k hot ids against 500k: 20 ms here where isin, which sorts both, took 112 ms)."""
    if sorted_ids.numel() == 0:
        return torch.zeros_like(values, dtype=torch.bool)
    at = torch.searchsorted(sorted_ids, values).clamp_(max=sorted_ids.numel() - 1)
    return sorted_ids.index_select(0, at) == values


def _candidates(counts: dict[str, torch.Tensor], tables: list[TableSpec]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows counted at least once as stacked keys (``table_starts``), ascending, and
    their counts (int64; a table's counts sum to its lookups)."""
    rows = {t.name: torch.nonzero(counts[t.name]).squeeze(1) for t in tables}
    return stacked_keys(rows, tables), torch.cat([counts[name][r].to(torch.int64) for name, r in rows.items()])


def _with_kept(keys: torch.Tensor, seen: torch.Tensor, tables: list[TableSpec],
               keep: dict[str, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates ``keys`` (ascending; ``seen``: their counts) and the rows of ``keep`` not
    among them, at count 0, in key order (on ``keys``' device)."""
    if keep is None or not any(ids.numel() for ids in keep.values()):
        return keys, seen
    kept = stacked_keys(keep, tables).to(keys.device)
    extra = kept[~in_sorted(kept, keys)]
    if extra.numel() == 0:
        return keys, seen
    keys, order = torch.sort(torch.cat([keys, extra]))
    return keys, torch.cat([seen, torch.zeros_like(extra)]).index_select(0, order)


def _choose(keys: torch.Tensor, seen: torch.Tensor, tables: list[TableSpec], optimizer: SparseOptimizer,
            budget_bytes: int, fill: bool) -> tuple[dict[str, torch.Tensor], list[int], list[int]]:
    """``choose_hot_rows`` over candidates ``keys`` (stacked, ascending; on any device) and
    their counts ``seen``: the hot rows per table (on the host), and per table the
    candidates' lookups and those of its hot rows."""
    device = keys.device
    starts = table_starts(tables).to(device)
    table_idx = torch.searchsorted(starts[1:], keys, right=True)
    cost = torch.tensor([row_bytes(t, optimizer) for t in tables], dtype=torch.int64, device=device)
    # Candidates are in key (table, row id) order; a stable sort keeps it for ties.
    order = torch.sort(seen, descending=True, stable=True).indices
    taken = order[torch.cumsum(cost[table_idx[order]], 0) <= budget_bytes]
    taken = torch.sort(taken).values  # in key order: each table's rows ascending, table after table
    taken_table = table_idx.index_select(0, taken)
    sums = torch.zeros(3, len(tables), dtype=torch.int64, device=device)
    sums[0].index_add_(0, table_idx, seen)
    sums[1].index_add_(0, taken_table, seen.index_select(0, taken))
    sums[2].index_add_(0, taken_table, cost.index_select(0, taken_table))
    lookups, hot_lookups, used = sums.cpu().tolist()
    out = {name: rows for name, (rows,) in by_table(keys.index_select(0, taken), tables).items()}
    room = budget_bytes - sum(used)
    if fill and room > 0 and taken.numel() == order.numel():  # every ranked row hot, room left
        fill_unseen(out, tables, cost.tolist(), room)
    return out, lookups, hot_lookups


def fill_unseen(hot: dict[str, torch.Tensor], tables: list[TableSpec], cost: list[int], room: int) -> None:
    """Rows no profile counted, into the ``room`` bytes a budget has left once every
    counted (and kept) row is hot: the smallest tables first, each in row order, so
    small tables go whole to the device (a row of an R-row table takes ~1/R of its
    feature's lookups). A budget bigger than the tables then holds every row: a 1GB
    budget over configs/tiny.yaml's 1.6 MiB held the 14.5k rows a 5% profile saw and
    left 11.4k on the host (92.6% of the run's lookups hot). Adds to ``hot`` in place;
    looks at no more rows than it adds plus those hot already (no walk of a big table)."""
    for i in sorted(range(len(tables)), key=lambda i: (tables[i].rows, i)):
        t, have = tables[i], hot[tables[i].name]
        take = min(room // cost[i], t.rows - have.numel())
        if take <= 0:
            continue  # a row of this table no longer fits (a cheaper one may) or none is left
        candidates = torch.arange(min(t.rows, take + have.numel()), dtype=torch.int64)
        added = candidates[~torch.isin(candidates, have)][:take]
        hot[t.name] = torch.sort(torch.cat([have, added])).values
        room -= take * cost[i]


@dataclass
class HotProfile:
    """The hot set: per table, sorted hot row ids; plus what it was chosen from.

    ``features``: feature → table (for ``hit_rate``). ``summary``: per table,
    sampled lookups and how many of them hit a hot row.
    """

    hot: dict[str, torch.Tensor]
    features: dict[str, str]
    budget_bytes: int
    summary: dict[str, dict[str, int]] = field(default_factory=dict)

    @staticmethod
    def build(
        counts: dict[str, torch.Tensor],
        tables: list[TableSpec],
        optimizer: SparseOptimizer,
        budget_bytes: int,
        keep: dict[str, torch.Tensor] | None = None,
        fill: bool = True,
    ) -> HotProfile:
        """The hot set ``counts`` choose (``keep``, ``fill``: see ``choose_hot_rows``).
        The lookups are summed over the ranked rows' counts, not over every row of every
        table (a refresh's plan over bench_gpu's 34M rows: 26 ms a plan)."""
        return HotProfile.chosen(*_candidates(counts, tables), tables, optimizer, budget_bytes, keep, fill)

    @staticmethod
    def chosen(keys: torch.Tensor, seen: torch.Tensor, tables: list[TableSpec], optimizer: SparseOptimizer,
               budget_bytes: int, keep: dict[str, torch.Tensor] | None = None, fill: bool = True) -> HotProfile:
        """``build`` from the rows counted at least once as stacked keys (``table_starts``;
        ascending, distinct, on any device) and their counts ``seen``: a refresh's, from
        its window (embeddings/hotline/access_window.py), ranked where the window is."""
        keys, seen = _with_kept(keys, seen, tables, keep)
        hot, lookups, hot_lookups = _choose(keys, seen, tables, optimizer, budget_bytes, fill)
        summary = {
            t.name: {"lookups": lookups[i], "hot_lookups": hot_lookups[i], "hot_rows": int(hot[t.name].numel())}
            for i, t in enumerate(tables)
        }
        features = {f: t.name for t in tables for f in t.features}
        return HotProfile(hot, features, budget_bytes, summary)

    def save(self, path: str | os.PathLike) -> None:
        """Atomic: written beside ``path`` then renamed over it."""
        payload = {"hot": self.hot, "features": self.features,
                   "budget_bytes": self.budget_bytes, "summary": self.summary}
        with atomic_path(path) as tmp:
            torch.save(payload, tmp)

    @staticmethod
    def load(path: str | os.PathLike) -> HotProfile:
        payload = torch.load(os.fspath(path), weights_only=True)
        return HotProfile(payload["hot"], payload["features"], payload["budget_bytes"], payload["summary"])

    def hit_rate(self, sparse: JaggedFeatures) -> float:
        """Share of ``sparse``'s lookups that hit a hot row (0.0 when it has none)."""
        hits = total = 0
        for feature, jt in sparse.to_dict().items():
            values = jt.values()
            total += values.numel()
            hot = self.hot[self.features[feature]].to(values.device)
            hits += int(torch.isin(values, hot).sum())
        return hits / total if total else 0.0
