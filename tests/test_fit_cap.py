"""data.max_rows while counting (data/fit_cap.py): with the sketch on, a capped table's
exact pass counts only values whose estimate reaches a floor, and the vocabulary equals
the one of plain counting (reference: the same fit with data.fit_sketch=false, and
collections.Counter through tests/test_preprocess.py's py_vocabulary), with ties at the
cut, ints and strings, one process and 2 workers. A floor set too high is caught and the
table counted again, uncut."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import fit_cap, preprocess
from data.schema import infer_schema
from tests.test_preprocess import py_vocabulary


def _files(root: Path) -> tuple[list[str], dict[str, list]]:
    """A head of heavy ids, 60 ids tied at 6 each (the cut falls among them), a long tail
    of ids seen once; the same as strings."""
    rng = np.random.default_rng(11)
    ids = np.concatenate([np.repeat(np.arange(10) + (1 << 33), 40), np.repeat(np.arange(60) + 7000, 6),
                          rng.integers(1 << 34, 1 << 40, 3000)])
    ids = ids[rng.permutation(len(ids))]
    cols = {"label": np.zeros(len(ids), np.float32), "ids": ids,
            "word": [f"w{x % 100_000}" for x in ids]}
    out = []
    for k, part in enumerate(np.array_split(np.arange(len(ids)), 3)):
        path = root / f"part-{k}.parquet"
        pq.write_table(pa.table({c: [v[i] for i in part] if isinstance(v, list) else v[part]
                                 for c, v in cols.items()}), path, row_group_size=300)
        out.append(str(path))
    return out, {"ids": ids.tolist(), "word": cols["word"]}


def _fit(files: list[str], **kw) -> preprocess.Preprocessing:
    return preprocess.fit(files, infer_schema(files), preprocess.Options(
        encoding="vocabulary", max_rows=41, **kw))  # 40 values: 10 heavy + 30 of the tied 60


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=[pytest.mark.slow,
                                                                pytest.mark.distributed])])
def test_capped_fit_counts_less_and_equals_plain_counting(tmp_path: Path, workers: int) -> None:
    files, columns = _files(tmp_path)
    plain = _fit(files, sketch=False)
    cut = _fit(files, workers=workers)
    for name, values in columns.items():
        want, got = plain.vocabularies[name], cut.vocabularies[name]
        assert got.values.to_pylist() == want.values.to_pylist()
        assert got.counts.tolist() == want.counts.tolist()
        expected = py_vocabulary(values, 1, 41)
        assert {v: i + 1 for i, v in enumerate(got.values.to_pylist())} == expected
        assert want.distinct == len(set(values))
        assert got.distinct < want.distinct / 4  # the tail was never counted exactly


def test_a_floor_too_high_is_caught_and_counted_again(tmp_path: Path, monkeypatch) -> None:
    files, columns = _files(tmp_path)
    plain = _fit(files, sketch=False)
    real = fit_cap.floors
    monkeypatch.setattr(fit_cap, "floors", lambda *a: {t: 30 for t in real(*a)})
    cut = _fit(files)  # floor 30: only the 10 heavy ids reach it, not 40 values
    for name in columns:
        assert cut.vocabularies[name].values.equals(plain.vocabularies[name].values)
        assert cut.vocabularies[name].distinct == plain.vocabularies[name].distinct  # uncut
