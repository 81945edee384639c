"""IntCounts (the fit's int counting store) against collections.Counter.

Small merge thresholds and shift chunks make every path run many times: folds with and
without new values, shifts of one constant offset and of many, a pending run that
becomes the store, (value, count) tables added in any order from read-only buffers, and
arrays handed out before the counter grows again (they must not change)."""

from __future__ import annotations

import collections

import numpy as np
import pyarrow as pa
import pytest

import data.int_counts as ic
from data.int_counts import IntCounts, int64_array, int64_values, plain_numpy


@pytest.mark.parametrize("seed", range(12))
def test_counts_equal_a_counter(monkeypatch, seed: int) -> None:
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(ic, "_CHUNK", int(rng.integers(1, 40)))
    monkeypatch.setattr(IntCounts, "merge_rows", int(rng.integers(1, 300)))
    counter, ref = IntCounts(), collections.Counter()
    handed: list[tuple[list[int], np.ndarray]] = []
    for step in range(30):
        span = [8, 1000, 1 << 40][int(rng.integers(0, 3))]
        v = rng.integers(-span, span, int(rng.integers(0, 3000)))
        if rng.random() < 0.3:  # another counter's table: each value once, any order,
            u, k = np.unique(v, return_counts=True)  # read-only (an arrow buffer)
            p = rng.permutation(len(u))
            counter.add_counts(int64_values(int64_array(u[p])), int64_values(int64_array(k[p])))
        else:
            counter.add(v)
        ref.update(v.tolist())
        if step % 7 == 3:
            values, _ = counter.arrays()
            handed.append((values.tolist(), values))
    values, counts = counter.arrays()
    keys = sorted(ref)
    assert values.tolist() == keys
    assert counts.tolist() == [ref[k] for k in keys]
    for before, array in handed:  # handed-out arrays were copied, never grown in place
        assert array.tolist() == before


def test_plain_numpy_drops_nulls_and_follows_offsets() -> None:
    arr = pa.chunked_array([pa.array([1, None, 3], pa.int32()), pa.array([4, 5, 6], pa.int32())])
    assert plain_numpy(arr).tolist() == [1, 3, 4, 5, 6]
    sliced = pa.array(np.arange(10, dtype=np.float32)).slice(3, 4)
    assert plain_numpy(sliced).tolist() == [3.0, 4.0, 5.0, 6.0]
    assert int64_values(pa.array([None, 2**40], pa.int64())).tolist() == [2**40]
    assert plain_numpy(pa.array([], pa.int64())).tolist() == []
    assert plain_numpy(pa.array([True, None, False, True])).tolist() == [True, False, True]


def test_plain_numpy_of_a_table_column_copies_nothing() -> None:
    """A table's column is a chunked array of one chunk: its numpy view is that chunk's
    own buffer (pyarrow's combine_chunks would copy it, as it does several chunks)."""
    values = np.arange(1000, dtype=np.int64) * 7
    column = pa.table({"value": int64_array(values)})["value"]
    assert column.num_chunks == 1
    out = plain_numpy(column)
    assert out.tolist() == values.tolist() and np.shares_memory(out, values)
    two = pa.chunked_array([int64_array(values[:10]), int64_array(values[10:])])
    assert plain_numpy(two).tolist() == values.tolist()
