"""Vocabulary.lookup against a Python dict: the direct table (integer values of a
narrow span) and the binary search (a wide span, strings, nulls) map alike."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from data.vocabulary import ValueCounter, Vocabulary


def _vocab(values: pa.Array, max_rows: int = 0) -> Vocabulary:
    counter = ValueCounter()
    counter.add(values)
    return Vocabulary.build(counter.table(), values.type, max_rows=max_rows)


def _reference(vocab: Vocabulary, values: list) -> list[int]:
    rows = {v: i + 1 for i, v in enumerate(vocab.values.to_pylist())}
    return [rows.get(v, 0) for v in values]


@pytest.mark.parametrize("span, direct", [(5_000, True), (3_000_000, True), (10**12, False)])
@pytest.mark.parametrize("type_", [pa.int64(), pa.int32()])
def test_integer_lookup_matches_a_dict(span: int, direct: bool, type_: pa.DataType) -> None:
    if type_ == pa.int32() and span > 2**31:
        span = 2**31 - 1
    rng = np.random.default_rng(0)
    fitted = rng.integers(-span // 2, span // 2, 3000)
    vocab = _vocab(pa.array(fitted, type=type_), max_rows=2000)  # some values left out
    query = np.concatenate([fitted, rng.integers(-span, span, 3000), [fitted.min() - 1, fitted.max() + 1]])
    got = vocab.lookup(pa.array(query, type=type_))
    assert got.dtype == np.int64
    assert got.tolist() == _reference(vocab, query.tolist())
    assert (vocab._direct_table() is not None) == direct


def test_nulls_and_strings_take_the_search_and_match_a_dict() -> None:
    vocab = _vocab(pa.array([3, 3, 7, 9, 9, 9]))
    query = [9, None, 3, 4, 7]
    assert vocab.lookup(pa.array(query)).tolist() == _reference(vocab, query)
    words = _vocab(pa.array(["b", "a", "b", "c"]))
    query = ["a", "z", None, "b", "c"]
    assert words.lookup(pa.array(query)).tolist() == _reference(words, query)


@pytest.mark.parametrize("low", [0, -70_000, 10**15])
def test_direct_table_inside_its_span_matches_a_dict(low: int) -> None:
    """Every query inside the table's span (the one-gather path), unseen values among them."""
    rng = np.random.default_rng(1)
    fitted = low + rng.integers(0, 200_000, 3000)
    vocab = _vocab(pa.array(fitted), max_rows=2000)
    query = np.concatenate([fitted, low + rng.integers(0, 200_000, 3000), [fitted.min(), fitted.max()]])
    rng.shuffle(query)
    assert vocab._direct_table() is not None
    got = vocab.lookup(pa.array(query))
    assert got.dtype == np.int64
    assert got.tolist() == _reference(vocab, query.tolist())
