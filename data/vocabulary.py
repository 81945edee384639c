"""A categorical column's vocabulary: which value owns which embedding row.

    counted    value_counts of every row group, merged  ("b":5, "a":5, "c":2, "d":1)
    ordered    by count descending, then value          a b c d
    kept       count >= min_frequency, at most max_rows - 1 values
    rows       0 = out-of-vocabulary (rare, unseen, null) | 1 "a" | 2 "b" | 3 "c"

The order depends only on the counts and the values, so every rank, every run and
``dlrm eval`` map a value to the same row. Counting integers is
:class:`data.int_counts.IntCounts` (sorted runs folded into one sorted store); strings
and binaries are pyarrow's ``value_counts`` per row group, with the partial counts
merged by a ``group_by(...).aggregate(sum)`` once they outgrow the merged table (each
value's count is summed O(log) times, never one Python step per row).

Looking up is a hash table: the vocabulary's keys (an int column's values, or a
string's stable 64-bit hash, :func:`data.hashing.hash_bytes`) are put in an
open-addressing table once (data/key_table.py), which finds the keys of a batch's
distinct values (``dictionary_encode``); without numba, a binary search of the keys
sorted once (``np.searchsorted``).
``pc.index_in`` would build its hash set of the whole vocabulary again on every call,
so it is not used per batch. An integer vocabulary whose values span at most 4x its
size (+ 64k), or at most 2^24 values (a 64 MiB table), is looked up by one gather from a table indexed by value (int32 rows,
built once), no dictionary encode, no search. Two vocabulary strings of the same hash would be
ambiguous: the later one (in row order) is left to the OOV row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data import key_table
from data.hashing import hash_bytes
from data.int_counts import IntCounts, int64_array, int64_values, merged_counts

_CHUNK = 1 << 20  # values hashed at a time
_DIRECT_SPAN = 1 << 24  # an integer vocabulary spanning up to this many values is a direct table (64 MiB)


def flat_values(col: pa.ChunkedArray | pa.Array) -> tuple[pa.Array, np.ndarray | None]:
    """A categorical column as (flat values, offsets [n + 1] or None for single-hot).

    Dictionaries are decoded; strings become large_string, binaries large_binary and
    integers int64, so files that wrote one column with different types count and
    look up alike. Nulls stay (a null list is an empty bag).
    """
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offsets = None
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy().astype(np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        arr = arr.flatten()
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    # safe=False: a uint64 above 2^63 wraps to a negative int64, one-to-one
    return arr.cast(_common_type(arr.type), safe=False), offsets


def _common_type(t: pa.DataType) -> pa.DataType:
    if pa.types.is_integer(t):
        return pa.int64()
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pa.large_string()
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return pa.large_binary()
    raise TypeError(f"not a categorical type: {t}")


def value_keys(values: pa.Array) -> np.ndarray:
    """int64 [n] keys of non-null values: an integer itself, a string's or binary's
    stable hash (as uint64)."""
    if pa.types.is_integer(values.type):
        return values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    if len(values) > _CHUNK:  # hashing takes ~40 bytes of temporaries per byte hashed
        return np.concatenate([value_keys(values.slice(i, _CHUNK))
                               for i in range(0, len(values), _CHUNK)])
    values = values.cast(pa.large_binary())
    _, offsets_buf, data_buf = values.buffers()
    offsets = np.frombuffer(offsets_buf, np.int64)[values.offset:values.offset + len(values) + 1]
    data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    return hash_bytes(offsets, data)


def _direct_lookup(direct: tuple[int, np.ndarray], values: pa.Array) -> np.ndarray:
    """Rows [n] of non-null integer ``values`` by one gather from the direct table."""
    lo, table = direct
    i = values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    if lo:
        i = i - lo
    if i.min() >= 0 and i.max() < len(table):  # the common case: one gather
        return table.take(i, mode="clip").astype(np.int64)
    inside = (i >= 0) & (i < len(table))
    rows = table[np.where(inside, i, 0)].astype(np.int64)
    rows[~inside] = 0
    return rows


class ValueCounter:
    """Counts of each value seen, merged as they come (see the module docstring).

    Integers take a faster path than pyarrow's hash aggregation:
    :class:`data.int_counts.IntCounts` (each batch sorted by numpy and run-length
    encoded, the runs folded rarely into one sorted store, about 16 bytes per distinct
    value). Strings and binaries keep ``value_counts`` and ``group_by``. Either way
    the table holds each distinct value once with its exact count, so the vocabulary
    does not depend on the path."""

    def __init__(self) -> None:
        self._merged: pa.Table | None = None
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self.ints = IntCounts()

    def add(self, values: pa.Array) -> None:
        """Count the non-null ``values`` (one flat array of :func:`flat_values`)."""
        if pa.types.is_integer(values.type):
            self.ints.add(int64_values(values))
            return
        counted = pc.value_counts(pc.drop_null(values))
        if len(counted) == 0:
            return
        self._pending.append(pa.table({"value": counted.field("values"),
                                       "count": counted.field("counts")}))
        self._pending_rows += len(counted)
        if self._pending_rows > max(1 << 20, len(self._merged or ())):
            self._merge()

    @classmethod
    def of(cls, counted: pa.Table) -> ValueCounter:
        """A counter holding another counter's ``table()`` as it is (no copy)."""
        c = cls()
        if pa.types.is_integer(counted["value"].type):
            c.add_table(counted)
        else:
            c._merged = counted.select(["value", "count"])
        return c

    @classmethod
    def of_sorted(cls, values: np.ndarray, counts: np.ndarray) -> ValueCounter:
        """A counter of int64 ``values`` (sorted, each once) and their ``counts``, taken."""
        c = cls()
        c.ints = IntCounts.of_sorted(values, counts)
        return c

    @classmethod
    def of_parts(cls, parts: list[pa.Table]) -> ValueCounter:
        """A counter of several counters' ``table()`` s, merged at once (ints: one k-way
        merge, :func:`data.int_counts.merged_counts`); ``parts`` is emptied."""
        if len(parts) == 1 or not pa.types.is_integer(parts[0]["value"].type):
            c = cls.of(parts.pop(0))
            while parts:
                c.add_table(parts.pop(0))
            return c
        ints = [(int64_values(p["value"]), int64_values(p["count"])) for p in parts]
        parts.clear()
        return cls.of_sorted(*merged_counts(ints))

    def add_ints(self, values: np.ndarray) -> None:
        """Count int64 ``values`` (no nulls)."""
        self.ints.add(values)

    def add_counts(self, values: np.ndarray, counts: np.ndarray) -> None:
        """Add int64 (value, count) pairs, each value once (another counter's table)."""
        self.ints.add_counts(values, counts)

    def add_table(self, counted: pa.Table) -> None:
        """Add another counter's ``table()`` (each value once with its count)."""
        if pa.types.is_integer(counted["value"].type):
            self.add_counts(int64_values(counted["value"]), int64_values(counted["count"]))
            return
        self._pending.append(counted.select(["value", "count"]))
        self._pending_rows += counted.num_rows
        if self._pending_rows > max(1 << 20, len(self._merged or ())):
            self._merge()

    def _merge(self) -> None:
        parts = ([self._merged] if self._merged is not None else []) + self._pending
        if self._pending:
            table = pa.concat_tables(parts).group_by("value").aggregate([("count", "sum")])
            self._merged = table.rename_columns(["value", "count"]).combine_chunks()
        self._pending, self._pending_rows = [], 0

    def table(self) -> pa.Table | None:
        """(value, count) of every distinct value seen; None if none was. Integers come
        sorted by value (no copy of the counter's arrays)."""
        if len(self.ints):
            values, counts = self.ints.arrays()
            return pa.table({"value": int64_array(values), "count": int64_array(counts)})
        self._merge()
        return self._merged


def _int_order(values: np.ndarray, counts: np.ndarray, max_rows: int, ascending: bool
               ) -> np.ndarray:
    """Indices of count descending, then value ascending (at most ``max_rows - 1``). A
    counter's table comes sorted by value (``ascending``), so one stable sort by count
    gives that order, on int32 keys where the counts allow; np.lexsort otherwise."""
    if ascending:
        big = len(counts) and int(counts.max()) >= 2**31
        key = np.empty(len(counts), np.int64 if big else np.int32)
        np.negative(counts, out=key, casting="unsafe")
        order = np.argsort(key, kind="stable")
        del key
    else:
        order = np.lexsort((values, -counts))
    return order[:max(max_rows - 1, 0)] if max_rows > 0 else order


@dataclass
class Vocabulary:
    """values[i] owns row i + 1; row 0 is out-of-vocabulary. counts [len] as counted."""

    values: pa.Array
    counts: np.ndarray
    distinct: int  # distinct values counted (before min_frequency and max_rows)
    _table: key_table.KeyTable | bool | None = None  # False: no numba (the sorted keys instead)
    _sorted_keys: np.ndarray | None = None
    _sorted_rows: np.ndarray | None = None
    _direct: tuple[int, np.ndarray] | None = None  # (lowest value, rows by value - lowest)

    @property
    def rows(self) -> int:
        return len(self.values) + 1

    @staticmethod
    def build(counted: pa.Table | None, value_type: pa.DataType, min_frequency: int = 1,
              max_rows: int = 0) -> Vocabulary:
        """The vocabulary of ``counted`` (ValueCounter.table()): values seen at least
        ``min_frequency`` times, most frequent first (ties by value), at most
        ``max_rows - 1`` of them when ``max_rows`` > 0."""
        if counted is None:
            return Vocabulary(pa.array([], type=value_type), np.zeros(0, np.int64), 0)
        distinct = counted.num_rows
        if pa.types.is_integer(counted["value"].type):
            return Vocabulary._build_ints(counted, min_frequency, max_rows)
        kept = counted.filter(pc.greater_equal(counted["count"], max(min_frequency, 1)))
        kept = kept.sort_by([("count", "descending"), ("value", "ascending")])
        if max_rows > 0:
            kept = kept.slice(0, max(max_rows - 1, 0))
        values = kept["value"].combine_chunks()
        counts = kept["count"].to_numpy().astype(np.int64)
        if not pa.types.is_integer(values.type) and len(values):
            _, first = np.unique(value_keys(values), return_index=True)
            if len(first) < len(values):  # a 64-bit hash collision: keep the earlier value
                keep = np.sort(first)
                values, counts = values.take(pa.array(keep)), counts[keep]
        return Vocabulary(values, counts, distinct)

    @staticmethod
    def of_counter(counter: ValueCounter, value_type: pa.DataType, min_frequency: int = 1,
                   max_rows: int = 0) -> Vocabulary:
        """:meth:`build` of ``counter.table()``; an int counter's arrays are taken from it
        and replaced by their reordered copies one at a time, so the pass's peak is
        its store plus about 16 bytes per value of the largest table (keys, order)."""
        if not len(counter.ints):
            return Vocabulary.build(counter.table(), value_type, min_frequency, max_rows)
        values, counts = counter.ints.take()
        distinct = len(values)
        if min_frequency > 1:
            keep = counts >= min_frequency
            values = values[keep]
            counts = counts[keep]
            del keep
        order = _int_order(values, counts, max_rows, ascending=True)
        values = values[order]  # the counter's array is freed here
        counts = counts[order]
        return Vocabulary(int64_array(values), counts, distinct)

    @staticmethod
    def _build_ints(counted: pa.Table, min_frequency: int, max_rows: int) -> Vocabulary:
        """build's order for int64 values, in numpy (:func:`_int_order`), the same as
        pyarrow's sort_by and several times faster."""
        values, counts = int64_values(counted["value"]), int64_values(counted["count"])
        if min_frequency > 1:
            keep = counts >= min_frequency
            values, counts = values[keep], counts[keep]
        ascending = len(values) < 2 or bool(np.all(values[1:] > values[:-1]))
        order = _int_order(values, counts, max_rows, ascending)
        return Vocabulary(int64_array(values[order]), counts[order], counted.num_rows)

    def lookup(self, values: pa.Array, distinct: bool = False) -> np.ndarray:
        """Rows [n] of ``values`` (flat, of :func:`flat_values`): unseen and null → 0.

        Each distinct value of the batch is looked up once (``dictionary_encode``:
        popular ids repeat, so a batch holds far fewer distinct values than rows).
        Integer values without nulls whose span fits the table of :meth:`_direct_table`
        take one gather instead. ``distinct``: no value of ``values`` repeats (a
        dictionary's values), so each is searched as it is."""
        direct = self._direct_table() if pa.types.is_integer(values.type) else None
        if direct is not None and len(values) and values.null_count == 0:
            return _direct_lookup(direct, values)
        if len(values) == 0 or len(self.values) == 0 or values.null_count == len(values):
            return np.zeros(len(values), dtype=np.int64)
        if distinct and values.null_count == 0:
            return self.rows_of_keys(value_keys(values))
        encoded = pc.dictionary_encode(values)  # nulls stay null indices
        rows = self.rows_of_keys(value_keys(encoded.dictionary))
        indices = pc.fill_null(encoded.indices, -1).to_numpy().astype(np.int64)
        return np.where(indices >= 0, rows[indices], 0)

    def rows_of_keys(self, keys: np.ndarray) -> np.ndarray:
        """Rows [k] of distinct value keys [k] (0: not in the vocabulary): found in a
        hash table of the vocabulary's keys (data/key_table.py, built once), else (no
        numba) searched in sorted order: each search starts where the last ended, so
        the vocabulary's keys are walked once, not k times from the top."""
        if self._table is None:
            self._table = key_table.build(value_keys(self.values)) or False
        if self._table:
            return self._table.find(keys)
        if self._sorted_keys is None:
            own = value_keys(self.values)
            by_key = np.argsort(own, kind="stable")
            self._sorted_keys, self._sorted_rows = own[by_key], by_key.astype(np.int64) + 1
        if len(self._sorted_keys) == 0:
            return np.zeros(len(keys), np.int64)
        order = np.argsort(keys)
        found = np.minimum(np.searchsorted(self._sorted_keys, keys[order]),
                           len(self._sorted_keys) - 1)
        hit = self._sorted_keys[found] == keys[order]
        rows = np.empty(len(keys), np.int64)
        rows[order] = np.where(hit, self._sorted_rows[found], 0)
        return rows

    def _direct_table(self) -> tuple[int, np.ndarray] | None:
        """(lo, table): table[v - lo] is integer value v's row (0: not in the vocabulary),
        built once when the values' span is at most 4 x the vocabulary (+ 64k) or at most
        ``_DIRECT_SPAN``, else None.
        int32 rows: 4 bytes per value of the span."""
        if self._direct is None:
            v = self.values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
            self._direct = (0, np.zeros(0, np.int32))
            if len(v) and len(v) < 2**31 - 1:
                lo, span = int(v.min()), int(v.max()) - int(v.min()) + 1
                if span <= max(4 * len(v) + (1 << 16), _DIRECT_SPAN):
                    table = np.zeros(span, np.int32)
                    table[v[::-1] - lo] = np.arange(len(v), 0, -1, dtype=np.int32)  # earliest wins
                    self._direct = (lo, table)
        return self._direct if len(self._direct[1]) else None
