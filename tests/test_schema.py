"""expand_paths, infer_schema and check_files against hand-made Parquet files; atomic
writes (data.atomic, write_parts)."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.atomic import atomic_path, write_atomic
from data.errors import DataError
from data.files import expand_paths, write_parts
from data.schema import Schema, SparseFeature, check_files, infer_schema
from tests.data_helpers import write_parquet

I64, I32 = pa.int64(), pa.int32()
TYPES = {"C1": I64, "C2": I32, "C3": pa.list_(I64), "C4": pa.list_(I32), "I2": pa.float64()}


def _mixed(path: Path, c1_max: int, rows: int = 6, **kw: object) -> str:
    """label, I1 float32, C1 int64, S string, C2 int32, I2 float64, C3 list<int64>, C4 list<int32>."""
    cols = {
        "label": [0.0, 1.0] * (rows // 2),
        "I1": [0.5] * rows,
        "C1": [c1_max] + [0] * (rows - 1),
        "S": ["x"] * rows,
        "C2": list(range(rows)),
        "I2": [1.0] * rows,
        "C3": [[1, 40], None, [], [3], [2], [7]][:rows],
        "C4": [[9]] * rows,
    }
    return write_parquet(path, cols, row_group_size=2, types=TYPES, **kw)


# --------------------------------------------------------------------------- expand_paths


def test_expand_paths_directories_globs_and_lists(tmp_path: Path) -> None:
    for rel in ["b/2.parquet", "b/1.parquet", "a.parquet", "b/c/3.parquet", "_tmp/x.parquet",
                ".hidden.parquet", "b/_x.parquet", "b/notes.txt"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    t = str(tmp_path)
    assert expand_paths(t) == [f"{t}/a.parquet", f"{t}/b/1.parquet", f"{t}/b/2.parquet",
                               f"{t}/b/c/3.parquet"]
    assert expand_paths(f"{t}/b/*.parquet") == [f"{t}/b/1.parquet", f"{t}/b/2.parquet"]
    assert expand_paths(f"{t}/b/_*") == [f"{t}/b/_x.parquet"]  # asked for by name
    assert expand_paths(f"{t}/b/_x.parquet") == [f"{t}/b/_x.parquet"]
    assert expand_paths(f"{t}/a.parquet, {t}/b/c") == [f"{t}/a.parquet", f"{t}/b/c/3.parquet"]
    assert expand_paths([f"{t}/b/c", f"{t}/b/c/3.parquet"]) == [f"{t}/b/c/3.parquet"]


def test_expand_paths_orders_numbers_as_numbers(tmp_path: Path) -> None:
    """``day_10`` came before ``day_2`` and ``part-100000`` before ``part-99999``: a run
    over days in order, unshuffled, read them out of order."""
    names = [f"day_{d}/part-{p:05d}.parquet" for d in (0, 1, 2, 9, 10, 11, 23) for p in (7, 99999, 100000)]
    for rel in reversed(names):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    want = [str(tmp_path / n) for n in names]  # made in (day, part) order, written reversed
    assert expand_paths(str(tmp_path)) == want
    assert expand_paths(f"{tmp_path}/day_*/*.parquet") == want


def test_names_equal_as_numbers_take_one_order_whatever_the_listing(tmp_path: Path, monkeypatch) -> None:
    """``x1`` and ``x01`` compare equal as numbers: the listing's order (the file
    system's, and a rank's) was kept. Now text order breaks the tie, listed either way."""
    import glob as glob_mod

    for name in ["x01.parquet", "x1.parquet", "x001.parquet", "x2.parquet"]:
        (tmp_path / name).write_text("")
    t = str(tmp_path)
    want = [f"{t}/{n}" for n in ["x001.parquet", "x01.parquet", "x1.parquet", "x2.parquet"]]
    listed = glob_mod.glob
    for order in (sorted, lambda xs: sorted(xs, reverse=True)):
        monkeypatch.setattr(glob_mod, "glob", lambda p, order=order, **k: order(listed(p, **k)))
        monkeypatch.setattr(Path, "rglob", lambda self, p, order=order: iter(order(self.glob(f"**/{p}"))))
        assert expand_paths(f"{t}/x*.parquet") == want
        assert expand_paths(t) == want


def test_expand_paths_skips_private_directories_at_any_depth_of_a_glob(tmp_path: Path) -> None:
    """``out/**/*`` matched ``out/_temporary/0/part-00000.parquet`` of a Spark job still
    writing (only the last name was checked); a glob that names the directory gets it."""
    for rel in ["out/part-00000.parquet", "out/_temporary/0/part-00000.parquet", "out/_SUCCESS",
                "out/.staging/part-00001.parquet", "out/day=1/part-00002.parquet"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    t = str(tmp_path)
    kept = [f"{t}/out/day=1/part-00002.parquet", f"{t}/out/part-00000.parquet"]
    assert expand_paths(f"{t}/out/**/*") == kept
    assert expand_paths(f"{t}/out/**/*.parquet") == kept
    assert expand_paths(f"{t}/out") == kept
    assert expand_paths(f"{t}/out/_temporary/**/*.parquet") == [f"{t}/out/_temporary/0/part-00000.parquet"]


def test_a_glob_naming_a_private_directory_still_skips_the_private_names_in_it(tmp_path: Path) -> None:
    """``_*/*`` took ``_tmp/_SUCCESS`` (a '_' part of the pattern let every '_' name of
    the match through), which is no Parquet file; a '_' part answers for the names it
    matches, as a fixed ``_tmp/*`` always did."""
    for rel in ["_tmp/x.parquet", "_tmp/_SUCCESS", "_tmp/_y.parquet", "_tmp/_part/z.parquet"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    t = str(tmp_path)
    assert expand_paths(f"{t}/_tmp/*") == [f"{t}/_tmp/x.parquet"]
    assert expand_paths(f"{t}/_*/*") == [f"{t}/_tmp/x.parquet"]
    assert expand_paths(f"{t}/_*/**/*") == [f"{t}/_tmp/x.parquet"]
    assert expand_paths(f"{t}/_*/_*.parquet") == [f"{t}/_tmp/_y.parquet"]
    assert expand_paths(f"{t}/_*/_part/*") == [f"{t}/_tmp/_part/z.parquet"]


def test_a_path_with_a_comma_is_named_whole_or_in_a_list(tmp_path: Path) -> None:
    """A comma-separated string was always split: a directory named ``a,b`` could not be
    read. Named whole (it exists) or as a list entry, it is one path."""
    (tmp_path / "a,b").mkdir()
    (tmp_path / "a,b" / "x.parquet").write_text("")
    (tmp_path / "c.parquet").write_text("")
    t = str(tmp_path)
    assert expand_paths(f"{t}/a,b") == [f"{t}/a,b/x.parquet"]
    assert expand_paths([f"{t}/a,b", f"{t}/c.parquet"]) == [f"{t}/a,b/x.parquet", f"{t}/c.parquet"]
    with pytest.raises(DataError, match="no Parquet files found for '.*/a'"):
        expand_paths(f"{t}/c.parquet,{t}/a,b")  # several in one string: split, so use a list


def test_a_yaml_list_of_paths_names_the_same_files_as_the_comma_list(tmp_path: Path) -> None:
    """data.train as a YAML list (days in directories of their own), as users of
    TorchRec's and NVTabular's file lists write it; before, 'expected a string'."""
    from dlrm.config import ConfigError, load_config
    from tests.conftest import TINY

    for rel in ["day_0/a.parquet", "day_1/b.parquet", "day_2/c.parquet"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    t = str(tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text(f"data:\n  train:\n    - {t}/day_0\n    - {t}/day_1/*.parquet\n  eval: []\n")
    cfg = load_config(config, [])
    assert expand_paths(cfg.data.train) == expand_paths(f"{t}/day_0,{t}/day_1/*.parquet")
    assert expand_paths(cfg.data.train) == [f"{t}/day_0/a.parquet", f"{t}/day_1/b.parquet"]
    assert cfg.data.eval == ""  # no eval set, as data.eval= says
    assert expand_paths(load_config(TINY, [f"data.train=[{t}/day_2]"]).data.train) == [f"{t}/day_2/c.parquet"]
    with pytest.raises(ConfigError, match="data.train: expected a path or a list of paths"):
        load_config(TINY, ["data.train=[1, 2]"])


def test_expand_paths_nothing_found_names_the_spec(tmp_path: Path) -> None:
    for spec in [str(tmp_path / "missing.parquet"), str(tmp_path / "*.parquet"), str(tmp_path)]:
        with pytest.raises(DataError, match="no Parquet files found") as e:
            expand_paths(spec)
        assert spec in str(e.value)
    with pytest.raises(DataError):
        expand_paths(" , ")


# --------------------------------------------------------------------------- infer_schema


def test_infer_schema_kinds_order_and_rows_from_every_file(tmp_path: Path) -> None:
    a = _mixed(tmp_path / "a.parquet", c1_max=5)
    b = _mixed(tmp_path / "b.parquet", c1_max=99)
    s = infer_schema([a, b])
    assert s.label == "label" and s.dense == ("I1", "I2")
    assert s.sparse == (
        SparseFeature("C1", 100),
        SparseFeature("S", 1, encoding="vocabulary"),  # rows: fitted by data/preprocess.py
        SparseFeature("C2", 6),
        SparseFeature("C3", 41, multi_hot=True),
        SparseFeature("C4", 10, multi_hot=True),
    )


def test_infer_schema_reads_only_footers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = _mixed(tmp_path / "a.parquet", c1_max=5)

    def no_data(*args: object, **kw: object) -> None:
        raise AssertionError("read data pages")

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", no_data)
    monkeypatch.setattr(pq.ParquetFile, "read", no_data)
    assert infer_schema([a]).sparse[0].rows == 6


def test_infer_schema_without_statistics_reads_the_column(tmp_path: Path) -> None:
    a = _mixed(tmp_path / "a.parquet", c1_max=77, write_statistics=False)
    assert pq.ParquetFile(a).metadata.row_group(0).column(2).statistics is None
    s = infer_schema([a])
    assert [f.rows for f in s.sparse] == [78, 1, 6, 41, 10]  # S: a string, fitted later


def test_infer_schema_explicit_lists_rows_and_shared_tables(tmp_path: Path) -> None:
    a = _mixed(tmp_path / "a.parquet", c1_max=5)
    s = infer_schema([a], dense=["I2"], sparse=["C3", "C1"], rows={"C1": 1000},
                     tables={"C3": "t", "C1": "t"})
    assert s.dense == ("I2",)
    assert s.sparse == (SparseFeature("C3", 1000, "t", True), SparseFeature("C1", 1000, "t"))
    s = infer_schema([a], dense=["I1"], tables={"C2": "u", "C4": "u"})
    assert s.dense == ("I1",) and [f.name for f in s.sparse] == ["C1", "S", "C2", "C3", "C4"]
    assert [f.rows for f in s.sparse] == [6, 1, 10, 41, 10]  # C2, C4 share table u: max(6, 10)


def test_infer_schema_user_errors(tmp_path: Path) -> None:
    a = _mixed(tmp_path / "a.parquet", c1_max=5)
    with pytest.raises(DataError, match="'y'.*label column is missing"):
        infer_schema([a], label="y")
    with pytest.raises(DataError, match="a.parquet.*'C9'.*missing"):
        infer_schema([a], sparse=["C9"])
    with pytest.raises(DataError, match="'I1'.*not a sparse feature"):
        infer_schema([a], rows={"I1": 3})


# --------------------------------------------------------------------------- check_files

SCHEMA = Schema("label", ("I1",), (SparseFeature("C1", 10), SparseFeature("C3", 50, multi_hot=True)))


def test_check_files_counts_rows(tmp_path: Path) -> None:
    a = _mixed(tmp_path / "a.parquet", c1_max=5)
    b = _mixed(tmp_path / "b.parquet", c1_max=5, rows=4)
    assert check_files([a, b], SCHEMA) == [6, 4]


def test_check_files_not_parquet_or_truncated(tmp_path: Path) -> None:
    a = _mixed(tmp_path / "a.parquet", c1_max=5)
    text = tmp_path / "text.parquet"
    text.write_text("label,I1\n1,2\n")
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(Path(a).read_bytes()[: os.path.getsize(a) // 2])
    for bad in (text, cut, tmp_path / "gone.parquet"):
        with pytest.raises(DataError) as e:
            check_files([a, str(bad)], SCHEMA)
        assert str(bad) in str(e.value) and e.value.file == str(bad)


def test_check_files_missing_column_and_wrong_types(tmp_path: Path) -> None:
    a = _mixed(tmp_path / "a.parquet", c1_max=5)
    no_c1 = write_parquet(tmp_path / "no_c1.parquet", {"label": [1.0], "I1": [1.0], "C3": [[1]]})
    with pytest.raises(DataError, match=r"no_c1.parquet, column 'C1': column is missing"):
        check_files([a, no_c1], SCHEMA)
    cases = {
        "dense_str": ({"I1": ["x"]}, "I1", "string"),
        "sparse_float": ({"C1": [1.5]}, "C1", "double"),
        "single_is_list": ({"C1": [[1]]}, "C1", "list<int64>"),
        "bag_is_int": ({"C3": [1]}, "C3", "int64"),
    }
    for name, (override, column, found) in cases.items():
        cols = {"label": [1.0], "I1": [1.0], "C1": [1], "C3": [[1]], **override}
        path = write_parquet(tmp_path / f"{name}.parquet", cols)
        with pytest.raises(DataError) as e:
            check_files([path], SCHEMA)
        msg = str(e.value)
        assert f"{name}.parquet" in msg and repr(column) in msg and found in msg, msg
    int_dense = write_parquet(tmp_path / "int_dense.parquet",
                              {"label": [1], "I1": [3], "C1": [1], "C3": [[1]]})
    assert check_files([int_dense], SCHEMA) == [1]  # integer label and dense are cast


def test_check_files_int_width_may_differ_between_files(tmp_path: Path) -> None:
    """int32 in one file, int64 in another: the same ids (tests/test_user_layouts.py reads
    them against plain files, and refuses an int beside a string)."""
    a = _mixed(tmp_path / "a.parquet", c1_max=5)
    b = write_parquet(tmp_path / "b.parquet", {"label": [1.0], "I1": [1.0], "C1": [1], "C3": [[1]]},
                      types={"C1": I32})
    assert check_files([a, b], SCHEMA) == [6, 1]


def test_check_files_empty_dataset(tmp_path: Path) -> None:
    empty = write_parquet(tmp_path / "e.parquet", {"label": [], "I1": [], "C1": [], "C3": []},
                          types={"label": pa.float32(), "I1": pa.float32(), "C1": I64,
                                 "C3": pa.list_(I64)})
    with pytest.raises(DataError, match="0 rows"):
        check_files([empty, empty], SCHEMA)


# --------------------------------------------------------------------------- atomic writes


def test_write_atomic_text_and_bytes_replace_the_file(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    write_atomic(path, "first é")
    assert path.read_text(encoding="utf-8") == "first é"
    write_atomic(str(path), b"\x00second")
    assert path.read_bytes() == b"\x00second"
    assert os.listdir(tmp_path) == ["f.json"]  # no temporary file left


def test_atomic_path_keeps_the_old_file_when_the_writer_fails(tmp_path: Path) -> None:
    path = tmp_path / "plot.png"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".")  # hidden, same directory
        tmp.write_text("half")
        raise RuntimeError("writer died")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["plot.png"]
    with atomic_path(path) as tmp:
        tmp.write_text("new")
        assert path.read_text() == "old"  # nothing visible before the block ends
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["plot.png"]


def test_write_parts_failing_mid_stream_leaves_no_files(tmp_path: Path) -> None:
    schema = pa.schema([("x", pa.int64())])

    def tables():
        for i in range(3):
            yield pa.table({"x": pa.array(range(i * 4, i * 4 + 4), I64)})
        raise RuntimeError("source died")

    with pytest.raises(RuntimeError, match="source died"):
        write_parts(str(tmp_path / "out"), tables(), schema, file_rows=5, row_group_rows=2)
    assert os.listdir(tmp_path / "out") == []
    whole = [pa.table({"x": pa.array(range(7), I64)})]
    paths = write_parts(str(tmp_path / "out"), whole, schema, file_rows=5, row_group_rows=2)
    assert paths == [str(tmp_path / "out" / "part-00000.parquet"),
                     str(tmp_path / "out" / "part-00001.parquet")]
    assert sorted(os.listdir(tmp_path / "out")) == ["part-00000.parquet", "part-00001.parquet"]
    assert pq.read_table(paths[1]).column("x").to_pylist() == [5, 6]
