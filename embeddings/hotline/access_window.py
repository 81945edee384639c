"""A refresh window's lookups, counted where the ids already are (the hot tier's device).

    step t:   device batch ──keys──► [N] stacked keys (table start + row id) ──┐ kept, no
    step t+1: ...                                                             │ sync, no
                                                                              ▼ host work
    every ``chunk_keys`` keys, and at a refresh or checkpoint: the chunks go to the
    planner thread, which sorts them on its own stream (CUDA) and merges them into
        (keys [K] ascending, distinct; counts [K] int64)   K = the window's distinct rows

The key space is the tables stacked in their order (``table_starts``): key = start of the
row's table + row id, which is what a Hotline collection's split computes as its stacked
ids: the trainer's step hands those over (``add_keys``: one copy, not the keying's
ops), and ``add`` keys a batch itself (tables of several dtypes, whose groups stack
their own tables). Sorted keys are per table then per row, the order the hot-set
ranking breaks ties in (embeddings/hotline/profile.py), so the window hands the plan its
candidates as they are.

Why not a count per row (an ``index_add_`` into [rows] counts)? On the host that was
1.7 ms a step for bench_gpu's 106k ids into 34M rows' counts (random writes into 270 MB),
about a GPU step; on the device it would cost 4-8 bytes a row of every table, more than
the 128 MB hot tier it serves. Here memory follows the window's lookups (4 KB a sample at
26 single-hot features, for at most ``chunk_keys`` of them) and the distinct rows seen;
the sort is the planner's, milliseconds on a GPU.

Counts are exact integers: a window's counts, and so its plan, are the same whatever the
device, the chunking and the order the merges ran in.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from embeddings.hotline.profile import by_table, stacked_keys, table_starts
from embeddings.table import TableSpec

Counts = tuple[torch.Tensor, torch.Tensor]  # (keys ascending, distinct; their counts), int64
CHUNK_KEYS = 1 << 23  # keys held before a merge: 64 MB of int64 (bench_gpu: 79 steps)
_NO_TABLE = -(1 << 62)  # a feature without a table: its keys go negative, dropped at the merge


def merge_counts(keys: torch.Tensor, counts: torch.Tensor | None = None) -> Counts:
    """The distinct ``keys`` ascending and how often each occurs (each occurrence
    weighted by ``counts``, else 1); negative keys (no table) dropped."""
    if counts is None:
        distinct, seen = torch.unique(keys, sorted=True, return_counts=True)
    else:
        distinct, where = torch.unique(keys, sorted=True, return_inverse=True)
        seen = torch.zeros(distinct.numel(), dtype=torch.int64, device=keys.device)
        seen.index_add_(0, where, counts.to(torch.int64))
    first = int(torch.searchsorted(distinct, torch.zeros((), dtype=distinct.dtype, device=distinct.device)))
    return distinct[first:], seen[first:].to(torch.int64)


def to_checkpoint(window: Counts | None, tables: list[TableSpec]) -> dict[str, torch.Tensor] | None:
    """A window as a checkpoint holds it: per table [2, n] (row ids seen, their counts),
    on the host."""
    if window is None:
        return None
    return {name: torch.stack(parts) for name, parts in by_table(window[0], tables, window[1]).items()}


def from_checkpoint(saved: dict[str, torch.Tensor] | None, tables: list[TableSpec]) -> Counts | None:
    """``to_checkpoint``'s inverse (tables a checkpoint does not name: no lookups)."""
    if saved is None:
        return None
    keys = stacked_keys({name: rows_seen[0] for name, rows_seen in saved.items()}, tables)
    named = [t.name for t in tables if t.name in saved]
    seen = torch.cat([saved[name][1].to(torch.int64) for name in named]) if named else torch.zeros(0, dtype=torch.int64)
    return keys, seen


class AccessWindow:
    """The lookups since the last refresh (module docstring). ``add`` on the step loop's
    thread; the merges on ``planner``'s (one thread: they run in the order submitted)."""

    def __init__(self, tables: list[TableSpec], device: torch.device, planner: ThreadPoolExecutor,
                 chunk_keys: int = CHUNK_KEYS) -> None:
        self.tables, self.device, self.planner = tables, device, planner
        self.chunk_keys = chunk_keys
        starts = table_starts(tables)
        self._start_of = {f: int(starts[i]) for i, t in enumerate(tables) for f in t.features}
        self._starts: dict[tuple[str, ...], torch.Tensor] = {}  # per feature list: [F] on the device
        self._chunks: list[torch.Tensor] = []
        self._held = 0
        self._merged: Counts | None = None  # the planner's: the chunks merged so far
        self._merges: list[Future[None]] = []
        self.merge_s = 0.0  # the planner's time merging (written there only)
        # CUDA: the planner's stream (its sorts' syncs wait for it alone, not the step's)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def add(self, sparse: Any) -> None:
        """A batch's lookups (``JaggedFeatures`` on ``device``): their keys, computed on
        the current stream (a few kernels, no sync), kept until the next merge."""
        keys = sparse.keys()
        starts = self._starts.get(tuple(keys))
        if starts is None:
            starts = torch.tensor([self._start_of.get(k, _NO_TABLE) for k in keys], dtype=torch.int64)
            starts = self._starts[tuple(keys)] = starts.to(self.device)
        values, lengths = sparse.values(), sparse.lengths()
        if values.numel():  # the shape: known on the host
            self._keep(_keyed(values, lengths.view(len(keys), -1).sum(1), starts))

    def add_keys(self, keys: torch.Tensor, copy: bool = False) -> None:
        """A batch's lookups as their keys already (the Hotline split's stacked ids, in
        the same key space: a collection stacks its tables in their order), on the
        current stream: no keying ops; ``copy`` where ``keys`` is a buffer the next
        split writes again (a split graph's), so the window keeps its own."""
        if keys.numel():
            self._keep(keys.clone() if copy else keys)

    def _keep(self, keys: torch.Tensor) -> None:
        """``keys`` held until the next merge (one handed over past ``chunk_keys``)."""
        self._chunks.append(keys)
        self._held += keys.numel()
        if self._held >= self.chunk_keys:
            self._merges.append(self._hand_over(last=False))

    def seed(self, window: Counts | None) -> None:
        """Start from ``window``'s counts (a checkpoint's), before any ``add``."""
        if window is not None:
            self._merges.append(self.planner.submit(self._seed, *window))

    def take(self) -> Future[Counts]:
        """The window's counts (the planner makes them, after every merge before), and a
        new window begins."""
        return self._hand_over(last=True)

    def _hand_over(self, last: bool) -> Future[Any]:
        chunks, self._chunks, self._held = self._chunks, [], 0
        before: list[Future[Any]] = []
        if last:  # the merges submitted before this one (they run first: one thread)
            before, self._merges = self._merges, []
        ready = None
        if self.stream is not None:  # the keys are the step stream's: the planner's waits
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            for chunk in chunks:  # their memory outlives the planner's reads
                chunk.record_stream(self.stream)
        return self.planner.submit(self._merge, chunks, ready, last, before)

    def _seed(self, keys: torch.Tensor, seen: torch.Tensor) -> None:
        with self.planner_stream():
            seeded = (keys.to(self.device), seen.to(self.device))
            self._merged = seeded if self._merged is None else self._add(self._merged, seeded)

    def planner_stream(self) -> contextlib.AbstractContextManager[Any]:
        """On the planner thread: its work on the device goes to the planner's stream."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _merge(self, chunks: list[torch.Tensor], ready: torch.cuda.Event | None, last: bool,
               before: list[Future[Any]]) -> Counts | None:
        """On the planner thread: ``chunks`` merged into the window's counts; ``last``: the
        window's counts returned and forgotten. On the device, complete (the merge's
        last sort waited for its stream), made on the planner's stream: a user on another
        stream copies them (``.cpu()``) or waits."""
        for done in before:  # done already: a failure surfaces here
            done.result()
        t0 = time.perf_counter()
        try:
            return self._merged_with(chunks, ready, last)
        finally:
            self.merge_s += time.perf_counter() - t0

    def _merged_with(self, chunks: list[torch.Tensor], ready: torch.cuda.Event | None, last: bool
                     ) -> Counts | None:
        with self.planner_stream():
            if ready is not None:
                self.stream.wait_event(ready)
            if chunks:
                new = merge_counts(torch.cat(chunks))
                self._merged = new if self._merged is None else self._add(self._merged, new)
            if not last:
                return None
            merged, self._merged = self._merged, None
            if merged is None:
                return (torch.zeros(0, dtype=torch.int64, device=self.device),
                        torch.zeros(0, dtype=torch.int64, device=self.device))
            return merged

    @staticmethod
    def _add(a: Counts, b: Counts) -> Counts:
        return merge_counts(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]))


def _keyed(values: torch.Tensor, per_feature: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """[N] keys: each feature's ids (``per_feature`` of them, feature-major) plus its
    table's start, repeated over them (no sync: the output's size is N, known). On
    one core here: 0.15 ms for bench_gpu's 106k ids, 0.01 ms for 1.7k (a slice add per
    feature: 0.13 and 0.09)."""
    return values.to(torch.int64) + torch.repeat_interleave(starts, per_feature, output_size=values.numel())
