"""String columns through the vocabulary and the hash, read dictionary-encoded.

The reader reads a single-hot string column as the file stores it (``read_dictionary``)
and maps each row group's distinct values once (``Preprocessing._dictionary_ids``). Its
rows must equal, value for value, a Python dict over the vocabulary (row i + 1 for
``values[i]``, 0 for unseen and null) and the per-value path (``Preprocessing.ids`` on
the column decoded to plain strings): on generated strings (dictionary pages, plain
pages, nulls, several row groups, a value shared by two columns' tables) and on the
Avazu sample.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import preprocess
from data.reader import ParquetReader
from data.schema import Schema, SparseFeature
from tests.conftest import REPO

AVAZU = REPO.parent / "shared" / "data" / "avazu" / "avazu_train_head9999.csv"


def _strings(rng: np.random.Generator, n: int, distinct: int, nulls: float) -> list[str | None]:
    words = [f"w{k * 7919 % 100003:05d}-{k}" for k in rng.zipf(1.3, n) % distinct]
    return [None if rng.random() < nulls else w for w in words]


def _generated(tmp_path: Path) -> list[str]:
    rng = np.random.default_rng(0)
    paths = []
    for i, dictionary in enumerate((True, False)):  # dictionary pages, then plain pages
        n = 900
        table = pa.table({"label": rng.integers(0, 2, n).astype(np.float32),
                          "A": _strings(rng, n, 300, 0.05), "B": _strings(rng, n, 40, 0.0),
                          "H": pa.array(_strings(rng, n, 500, 0.1), pa.large_string())})
        path = tmp_path / f"part-{i}.parquet"
        pq.write_table(table, path, row_group_size=256, use_dictionary=dictionary)
        paths.append(str(path))
    return paths


def _read_all(files: list[str], schema: Schema, prep: preprocess.Preprocessing
              ) -> dict[str, np.ndarray]:
    reader = ParquetReader(files, schema, batch_size=10**6, preprocess=prep, prefetch=0)
    (batch,) = list(reader.epoch(0))
    return {k: v.values().numpy() for k, v in batch.sparse.to_dict().items()}


def _per_value(files: list[str], feature: SparseFeature, prep: preprocess.Preprocessing
               ) -> np.ndarray:
    """The per-value path: the column as plain strings, looked up as a whole."""
    col = pa.concat_arrays([c for f in files for c in pq.read_table(f, columns=[feature.name])
                            .column(feature.name).chunks])
    return prep.ids(feature, pa.chunked_array([col]))[0]


def _dict_rows(prep: preprocess.Preprocessing, feature: SparseFeature, files: list[str]
               ) -> np.ndarray:
    rows = {v: i + 1 for i, v in enumerate(prep.vocabularies[feature.table_name].values.to_pylist())}
    values = [v for f in files for v in pq.read_table(f, columns=[feature.name])
              .column(feature.name).to_pylist()]
    return np.array([rows.get(v, 0) for v in values], np.int64)


def test_generated_strings_match_a_dict_and_the_per_value_path(tmp_path: Path,
                                                              monkeypatch) -> None:
    files = _generated(tmp_path)
    schema = Schema("label", (), (SparseFeature("A", 1, encoding="vocabulary"),
                                  SparseFeature("B", 1, table="A", encoding="vocabulary"),
                                  SparseFeature("H", 1, encoding="hash")))
    prep = preprocess.fit(files, schema, preprocess.Options(
        encoding="vocabulary", encodings={"H": "hash"}, hash_rows=97, min_frequency=2))
    schema = prep.apply(schema)
    calls = []
    dictionary_ids = preprocess.Preprocessing._dictionary_ids
    monkeypatch.setattr(preprocess.Preprocessing, "_dictionary_ids",
                        lambda self, f, col: calls.append(f.name) or dictionary_ids(self, f, col))
    got = _read_all(files, schema, prep)
    assert set(calls) == {"A", "B", "H"}  # every column took the dictionary path
    for f in schema.sparse:
        want = _per_value(files, f, prep)
        assert np.array_equal(got[f.name], want), f.name
        if f.encoding == "vocabulary":
            assert np.array_equal(got[f.name], _dict_rows(prep, f, files)), f.name
    assert (got["A"] == 0).any() and (got["A"] > 0).any()  # OOV (rare, null) and seen rows
    assert set(np.unique(got["H"])) - {0} <= set(range(1, 97))


@pytest.mark.skipif(not AVAZU.is_file(), reason=f"needs {AVAZU}")
def test_avazu_sample_matches_a_dict_and_the_per_value_path(tmp_path: Path) -> None:
    import pandas as pd

    df = pd.read_csv(AVAZU, dtype={"id": str})
    path = tmp_path / "avazu.parquet"
    df.to_parquet(path, row_group_size=2500)
    strings = [f.name for f in pq.read_schema(path)
               if (pa.types.is_string(f.type) or pa.types.is_large_string(f.type))
               and f.name != "id"]
    assert {"site_id", "device_ip", "device_model"} <= set(strings)
    schema = Schema("click", (), tuple(SparseFeature(n, 1, encoding="vocabulary") for n in strings))
    prep = preprocess.fit([str(path)], schema, preprocess.Options(encoding="vocabulary",
                                                                 min_frequency=2))
    schema = prep.apply(schema)
    got = _read_all([str(path)], schema, prep)
    for f in schema.sparse:
        assert np.array_equal(got[f.name], _dict_rows(prep, f, [str(path)])), f.name
        assert np.array_equal(got[f.name], _per_value([str(path)], f, prep)), f.name


def test_a_full_int8_dictionary_with_nulls(tmp_path: Path) -> None:
    """128 values under int8 indices, and a null: the null's extra index must still fit."""
    words = [f"v{i}" for i in range(128)]
    path = tmp_path / "w.parquet"
    pq.write_table(pa.table({"label": np.zeros(256, np.float32), "S": words * 2}), path)
    schema = Schema("label", (), (SparseFeature("S", 1, encoding="vocabulary"),))
    prep = preprocess.fit([str(path)], schema, preprocess.Options(encoding="vocabulary"))
    (feature,) = prep.apply(schema).sparse
    indices = pa.array([*range(128), None, 127, 0], pa.int8())
    col = pa.chunked_array([pa.DictionaryArray.from_arrays(indices, pa.array(words))])
    rows = {v: i + 1 for i, v in enumerate(prep.vocabularies["S"].values.to_pylist())}
    want = [rows[w] for w in words] + [0, rows["v127"], rows["v0"]]
    assert prep.ids(feature, col)[0].tolist() == want
