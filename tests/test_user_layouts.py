"""Parquet data written the ways users write it (Spark, pandas, files from different
jobs), each read against the same rows written plainly with pyarrow: the batches must
be the same."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from data.errors import DataError
from data.schema import check_files, infer_schema
from dlrm.config import load_config
from dlrm.train.inputs import make_reader, resolve_data
from tests.conftest import TINY

N = 600


def _rows(seed: int = 5) -> pa.Table:
    """label, a float, an int id, a string id and an int bag, as pyarrow writes them."""
    rng = np.random.default_rng(seed)
    bags = [rng.integers(0, 20, rng.integers(0, 4)).tolist() for _ in range(N)]
    return pa.table({"label": (rng.random(N) < 0.4).astype(np.float32),
                     "x": rng.normal(size=N).astype(np.float32),
                     "c": pa.array(rng.integers(0, 50, N), pa.int64()),
                     "s": pa.array([f"v{v}" for v in rng.integers(0, 30, N)]),
                     "bag": pa.array(bags, pa.list_(pa.int64()))})


def _retyped(table: pa.Table, types: dict[str, pa.DataType]) -> pa.Table:
    for name, t in types.items():
        table = table.set_column(table.schema.get_field_index(name), name, table[name].cast(t))
    return table


def _batches(train: Path | str, *overrides: str) -> list:
    cfg = load_config(TINY, [f"data.train={train}", "data.eval=", "data.shuffle=false",
                             "data.batch_size=128", *overrides])
    data = resolve_data(cfg)
    reader = make_reader(cfg, data.train_files, data.schema, True, 0, 1, data.preprocess)
    try:
        return list(reader.epoch(0))
    finally:
        reader.close()


def _same_batches(got: list, want: list) -> None:
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        for a, b in ((g.labels, w.labels), (g.dense, w.dense),
                     (g.sparse.values(), w.sparse.values()), (g.sparse.lengths(), w.sparse.lengths())):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert g.sparse.keys() == w.sparse.keys()


# One file per column's other width or layout, each beside a plain file: what files from
# different jobs (Spark schema changes, pandas' category and nullable ints) hold.
OTHER_TYPES = {
    "int32_id": {"c": pa.int32()},
    "uint64_id": {"c": pa.uint64()},
    "large_string": {"s": pa.large_string()},
    "dictionary": {"s": pa.dictionary(pa.int32(), pa.string())},
    "float64_dense": {"x": pa.float64()},
    "int8_label": {"label": pa.int8()},
    "bool_label": {"label": pa.bool_()},
    "list_int32": {"bag": pa.list_(pa.int32())},
    "large_list": {"bag": pa.large_list(pa.int64())},
}


@pytest.mark.parametrize("encoding", ["auto", "hash"])
def test_files_whose_types_differ_only_in_width_or_layout_read_as_one_type(
        tmp_path: Path, encoding: str) -> None:
    """int32 beside int64, string beside large_string or dictionary, float64 beside
    float32, an int label beside a float one: the same values, so the same batches as
    the plain files. Before, 'type int64 differs from int32 in ...' stopped the run."""
    rows = _rows()
    plain = tmp_path / "plain"
    plain.mkdir()
    pq.write_table(rows.slice(0, 250), plain / "a.parquet", row_group_size=100)
    pq.write_table(rows.slice(250), plain / "b.parquet", row_group_size=100)
    want = _batches(plain, f"data.encoding={encoding}")
    for name, types in OTHER_TYPES.items():
        mixed = tmp_path / name
        mixed.mkdir()
        pq.write_table(_retyped(rows.slice(0, 250), types), mixed / "a.parquet", row_group_size=100)
        pq.write_table(rows.slice(250), mixed / "b.parquet", row_group_size=100)
        _same_batches(_batches(mixed, f"data.encoding={encoding}"), want)


def test_files_whose_ids_differ_in_kind_are_still_refused(tmp_path: Path) -> None:
    """An int id in one file and a string in another are different keys (a vocabulary or
    a hash tells 7 from '7'), so that stays one line naming both files."""
    rows = _rows()
    a = tmp_path / "a.parquet"
    b = tmp_path / "b.parquet"
    pq.write_table(_retyped(rows.slice(0, 250), {"c": pa.string()}), a)
    pq.write_table(rows.slice(250), b)
    schema = infer_schema([str(a), str(b)])
    with pytest.raises(DataError, match=r"b.parquet, column 'c': type int64 differs from string in .*a.parquet"):
        check_files([str(a), str(b)], schema)
    skipped = infer_schema([str(a), str(b)], on_error="skip")  # the odd file is left out
    assert check_files([str(a), str(b)], skipped, on_error="skip") == [250]


def _spark_output(root: Path, rows: pa.Table) -> Path:
    """What Spark's ``df.write.parquet(root)`` leaves: ``_SUCCESS``, hidden ``.crc``
    files, a ``_metadata`` summary, uuid-named parts (one of 0 rows) of different
    row-group sizes."""
    root.mkdir()
    (root / "_SUCCESS").write_bytes(b"")
    uuid = "4f1c2a9e-1111-2222-3333-444455556666"
    for i, (start, stop, group) in enumerate([(0, 250, 70), (250, 250, 10), (250, N, 100)]):
        name = f"part-{i:05d}-{uuid}-c000.snappy.parquet"
        pq.write_table(rows.slice(start, stop - start), root / name, row_group_size=group)
        (root / f".{name}.crc").write_bytes(b"\x00crc")
    pq.write_metadata(rows.schema, root / "_metadata")
    return root


def test_spark_output_named_as_a_directory_or_a_glob_reads_its_parts_once(tmp_path: Path) -> None:
    """``out/*`` matched ``_SUCCESS`` (not a readable Parquet file); a file reached twice
    (a symlinked directory beside the real one, ``..``) was read twice."""
    rows = _rows()
    plain = tmp_path / "plain.parquet"
    pq.write_table(rows, plain)
    want = _batches(plain)
    spark = _spark_output(tmp_path / "spark", rows)
    (tmp_path / "link").symlink_to(spark)
    for spec in (f"{spark}", f"{spark}/*", f"{spark}/part-*", f"{spark},{tmp_path}/link",
                 f"{spark}/*,{tmp_path}/link/../spark/*", f"{spark}/,{spark}/*"):
        _same_batches(_batches(spec), want)


def _header_warnings(train_spec: Path | str, tmp_path: Path) -> list[str]:
    from dlrm.train.trainer import train
    from tests.conftest import tiny_overrides

    cfg = load_config(TINY, tiny_overrides(**{"data.train": train_spec, "data.eval": "",
                                              "train.max_steps": 1, "data.batch_size": 64}))
    lines: list[str] = []
    train(cfg, tmp_path / "run", echo=lambda s: lines.extend(s.splitlines()))
    return [x for x in lines if x.startswith("warning:") and "integer columns" not in x]


def test_hive_partition_columns_are_named_as_not_read(tmp_path: Path) -> None:
    """Spark's ``partitionBy("date")`` writes ``date=2026-11-01/part-….parquet`` with no
    date column inside: the rows read are the plain file's, and the run now says in one
    line that the partition column is not a feature (before: not a word)."""
    rows = _rows()
    plain = tmp_path / "plain.parquet"
    pq.write_table(rows, plain)
    hive = tmp_path / "hive"
    for i, (start, stop) in enumerate([(0, 200), (200, 450), (450, N)]):
        day = hive / f"date=2026-11-0{i + 1}"
        day.mkdir(parents=True)
        pq.write_table(rows.slice(start, stop - start), day / "part-00000-1a2b.c000.snappy.parquet")
    (hive / "_SUCCESS").write_bytes(b"")
    _same_batches(_batches(hive), _batches(plain))
    assert _header_warnings(hive, tmp_path / "a") == [
        ("warning: Hive partition columns are only in the directory names, not inside the Parquet "
        "files, and are not read: date (date=2026-11-01/); to train on one, write it into the files "
        "as a column (Spark: write without partitionBy, or copy it to another column)")]
    from data.files import expand_paths

    with pytest.raises(DataError, match=r"column 'date': column is missing \(it is a Hive partition "
                                        r"key, only in directory names such as date=2026-11-01/"):
        infer_schema(expand_paths(str(hive)), sparse=["c", "date"])  # data.sparse=[c,date]
    kept = tmp_path / "kept" / "date=2026-11-01"  # a writer that keeps the column inside
    kept.mkdir(parents=True)
    pq.write_table(rows.append_column("date", pa.array(["2026-11-01"] * N)), kept / "p.parquet")
    assert _header_warnings(kept.parent, tmp_path / "b") == []


def test_eval_data_of_another_kind_than_the_vocabulary_names_its_file(tmp_path: Path, capsys) -> None:
    """A run fitted a vocabulary of strings (a list<string> bag) and is evaluated on
    files whose bag holds ints: the one line names the eval file and row group (before,
    only the column: which of the files?)."""
    from dlrm.cli import main
    from tests.conftest import tiny_overrides

    rows = _rows()
    as_strings = rows.set_column(4, "bag", pa.array([[f"t{v}" for v in b] for b in rows["bag"].to_pylist()],
                                                    pa.list_(pa.string())))
    pq.write_table(as_strings, tmp_path / "train.parquet")
    (tmp_path / "eval").mkdir()
    pq.write_table(rows.slice(0, 100), tmp_path / "eval" / "a.parquet", row_group_size=50)
    pq.write_table(rows.slice(100, 100), tmp_path / "eval" / "b.parquet", row_group_size=50)
    assert main(["train", "--config", str(TINY), "--out", str(tmp_path / "run"),
                 *tiny_overrides(**{"data.train": tmp_path / "train.parquet", "data.eval": "",
                                    "train.max_steps": 1, "data.batch_size": 64})]) == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--data", str(tmp_path / "eval")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"file {tmp_path / 'eval' / 'a.parquet'}, column 'bag', row group 0: type int64 "
                        "here, large_string in the data its vocabulary was fitted on"), err


def _read_ids(path: Path, rows: int, policy: str) -> list[int]:
    from data.reader import ParquetReader
    from data.schema import Schema, SparseFeature

    schema = Schema("label", (), (SparseFeature("c", rows), SparseFeature("bag", rows, multi_hot=True)))
    reader = ParquetReader([str(path)], schema, 64, shuffle=False, id_policy=policy, prefetch=0)
    try:
        return [int(v) for b in reader.epoch(0) for v in b.sparse.values()]
    finally:
        reader.close()


@pytest.mark.parametrize("policy", ["modulo", "hash"])
def test_uint64_ids_of_2_63_and_up_are_ids_beyond_the_table(tmp_path: Path, policy: str) -> None:
    """uint64 ids >= 2^63 (64-bit hashes as Spark and BigQuery write them) under identity
    with data.rows and an id_policy: mapped as the uint64 values they are, as Python's
    ints compute it. Before, they read as int64 and stopped the run as 'negative id
    -9223372036812775682', whatever the policy."""
    from data.hashing import splitmix64

    rng = np.random.default_rng(2)
    rows, n = 1000, 200
    ids = [2**63 + 7, *(int(v) for v in rng.integers(0, 2**64 - 1, n, dtype=np.uint64)), 5, 2**63, 2**64 - 1]
    bags = [[ids[i], ids[-i - 1]][: i % 3] for i in range(len(ids))]
    table = pa.table({"label": np.zeros(len(ids), np.float32),
                      "c": pa.array(ids, pa.uint64()), "bag": pa.array(bags, pa.list_(pa.uint64()))})
    pq.write_table(table, tmp_path / "u.parquet", row_group_size=50)

    def mapped(v: int) -> int:
        if v < rows:
            return v
        return v % rows if policy == "modulo" else int(splitmix64(np.array([v], np.uint64))[0] % rows)

    want_c = [mapped(v) for v in ids]
    want_bag = [mapped(v) for b in bags for v in b]
    got = _read_ids(tmp_path / "u.parquet", rows, policy)
    # feature-major per batch of 64: c's values, then bag's
    expect = []
    for start in range(0, len(ids), 64):
        stop = min(start + 64, len(ids))
        expect += want_c[start:stop] + [mapped(v) for b in bags[start:stop] for v in b]
    assert got == expect and len(want_bag) > 0
    with pytest.raises(DataError, match=r"row group 0, row 0: id 9223372036854775815 >= table rows 1000"):
        _read_ids(tmp_path / "u.parquet", rows, "error")


@pytest.mark.parametrize("ids", ["uint64", "int64"])
def test_identity_forced_on_64_bit_hashed_ids_is_one_line(tmp_path: Path, capsys, ids: str) -> None:
    """data.encodings={c: identity} on 64-bit hashed ids sizes the table by max id + 1
    (2^62 and more rows): one line with the ways out, where before torch's allocation
    overflowed in a traceback. The same ids under auto train (a vocabulary)."""
    from dlrm.cli import main
    from tests.conftest import tiny_overrides

    rows = _rows()
    wide = (rows["c"].to_numpy().astype(np.uint64) * np.uint64(1_000_003)
            + np.uint64(2**63 if ids == "uint64" else 2**62))
    pq.write_table(rows.set_column(2, "c", pa.array(wide, getattr(pa, ids)())), tmp_path / "t.parquet")
    overrides = tiny_overrides(**{"data.train": tmp_path / "t.parquet", "data.eval": "",
                                  "train.max_steps": 1, "data.batch_size": 64})
    assert main(["train", "--config", str(TINY), "--out", str(tmp_path / "auto"), *overrides]) == 0
    capsys.readouterr()
    assert main(["train", "--config", str(TINY), "--out", str(tmp_path / "forced"), *overrides,
                 "data.encodings={c: identity}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("dlrm train: error: table 'c' would have ") and err.endswith(
        "more than any machine holds; map the ids with data.encodings={c: vocabulary} (or hash), "
        "size the table with data.rows={c: N} and data.id_policy=hash, or leave the column out with "
        "data.exclude=[c]"), err


@pytest.mark.parametrize("nested", [False, True])
def test_a_directory_of_parquet_files_without_the_suffix_says_how_to_name_them(
        tmp_path: Path, nested: bool) -> None:
    """Hive and Hadoop name Parquet parts ``000000_0``: 'no Parquet files found' for a
    directory full of them read as if it were empty. The line now counts them and gives
    the glob that reads them, which reads the plain file's rows."""
    from data.files import expand_paths

    rows = _rows()
    pq.write_table(rows, tmp_path / "plain.parquet")
    root = tmp_path / "warehouse" / "clicks"
    part_dir = root / "dt=2026-11-01" if nested else root
    part_dir.mkdir(parents=True)
    pq.write_table(rows.slice(0, 300), part_dir / "000000_0")
    pq.write_table(rows.slice(300), part_dir / "000001_0")
    (root / "_SUCCESS").write_bytes(b"")
    with pytest.raises(DataError) as e:
        expand_paths(str(root))
    glob_spec = f"{root}/**/*" if nested else f"{root}/*"
    first = "dt=2026-11-01/000000_0" if nested else "000000_0"
    assert str(e.value) == (f"no Parquet files found for {str(root)!r} (spec {str(root)!r}): a "
                            f"directory gives the files named *.parquet below it, and it holds 2 "
                            f"other file(s), e.g. {first}; name them with a glob, e.g. {glob_spec}")
    _same_batches(_batches(glob_spec), _batches(tmp_path / "plain.parquet"))


def test_a_null_identity_id_says_how_to_train_on_it(tmp_path: Path) -> None:
    """pandas' nullable Int64 writes missing ids as nulls: the one line now gives the
    encodings that take them, and under the vocabulary they read as row 0 (the README's
    promise) while every other id gets a row of its own."""
    import pandas as pd

    rows = _rows().to_pandas()
    missing = rows.index % 37 == 3
    rows["c"] = pd.array(np.where(missing, 0, rows["c"]), dtype="Int64")
    rows.loc[missing, "c"] = pd.NA
    rows[["label", "x", "c"]].to_parquet(tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"column 'c', row group 0, row 3: null id: an identity id is "
                                        r"its own row and a null names none; data.encodings=\{c: "
                                        r"vocabulary\} \(or hash\) gives nulls row 0, data.on_error=skip"):
        _batches(tmp_path / "t.parquet")
    got = torch.cat([b.sparse.values() for b in _batches(tmp_path / "t.parquet",
                                                          "data.encodings={c: vocabulary}")])
    assert torch.equal(got == 0, torch.from_numpy(missing))


@pytest.mark.parametrize("fit_workers", [0, 2])
def test_an_empty_pandas_part_first_does_not_drop_its_string_columns(tmp_path: Path, fit_workers: int) -> None:
    """pandas writes an empty frame's object columns (strings, lists) typed null: as the
    first part, it set the schema, and the string and bag features were left out as
    'types no feature takes'; elsewhere it stopped the run ('type null is not the
    expected ...'), though 0-row files are fine. Now the schema comes from the first part
    holding rows, and the batches are the plain file's."""
    rows = _rows()
    plain = tmp_path / "plain.parquet"
    pq.write_table(rows, plain)
    parts = tmp_path / "parts"
    parts.mkdir()
    frame = rows.to_pandas()
    frame["s"] = frame["s"].astype(object)  # as pandas < 3 holds strings
    frame.iloc[:0].to_parquet(parts / "part-0.parquet")
    frame.iloc[:300].to_parquet(parts / "part-1.parquet")
    frame.iloc[300:300].to_parquet(parts / "part-2.parquet")
    frame.iloc[300:].to_parquet(parts / "part-3.parquet")
    assert pa.types.is_null(pq.read_schema(parts / "part-0.parquet").field("s").type)
    want = infer_schema([str(plain)])
    assert infer_schema(sorted(map(str, parts.iterdir()))) == want
    fit = f"data.fit_workers={fit_workers}"
    _same_batches(_batches(parts, fit), _batches(plain, fit))
