"""The fast int counting path (sorted runs, numpy lexsort) equals a Counter reference.

Reference: ``collections.Counter`` over the same values, ordered by count descending
then value, cut by min_frequency and max_rows (tests/test_preprocess.py's
py_vocabulary). Batches are small and the merge threshold is lowered so that runs are
merged many times, with ties, negatives, nulls and values repeated across batches.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from data.int_counts import IntCounts
from data.vocabulary import ValueCounter, Vocabulary
from tests.test_preprocess import py_vocabulary


def _batches(seed: int) -> list[pa.Array]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(25):
        n = int(rng.integers(0, 400))
        v = np.where(rng.random(n) < 0.5, rng.integers(-5, 5, n), rng.integers(-(1 << 40), 1 << 40, n))
        out.append(pa.array([None if m else int(x) for x, m in zip(v, rng.random(n) < 0.05)],
                            pa.int64()))
    return out


@pytest.mark.parametrize("min_frequency,max_rows", [(1, 0), (2, 0), (1, 7), (3, 4)])
@pytest.mark.parametrize("seed", [0, 1])
def test_int_counts_and_order_equal_the_counter_reference(monkeypatch, seed, min_frequency,
                                                          max_rows) -> None:
    monkeypatch.setattr(IntCounts, "merge_rows", 100)
    batches = _batches(seed)
    counter = ValueCounter()
    for b in batches:
        counter.add(b)
    vocab = Vocabulary.build(counter.table(), pa.int64(), min_frequency, max_rows)
    flat = [x for b in batches for x in b.to_pylist()]
    expected = py_vocabulary(flat, min_frequency, max_rows)
    assert {v: i + 1 for i, v in enumerate(vocab.values.to_pylist())} == expected
    assert vocab.distinct == len({x for x in flat if x is not None})
    ref = {v: flat.count(v) for v in expected}
    assert vocab.counts.tolist() == [ref[v] for v in vocab.values.to_pylist()]


def test_split_counts_merged_equal_one_counter() -> None:
    """Two counters over disjoint halves, one's table added to the other, give the
    vocabulary of one counter over everything (the shape a split pass merges)."""
    batches = _batches(3)
    whole, a, b = ValueCounter(), ValueCounter(), ValueCounter()
    for i, x in enumerate(batches):
        whole.add(x)
        (a if i % 2 else b).add(x)
    tb = b.table()
    a.add_counts(tb["value"].to_numpy(), tb["count"].to_numpy())
    one = Vocabulary.build(whole.table(), pa.int64(), 2, 0)
    two = Vocabulary.build(a.table(), pa.int64(), 2, 0)
    assert one.values.equals(two.values) and one.counts.tolist() == two.counts.tolist()
    assert one.distinct == two.distinct


def test_ints_and_strings_order_ties_alike() -> None:
    """Ties by value: the numpy path's order equals pyarrow's sort_by on the same table."""
    values = [5, 3, 3, 5, 9, -1, -1, 9, 7]
    counter = ValueCounter()
    counter.add(pa.array(values, pa.int64()))
    vocab = Vocabulary.build(counter.table(), pa.int64())
    table = counter.table().sort_by([("count", "descending"), ("value", "ascending")])
    assert vocab.values.to_pylist() == table["value"].to_pylist() == [-1, 3, 5, 9, 7]
