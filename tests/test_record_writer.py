"""The compiled record writer (data/record_writer.py) writes the bytes numpy's
column-by-column copies write (the reference: rows.Layout's views, assigned with
numpy's own casts), for any row count (blocks of 512 and a remainder), into a slice of
a larger window, and from columns of other types (float64 dense, int32 and uint64 ids);
where it cannot (no dense column, no packed id) it writes nothing and says so."""

from __future__ import annotations

import numpy as np
import pytest

from data import record_writer
from data.rows import Layout
from data.schema import Schema, SparseFeature

pytest.importorskip("numba")


def _layout(n_ids: int, n_dense: int) -> Layout:
    schema = Schema(dense=tuple(f"I{j}" for j in range(n_dense)),
                    sparse=tuple(SparseFeature(f"C{k}", rows=10) for k in range(n_ids)))
    return Layout(schema, [True] * n_ids)


def _numpy_records(layout: Layout, rec: np.ndarray, ids, dense, labels) -> None:
    layout.labels(rec)[:] = labels
    for j, x in enumerate(dense):
        layout.dense(rec)[:, j] = x
    for k, x in enumerate(ids):
        layout.ids(rec)[:, k] = x


@pytest.mark.parametrize("n_ids,n_dense,rows", [(26, 13, 1200), (3, 1, 512), (1, 2, 1), (5, 4, 0)])
def test_compiled_records_equal_numpy_column_copies(n_ids: int, n_dense: int, rows: int) -> None:
    rng = np.random.default_rng(rows + n_ids)
    layout = _layout(n_ids, n_dense)
    ids = [rng.integers(-(1 << 62), 1 << 62, rows) for _ in range(n_ids)]
    ids[0] = ids[0].astype(np.int32) if rows else ids[0]  # another int type, widened
    if n_ids > 1:
        ids[1] = rng.integers(0, 1 << 64, rows, dtype=np.uint64)  # wraps as numpy's copy does
    dense = [rng.standard_normal(rows) for _ in range(n_dense)]  # float64, rounded to float32
    if n_dense > 1:  # arrow's zero-copy columns are read-only: one tuple holds both kinds
        dense[1] = dense[1].astype(np.float32)
        dense[1].flags.writeable = False
    labels = rng.random(rows).astype(np.float32)
    window = rng.integers(0, 256, (rows + 7, layout.width), dtype=np.uint8)  # garbage around it
    want = window.copy()
    _numpy_records(layout, want[5:5 + rows], ids, dense, labels)
    got = window.copy()
    assert record_writer.write(got[5:5 + rows], ids, dense, labels, layout.dense_at, layout.label_at)
    # the pad after the label is not written by either: compare everything else
    end = layout.label_at + 4
    assert np.array_equal(got[:, :end], want[:, :end])
    assert np.array_equal(got[:5], window[:5]) and np.array_equal(got[5 + rows:], window[5 + rows:])


def test_no_dense_column_or_no_packed_id_is_left_to_numpy() -> None:
    layout = _layout(2, 1)
    rec = np.zeros((4, layout.width), np.uint8)
    labels = np.ones(4, np.float32)
    assert not record_writer.write(rec, [], [np.ones(4)], labels, layout.dense_at, layout.label_at)
    assert not record_writer.write(rec, [np.ones(4, np.int64)], [], labels, layout.dense_at, layout.label_at)
    assert not rec.any()
