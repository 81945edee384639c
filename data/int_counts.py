"""Exact counts of int64 values in about 16 bytes per distinct value: one sorted store,
merged into rarely and in place.

    row group  ──np.sort, run lengths──►  pending run (value, count) ... pending run
    pending runs (> 1/8 of the store) ──one stable sort, run lengths──► batch
    batch ──searchsorted into the store──► known values: counts += in place
                                           new values: store grown (realloc), old
                                           entries shifted right from the back, new
                                           ones written into the gaps

    store   values  [-3, 5, 9, 40]        counts [2, 7, 1, 1]    (sorted, each once)
    batch   values  [ 5, 6, 41]           counts [1, 2, 1]
    after   values  [-3, 5, 6, 9, 40, 41] counts [2, 8, 2, 1, 1, 1]

The store is two int64 arrays grown by ``ndarray.resize`` (realloc: large blocks are
remapped, not copied), so a merge needs no second copy of the store: the shift moves
``_CHUNK`` entries at a time through a buffer, last chunk first (every entry moves
right, so a chunk never overwrites one not yet moved). The pending runs are kept
below 1/8 of the store, so they and a merge's temporaries add about 2 bytes per
distinct value, and each store entry is moved about 8 times per doubling (amortised
O(1)). For Zipf-like ids most of a batch is already in the store: no shift at all.
"""

from __future__ import annotations

import numpy as np

_CHUNK = 1 << 20  # store entries moved at a time by a merge's shift


def plain_numpy(arr) -> np.ndarray:
    """A numeric pyarrow array (or chunked array) as numpy, nulls dropped; zero-copy for
    one chunk of ints or floats without nulls (pyarrow's ``to_numpy`` imports pandas:
    0.2-0.3 s; its ``combine_chunks`` copies even one chunk, 60 ms per 10M int64s, and a
    table's column is a chunked array of one); other types through ``to_numpy``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if arr.null_count:
        arr = pc.drop_null(arr)
    if isinstance(arr, pa.ChunkedArray):  # one chunk: itself (combine_chunks copies even one)
        arr = arr.chunk(0) if arr.num_chunks == 1 else arr.combine_chunks()
    if not (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)):
        return arr.to_numpy(zero_copy_only=False)  # booleans are bits, not bytes
    dtype = np.dtype(arr.type.to_pandas_dtype())
    data = arr.buffers()[1]
    if data is None or len(arr) == 0:
        return np.zeros(0, dtype)
    return np.frombuffer(data, dtype, count=len(arr), offset=arr.offset * dtype.itemsize)


def int64_array(values: np.ndarray):
    """int64 numpy → pyarrow array, zero-copy (``pa.array`` would import pandas)."""
    import pyarrow as pa

    values = np.ascontiguousarray(values, np.int64)
    return pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(values)])


def int64_values(arr) -> np.ndarray:
    """The non-null values of an integer pyarrow array as int64 numpy."""
    return plain_numpy(arr).astype(np.int64, copy=False)


def run_lengths(values: np.ndarray, counts: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """Sorted ``values`` (with ``counts``, or 1 each) → each value once, counts summed."""
    if len(values) == 0:
        return values, np.zeros(0, np.int64) if counts is None else counts
    edge = np.empty(len(values), bool)
    edge[0] = True
    np.not_equal(values[1:], values[:-1], out=edge[1:])
    starts = np.flatnonzero(edge)
    if counts is None:
        ends = np.append(starts[1:], len(values))
        return values[starts], ends - starts
    return values[starts], np.add.reduceat(counts, starts)


class IntCounts:
    """(value, count) of every int64 value added: ``values`` sorted, each once."""

    merge_rows = 1 << 16  # pending run rows that always allow a merge (tests lower it)

    def __init__(self) -> None:
        self.values = np.zeros(0, np.int64)
        self.counts = np.zeros(0, np.int64)
        self._pending: list[tuple[np.ndarray, np.ndarray, bool]] = []
        self._pending_rows = 0
        self._owned = True  # the store may be resized in place (not handed out)

    @classmethod
    def of_sorted(cls, values: np.ndarray, counts: np.ndarray) -> IntCounts:
        """A counter holding sorted distinct ``values`` and their ``counts`` (taken, not
        copied)."""
        c = cls()
        c.values, c.counts = values, counts
        return c

    def __len__(self) -> int:
        self.merge()
        return len(self.values)

    def add(self, values: np.ndarray) -> None:
        """Count int64 ``values`` (no nulls), one each."""
        if len(values):
            self._push(*run_lengths(_sorted(values)), fresh=True)

    def add_counts(self, values: np.ndarray, counts: np.ndarray) -> None:
        """Add (value, count) pairs, each value once, in any order."""
        if len(values):
            values = values.astype(np.int64, copy=False)
            counts = counts.astype(np.int64, copy=False)
            if len(values) > 1 and not bool(np.all(values[1:] > values[:-1])):
                order = np.argsort(values, kind="stable")
                values, counts = values[order], counts[order]
            self._push(values, counts, fresh=False)

    def _push(self, values: np.ndarray, counts: np.ndarray, fresh: bool) -> None:
        """``fresh``: the arrays are this counter's own (else the caller's, or read-only)."""
        self._pending.append((values, counts, fresh))
        self._pending_rows += len(values)
        if self._pending_rows > max(self.merge_rows, len(self.values) // 8):
            self.merge()

    def merge(self) -> None:
        """Fold the pending runs into the store."""
        if not self._pending:
            return
        fresh = True
        if len(self._pending) == 1:
            values, counts, fresh = self._pending[0]
        else:
            values = np.concatenate([v for v, _, _ in self._pending])
            counts = np.concatenate([c for _, c, _ in self._pending])
            order = np.argsort(values, kind="stable")  # timsort: merges the sorted runs
            values, counts = run_lengths(values[order], counts[order])
            del order
        self._pending, self._pending_rows = [], 0
        if len(self.values) == 0:
            self.values, self.counts, self._owned = values, counts, fresh
            return
        self._fold(values, counts)

    def _fold(self, values: np.ndarray, counts: np.ndarray) -> None:
        """Add a sorted batch (each value once) to the store, in place."""
        if not self._owned:  # the store is a caller's run or was handed out: copy once
            self.values, self.counts, self._owned = self.values.copy(), self.counts.copy(), True
        m = len(self.values)
        at = np.searchsorted(self.values, values)
        known = at < m
        known[known] = self.values[at[known]] == values[known]
        self.counts[at[known]] += counts[known]
        new = ~known
        if not new.any():
            return
        at, values, counts = at[new], values[new], counts[new]
        self.values = self._grown(self.values, m + len(values))
        self.counts = self._grown(self.counts, m + len(values))
        for a, x in ((self.values, values), (self.counts, counts)):
            _shift_right(a, m, at)
            a[at + np.arange(len(at))] = x

    @staticmethod
    def _grown(a: np.ndarray, n: int) -> np.ndarray:
        if a.flags.owndata:
            a.resize(n, refcheck=False)
            return a
        out = np.empty(n, np.int64)
        out[:len(a)] = a
        return out

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(values sorted ascending, counts); the counter must not grow them after."""
        self.merge()
        self._owned = False
        return self.values, self.counts

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`arrays`, and the counter forgets them (so a caller can free them)."""
        out = self.arrays()
        self.values, self.counts = np.zeros(0, np.int64), np.zeros(0, np.int64)
        return out


def merged_counts(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Several counters' (values sorted, each once; counts) as one: one stable sort of
    the concatenation (timsort finds the k sorted runs and merges them, about linear
    for few parts) and run lengths. ``parts`` is emptied as it is read, so each part's
    arrays can be freed once concatenated (about 32 bytes per entry at the peak)."""
    values = np.concatenate([v for v, _ in parts])
    counts = np.concatenate([c for _, c in parts])
    parts.clear()
    order = np.argsort(values, kind="stable")
    values = values[order]
    counts = counts[order]
    del order
    return run_lengths(values, counts)


def _sorted(values: np.ndarray) -> np.ndarray:
    """``values`` sorted; as uint32 offsets from the minimum when they span < 2^32
    (numpy sorts 4-byte keys faster than 8-byte ones)."""
    values = values.astype(np.int64, copy=False)
    lo, hi = int(values.min()), int(values.max())
    if hi - lo < (1 << 32) and len(values) > 1024:
        small = (values - lo).astype(np.uint32)
        small.sort()
        return small.astype(np.int64) + lo
    return np.sort(values)


def _shift_right(a: np.ndarray, m: int, at: np.ndarray) -> None:
    """Move ``a[:m]`` right to make a gap before each old index in sorted ``at``
    (old entry i moves to i + the number of ``at`` <= i); last chunk first. Within a
    chunk that shift is a running sum of the insertions per index (linear, no search
    per entry)."""
    for start in range(((m - 1) // _CHUNK) * _CHUNK, -1, -_CHUNK):
        end = min(start + _CHUNK, m)
        lo, hi = (int(x) for x in np.searchsorted(at, [start, end]))  # at < start, < end
        if hi == 0:
            return  # nothing inserted before this chunk's end: it and all before stay
        if lo == hi:  # one shift for the whole chunk (numpy copies overlaps safely)
            a[start + lo:end + lo] = a[start:end]
            continue
        shift = np.cumsum(np.bincount(at[lo:hi] - start, minlength=end - start))
        shift += lo + start
        shift[:] += np.arange(end - start)
        a[shift] = a[start:end].copy()
