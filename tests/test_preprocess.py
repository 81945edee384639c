"""Categorical columns of any type: the reader's rows equal a pure-Python reference.

The reference counts values with ``collections.Counter``, orders them by count
descending then value, keeps those seen ``min_frequency`` times (at most
``max_rows - 1``), and gives value i row i + 1 (0: out-of-vocabulary, null). The hash
reference evaluates data/hashing.py's formula with Python integers, byte by byte.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from data import preprocess
from data.errors import DataError, UserError
from data.reader import ParquetReader
from data.schema import infer_schema
from tests.data_helpers import write_parquet

M64 = (1 << 64) - 1


def py_splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def py_hash_bytes(b: bytes) -> int:
    total = sum(py_splitmix64(((j << 8) + byte + 0x2545F4914F6CDD1D) & M64)
                for j, byte in enumerate(b)) & M64
    return py_splitmix64((len(b) + py_splitmix64(total)) & M64)


def py_vocabulary(values: list, min_frequency: int = 1, max_rows: int = 0) -> dict:
    counts = Counter(v for v in values if v is not None)
    order = sorted(counts, key=lambda v: (-counts[v], v))
    order = [v for v in order if counts[v] >= min_frequency]
    if max_rows:
        order = order[:max_rows - 1]
    return {v: i + 1 for i, v in enumerate(order)}


def py_hash_row(v, rows: int) -> int:
    if v is None:
        return 0
    key = py_hash_bytes(v.encode() if isinstance(v, str) else v)
    return 1 + py_splitmix64(key) % (rows - 1)


RNG = np.random.default_rng(7)
WORDS = [f"{x:08x}" for x in RNG.integers(0, 2**32, 40)] + ["", "é"]


def _column(n: int, rng: np.random.Generator, null_every: int = 11) -> list:
    picks = rng.zipf(1.3, n) % len(WORDS)
    return [None if i % null_every == 3 else WORDS[p] for i, p in enumerate(picks)]


def _files(tmp_path: Path, name: str, seed: int, n: int = 300) -> list[dict]:
    """Two files of every categorical type; returns their columns as Python lists."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(2):
        s = _column(n, rng)
        cols = {
            "label": rng.integers(0, 2, n).astype(np.float32).tolist(),
            "I1": rng.random(n).astype(np.float32).tolist(),
            "s": s,
            "ls": _column(n, rng),
            "b": [None if v is None else v.encode() for v in _column(n, rng)],
            "d": pa.array(_column(n, rng)).dictionary_encode(),
            "L": [None if i % 13 == 5 else [w for w in _column(int(rng.integers(0, 4)), rng, 5)]
                  for i in range(n)],
            "big": (rng.zipf(1.5, n) * 1_000_003 % 4_294_967_291).tolist(),
            "small": rng.integers(0, 30, n).tolist(),
            "h": _column(n, rng),
        }
        types = {"ls": pa.large_string(), "b": pa.binary(), "L": pa.list_(pa.string())}
        write_parquet(tmp_path / f"{name}{k}.parquet", cols, row_group_size=64, types=types)
        cols["d"] = cols["d"].to_pylist()
        out.append(cols)
    return out


def _read_all(files: list[str], schema, prep) -> dict[str, list]:
    """Every row of every feature (single-hot: a row; bag: a list of rows)."""
    reader = ParquetReader(files, schema, 10_000, shuffle=False, prefetch=0, preprocess=prep)
    (batch,) = list(reader.epoch(0))
    out = {}
    for f in schema.sparse:
        bags = [t.tolist() for t in batch.sparse[f.name].to_dense()]
        out[f.name] = bags if f.multi_hot else [b[0] for b in bags]
    return out


def _flat(cols: list[dict], name: str) -> list:
    rows = [v for c in cols for v in c[name]]
    if name == "L":
        return [w for bag in rows for w in (bag or [])]
    return rows


@pytest.mark.parametrize("min_frequency,max_rows", [(1, 0), (3, 0), (1, 12)])
def test_reader_rows_equal_the_python_reference(tmp_path: Path, min_frequency, max_rows) -> None:
    train_cols = _files(tmp_path, "train", seed=1)
    eval_cols = _files(tmp_path, "eval", seed=2)  # values unseen in training: OOV
    train = sorted(str(p) for p in tmp_path.glob("train*.parquet"))
    opts = preprocess.Options(encodings={"h": "hash"}, rows={"h": 97},
                              min_frequency=min_frequency, max_rows=max_rows)
    schema = infer_schema(train)
    assert [f.name for f in schema.sparse] == ["s", "ls", "b", "d", "L", "big", "small", "h"]
    prep = preprocess.fit(train, schema, opts)
    schema = prep.apply(schema)
    enc = {f.name: f.encoding for f in schema.sparse}
    assert enc == {**dict.fromkeys(["s", "ls", "b", "d", "L", "big"], "vocabulary"),
                   "small": "identity", "h": "hash"}
    for cols, name in ((train_cols, "train"), (eval_cols, "eval")):
        files = sorted(str(p) for p in tmp_path.glob(f"{name}*.parquet"))
        got = _read_all(files, schema, prep)
        for col in ["s", "ls", "b", "d", "big"]:
            vocab = py_vocabulary(_flat(train_cols, col), min_frequency, max_rows)
            want = [vocab.get(v, 0) for v in _flat(cols, col)]
            assert got[col] == want, (name, col)
            assert schema.sparse[[f.name for f in schema.sparse].index(col)].rows == len(vocab) + 1
        vocab = py_vocabulary(_flat(train_cols, "L"), min_frequency, max_rows)
        bags = [bag or [] for c in cols for bag in c["L"]]
        assert got["L"] == [[vocab.get(w, 0) for w in bag] for bag in bags]
        assert got["h"] == [py_hash_row(v, 97) for v in _flat(cols, "h")]
        assert got["small"] == _flat(cols, "small")


def test_saved_preprocessing_maps_alike_and_checks_its_files(tmp_path: Path) -> None:
    _files(tmp_path, "train", seed=3)
    train = sorted(str(p) for p in tmp_path.glob("train*.parquet"))
    schema = infer_schema(train)
    prep = preprocess.fit(train, schema, preprocess.Options(dense_transform="standardize"))
    run = tmp_path / "run"
    run.mkdir()
    sha = preprocess.save(prep, run)
    assert sha == preprocess.digest(run)
    again = preprocess.load(run)
    schema = prep.apply(schema)
    assert again.apply(infer_schema(train)) == schema
    a, b = _read_all(train, schema, prep), _read_all(train, schema, again)
    assert a == b
    vocab_file = next((run / preprocess.VOCAB_DIR).glob("*.parquet"))
    vocab_file.write_bytes(vocab_file.read_bytes()[:-9] + b"123456789")
    with pytest.raises(UserError, match="altered"):
        preprocess.load(run)


def test_zero_sparse_features_is_one_line_naming_the_columns(tmp_path: Path) -> None:
    f = write_parquet(tmp_path / "a.parquet", {"label": [0.0, 1.0], "x": [0.5, 1.5],
                                               "flag": [True, False]})
    with pytest.raises(DataError, match=r"no categorical column.*x \(double\), flag \(bool\)"):
        infer_schema([f])


def test_identity_on_a_string_column_is_refused(tmp_path: Path) -> None:
    f = write_parquet(tmp_path / "a.parquet", {"label": [0.0, 1.0], "site": ["a", "b"]})
    with pytest.raises(UserError, match="data.encodings.site=identity.*string"):
        preprocess.fit([f], infer_schema([f]), preprocess.Options(encodings={"site": "identity"}))


def test_auto_ints_dense_ids_stay_identity_sparse_ids_get_a_vocabulary(tmp_path: Path) -> None:
    n = 4000
    big_dense = np.arange(n) % 2_000_000 + 1_500_000 - n  # max > 2^20, but few distinct
    cols = {"label": [0.0] * n,
            "negative": (np.arange(n) % 5 - 2).tolist(),  # negative ids: vocabulary
            "hashed": (np.arange(n) % 50 * 85_000_007).tolist(),  # 50 values up to 4.2e9
            "range": big_dense.tolist()}
    f = write_parquet(tmp_path / "a.parquet", cols)
    schema = infer_schema([f])
    prep = preprocess.fit([f], schema, preprocess.Options())
    got = {x.name: (x.encoding, x.rows) for x in prep.apply(schema).sparse}
    assert got["negative"] == ("vocabulary", 6) and got["hashed"] == ("vocabulary", 51)
    # 4000 distinct in [1.496e6, 1.5e6): fewer than half of max + 1, so a vocabulary too
    assert got["range"] == ("vocabulary", n + 1)


def test_raw_counts_are_named_with_the_setting(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n = 5000
    cols = {"label": [0.0] * n, "C": rng.integers(0, 9, n).tolist(),
            "counts": np.floor(rng.pareto(1.0, n) * 3).astype(np.float32).tolist(),
            "ratio": rng.random(n).astype(np.float32).tolist()}
    f = write_parquet(tmp_path / "a.parquet", cols)
    schema = infer_schema([f])
    notes = preprocess.fit([f], schema, preprocess.Options()).notes
    assert notes == [("dense columns counts look like raw counts (non-negative, max >= 100x "
                     "median): set data.dense_transform=log1p")]
    assert preprocess.fit([f], schema, preprocess.Options(dense_transform="log1p")).notes == []
    prep = preprocess.fit([f], schema, preprocess.Options(dense_transforms={"counts": "standardize"}))
    x = np.asarray(cols["counts"], np.float32)
    assert prep.stats["counts"].mean == pytest.approx(x.astype(np.float64).mean(), rel=1e-9)
    assert prep.stats["counts"].std == pytest.approx(x.astype(np.float64).std(), rel=1e-6)
    assert prep.stats["counts"].median() <= np.median(x) < 2 ** 0.25 * (prep.stats["counts"].median() + 1)


def test_the_pass_leaves_out_an_unreadable_row_group_only_under_skip(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    f = write_parquet(tmp_path / "a.parquet", {"label": [0.0] * 6, "s": list("aabbbc")},
                      row_group_size=2)
    chunk = pq.ParquetFile(f).metadata.row_group(1).column(1)  # s of rows 2, 3 ("b", "b")
    with open(f, "r+b") as fh:
        fh.seek(chunk.dictionary_page_offset or chunk.data_page_offset)
        fh.write(b"\xff" * 16)
    schema = infer_schema([f])
    with pytest.raises(DataError, match="a.parquet, row group 1: cannot read"):
        preprocess.fit([f], schema, preprocess.Options())
    prep = preprocess.fit([f], schema, preprocess.Options(on_error="skip"))
    vocab = prep.vocabularies["s"]
    assert vocab.values.to_pylist() == ["a", "b", "c"] and vocab.counts.tolist() == [2, 1, 1]


def test_a_column_of_another_type_than_its_vocabulary_is_one_line(tmp_path: Path) -> None:
    train = write_parquet(tmp_path / "t.parquet", {"label": [0.0, 1.0], "c": [5_000_000, 7]})
    other = write_parquet(tmp_path / "e.parquet", {"label": [0.0, 1.0], "c": ["5000000", "7"]})
    schema = infer_schema([train])
    prep = preprocess.fit([train], schema, preprocess.Options(encoding="vocabulary"))
    schema = prep.apply(schema)
    assert _read_all([train], schema, prep)["c"] == [2, 1]  # a tie: ordered by value
    with pytest.raises(DataError, match=r"e.parquet, column 'c', row group 0: type large_string here, int64 in the data"):
        _read_all([other], schema, prep)
