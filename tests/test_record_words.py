"""A window's records written a word at a time (data/rows.py ``WindowBuilder.write``)
against each field written alone through numpy's own views and casts: int32 and int64
ids, even and odd counts of ids and dense values, features kept as bags beside the
records, and a row holding an id past int32 (one the reader drops), which must leave
every other row whole."""

from __future__ import annotations

import numpy as np
import pytest

from data.rows import Layout, WindowBuilder
from data.schema import Schema, SparseFeature


def _layout(n_ids: int, n_dense: int, rows: int, bags: int = 0) -> Layout:
    sparse = tuple(SparseFeature(f"C{j}", rows, multi_hot=j < bags) for j in range(n_ids + bags))
    schema = Schema("label", tuple(f"I{j}" for j in range(n_dense)), sparse)
    return Layout(schema, [j >= bags for j in range(n_ids + bags)])


def _fields(layout: Layout, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    ids = [rng.integers(0, 2**31, n) for _ in range(layout.n_ids)]
    dense = [rng.normal(size=n).astype(np.float32) for _ in range(layout.n_dense)]
    return [*ids, *dense, rng.integers(0, 2, n).astype(np.float32)]


def _reference(layout: Layout, n: int, fields: list[np.ndarray]) -> np.ndarray:
    rec = np.full((n, layout.width), 0x5A, np.uint8)
    ids, dense = layout.ids(rec), layout.dense(rec)
    for s in range(layout.n_ids):
        ids[:, s] = fields[s].astype(layout.id_dtype)
    for j in range(layout.n_dense):
        dense[:, j] = fields[layout.n_ids + j]
    layout.labels(rec)[:] = fields[-1]
    return rec


def _fields_of(layout: Layout, rec: np.ndarray) -> list[np.ndarray]:
    """Every field of ``rec`` (padding left out) as bytes, to compare bit for bit."""
    return [np.ascontiguousarray(x).view(np.uint8) for x in (layout.ids(rec), layout.dense(rec),
                                                             layout.labels(rec))]


@pytest.mark.parametrize("rows", [1000, 2**33])  # int32 and int64 ids
@pytest.mark.parametrize("n_ids, n_dense, bags", [(26, 13, 0), (3, 0, 0), (1, 2, 1), (0, 4, 2), (5, 5, 0)])
def test_words_write_every_field_as_numpy_writes_it(rows: int, n_ids: int, n_dense: int, bags: int) -> None:
    layout = _layout(n_ids, n_dense, rows, bags)
    assert layout.id_dtype == (np.int64 if rows > 2**31 and n_ids else np.int32)
    n, at = 300, 17
    fields = _fields(layout, n, np.random.default_rng(n_ids * 31 + n_dense))
    window = WindowBuilder(layout)
    window.start(at + n + 5)
    window.rec[:] = 0xA5  # what the writes must cover
    window.write(at, fields)
    want = _reference(layout, n, fields)
    for got, expect in zip(_fields_of(layout, window.rec[at : at + n]), _fields_of(layout, want)):
        np.testing.assert_array_equal(got, expect)
    assert (window.rec[:at] == 0xA5).all() and (window.rec[at + n :] == 0xA5).all()  # other rows untouched
    window.write(0, [f[:9] for f in fields])  # a shorter slice after a longer one: the scratch reused
    for got, expect in zip(_fields_of(layout, window.rec[:9]), _fields_of(layout, want[:9])):
        np.testing.assert_array_equal(got, expect)


def test_an_id_past_int32_spoils_only_its_own_row() -> None:
    """An id the decoder keeps fits its int32 field; one that does not (2^40, -1) is in a
    row ``on_error=skip`` drops. It is written unmasked: its high bits may reach its own
    row's next field, and nothing of any other row."""
    layout = _layout(4, 3, 1000)
    n = 64
    fields = _fields(layout, n, np.random.default_rng(5))
    bad = [7, 40]
    fields[0][7], fields[2][40] = 2**40 + 3, -1
    window = WindowBuilder(layout)
    window.start(n)
    window.write(0, fields)
    want = _reference(layout, n, fields)
    keep = np.setdiff1d(np.arange(n), bad)
    for got, expect in zip(_fields_of(layout, window.rec[keep]), _fields_of(layout, want[keep])):
        np.testing.assert_array_equal(got, expect)


def test_the_words_cover_the_record() -> None:
    """Each field in exactly one word, in record order, each word within the record."""
    for n_ids, n_dense, rows in [(26, 13, 10), (3, 0, 10), (0, 0, 10), (5, 2, 2**40), (1, 1, 2**40)]:
        layout = _layout(n_ids, n_dense, rows)
        placed = [f for _, first, second in layout.words for f in (first, second) if f is not None]
        assert placed == list(range(n_ids + n_dense + 1))
        assert [k for k, _, _ in layout.words] == list(range(len(layout.words)))
        assert len(layout.words) * 8 <= layout.width


def test_fields_of_other_dtypes_are_taken_by_their_place() -> None:
    """A dense column given as float64 and ids as int32 are written as the record's
    float32 and id fields (the field's place says what it is, not the array's dtype)."""
    layout = _layout(3, 3, 1000)
    n = 50
    fields = _fields(layout, n, np.random.default_rng(9))
    other = [f.astype(np.int32) if i < 3 else f.astype(np.float64) for i, f in enumerate(fields)]
    window = WindowBuilder(layout)
    window.start(n)
    window.write(0, other)
    for got, expect in zip(_fields_of(layout, window.rec), _fields_of(layout, _reference(layout, n, fields))):
        np.testing.assert_array_equal(got, expect)
