"""data/key_table.py, the hash table a vocabulary's lookups use, against the binary
search of sorted keys that it replaced (Vocabulary.rows_of_keys without a table)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from data import key_table
from data.vocabulary import Vocabulary, value_keys

pytest.importorskip("numba")


def searched(vocab_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """The first row (index + 1) of each key among ``vocab_keys``, else 0: a binary search."""
    by_key = np.argsort(vocab_keys, kind="stable")
    sorted_keys = vocab_keys[by_key]
    found = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
    return np.where(sorted_keys[found] == keys, by_key[found] + 1, 0)


@pytest.mark.parametrize("size", [1, 7, 1000, 100_000])
def test_the_table_finds_what_the_binary_search_finds(size: int) -> None:
    """Keys over the whole int64 range (negative ones: uint64 bits), repeated keys (the
    first row keeps one, as two strings of one hash), queries that hit and miss."""
    rng = np.random.default_rng(size)
    vocab_keys = rng.integers(-(2**63), 2**63 - 1, size, dtype=np.int64)
    vocab_keys[rng.integers(0, size, size // 10)] = vocab_keys[0]  # a key several values share
    queries = np.concatenate([rng.permutation(vocab_keys), rng.integers(-(2**63), 2**63 - 1, size, dtype=np.int64),
                              np.array([0, -1, 2**63 - 1, -(2**63)], dtype=np.int64)])
    table = key_table.build(vocab_keys)
    assert table is not None and len(table.keys) >= size / key_table.MAX_LOAD
    got = table.find(queries)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, searched(vocab_keys, queries))
    assert (got[:size] > 0).all() and got[0] == 1 + int(np.argmax(vocab_keys == queries[0]))


@pytest.mark.parametrize("kind", ["int", "string"])
def test_a_vocabulary_looks_up_alike_with_and_without_the_table(kind: str) -> None:
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 5000, 2000)
    values = pa.array(ids) if kind == "int" else pa.array([f"v{i}" for i in ids], pa.large_string())
    vocab = Vocabulary(values, np.ones(len(values), np.int64), len(values))
    queries = pa.array(rng.integers(0, 10_000, 3000)) if kind == "int" else \
        pa.array([f"v{i}" for i in rng.integers(0, 10_000, 3000)], pa.large_string())
    keys = value_keys(queries)
    with_table = vocab.rows_of_keys(keys)
    assert isinstance(vocab._table, key_table.KeyTable)
    without = Vocabulary(values, vocab.counts, vocab.distinct, _table=False).rows_of_keys(keys)
    np.testing.assert_array_equal(with_table, without)
    np.testing.assert_array_equal(with_table, searched(value_keys(values), keys))
    assert (with_table > 0).any() and (with_table == 0).any()
