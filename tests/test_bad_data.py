"""data.on_error: every bad-data case under "fail" and "skip", through the reader and the CLI.

Dense column I1 holds each row's number within the dataset (file a: 0..23, file b:
24..39), so a test knows exactly which rows a reader yielded; the bad values sit at
known rows of file a (row groups of 8 rows).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.bad_data import BadRecord, count
from data.errors import DataError
from data.reader import ParquetReader
from data.schema import Schema, SparseFeature
from dlrm.cli import main
from dlrm.config import load_config
from dlrm.train.trainer import train
from tests.conftest import TINY, tiny_overrides
from tests.data_helpers import write_parquet
from tests.multiprocess import run_ranks
from tests.run_state import assert_states_close, run_state

SCHEMA = Schema("label", ("I1", "I2"),
                (SparseFeature("C1", 10), SparseFeature("C2", 10, multi_hot=True)))
TYPES = {"label": pa.float32(), "I1": pa.float32(), "I2": pa.float32(), "C1": pa.int64(),
         "C2": pa.list_(pa.int64())}
A_ROWS, B_ROWS, GROUP = 24, 16, 8


def columns(start: int, n: int) -> dict[str, list[Any]]:
    """Good rows numbered start..start+n-1 (in I1); bags of 0..2 ids, the first one null."""
    ids = range(start, start + n)
    return {"label": [float(i % 2) for i in ids], "I1": [float(i) for i in ids],
            "I2": [0.5] * n, "C1": [i % 10 for i in ids],
            "C2": [None if i == start else [i % 10] * (i % 3) for i in ids]}


def write(path: Path, cols: dict[str, list[Any]], types: dict | None = None) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_parquet(path, cols, GROUP, {**TYPES, **(types or {})})


# column, row in file a, bad value, words of the reason
VALUES = {
    "null_label": ("label", 2, None, "null label"),
    "label_range": ("label", 3, 2.0, "label 2.0 outside [0, 1]"),
    "null_dense": ("I2", 9, None, "null dense value"),
    "nan_dense": ("I2", 10, math.nan, "dense value nan"),
    "inf_dense": ("I2", 11, -math.inf, "dense value -inf"),
    "null_id": ("C1", 12, None, "null id"),
    "negative_id": ("C1", 17, -3, "negative id -3"),
    "big_id": ("C1", 20, 10, "id 10 >= table rows 10"),
    "bag_null": ("C2", 22, [1, None], "null id inside a bag"),
    "bag_negative": ("C2", 5, [2, -1], "negative id -1"),
    "bag_big": ("C2", 23, [3, 11], "id 11 >= table rows 10"),
}


def bad_a(tmp: Path, cases: list[str]) -> str:
    """File a with the bad values of ``cases`` planted."""
    cols = columns(0, A_ROWS)
    for case in cases:
        column, row, value, _ = VALUES[case]
        cols[column][row] = value
    return write(tmp / "a.parquet", cols)


def read(files: list[str], on_error: str, world_size: int = 1, **kw: Any
         ) -> tuple[list[list[Any]], list[BadRecord]]:
    """Every rank's batches of one epoch (batch 6, shuffled windows of 6) and the distinct
    records of all ranks (each rank records the files it leaves out)."""
    kw = {"shuffle": True, "seed": 5, "shuffle_buffer": 6, "prefetch": 0, **kw}
    readers = [ParquetReader(files, SCHEMA, 6, rank=r, world_size=world_size,
                             on_error=on_error, **kw) for r in range(world_size)]
    batches = [list(r.epoch(0)) for r in readers]
    return batches, list(dict.fromkeys(rec for r in readers for rec in r.bad_data.records))


def row_ids(ranks: list[list[Any]]) -> list[int]:
    return sorted(int(i) for batches in ranks for b in batches for i in b.dense[:, 0].tolist())


def one_line(e: pytest.ExceptionInfo, *words: str) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


# --------------------------------------------------------------------------- bad values


@pytest.mark.parametrize("case", sorted(VALUES))
def test_bad_value_fails_or_is_skipped(case: str, tmp_path: Path) -> None:
    column, row, _, words = VALUES[case]
    files = [bad_a(tmp_path, [case]), write(tmp_path / "b.parquet", columns(A_ROWS, B_ROWS))]
    with pytest.raises(DataError) as e:
        read(files, "fail")
    one_line(e, "a.parquet", f"column {column!r}", f"row group {row // GROUP}", f"row {row}:",
             words)

    ranks, records = read(files, "skip", world_size=2)
    assert len({len(batches) for batches in ranks}) == 1  # same steps on every rank
    assert row_ids(ranks) == [i for i in range(A_ROWS + B_ROWS) if i != row]
    assert len(records) == 1
    r = records[0]
    assert (r.file, r.row_group, r.column, r.row, r.rows) == (files[0], row // GROUP, column, row, 1)
    assert words in r.reason


def test_all_bad_values_at_once_same_rows_on_every_rank_and_on_resume(tmp_path: Path) -> None:
    files = [bad_a(tmp_path, list(VALUES)), write(tmp_path / "b.parquet", columns(A_ROWS, B_ROWS))]
    bad_rows = {row for _, row, _, _ in VALUES.values()}
    for world_size in (1, 2, 3):
        ranks, records = read(files, "skip", world_size)
        assert row_ids(ranks) == sorted(set(range(A_ROWS + B_ROWS)) - bad_rows)
        assert {(r.column, r.row) for r in records} == {(c, row) for c, row, _, _ in VALUES.values()}
        assert count(records) == {"rows": len(bad_rows), "row_groups": 3, "files": 0}
        # Each rank's batches: a pure function of (seed, epoch, rank, step), bad rows or not.
        again, _ = read(files, "skip", world_size)
        for rank in range(world_size):
            assert [b.dense.tolist() for b in again[rank]] == [b.dense.tolist() for b in ranks[rank]]
            reader = ParquetReader(files, SCHEMA, 6, rank=rank, world_size=world_size,
                                   on_error="skip", shuffle=True, seed=5, shuffle_buffer=6)
            for k in (1, 3):
                resumed = [b.dense.tolist() for b in reader.epoch(0, start_step=k)]
                assert resumed == [b.dense.tolist() for b in ranks[rank][k:]]


def test_every_row_bad_gives_empty_batches(tmp_path: Path) -> None:
    cols = columns(0, A_ROWS)
    cols["label"] = [None] * A_ROWS
    ranks, records = read([write(tmp_path / "a.parquet", cols)], "skip", world_size=2)
    assert [len(b) for b in ranks] == [4, 4] and all(b.size == 0 for r in ranks for b in r)
    assert count(records)["rows"] == A_ROWS


# --------------------------------------------------------------------------- bad files


def drifted(path: Path, kind: str) -> str:
    cols = columns(A_ROWS, B_ROWS)
    if kind == "type":  # an id column written as float
        return write(path, cols, {"C1": pa.float64()})
    del cols["I2"]  # "missing"; types differing between files: tests/test_user_layouts.py
    return write(path, cols)


@pytest.mark.parametrize("kind, column, words", [
    ("type", "C1", "type double is not the expected int"),
    ("missing", "I2", "column is missing"),
])
def test_schema_drift(kind: str, column: str, words: str, tmp_path: Path) -> None:
    a = write(tmp_path / "a.parquet", columns(0, A_ROWS))
    b = drifted(tmp_path / "b.parquet", kind)
    with pytest.raises(DataError) as e:
        read([a, b], "fail")
    one_line(e, "b.parquet", f"column {column!r}", words)

    ranks, records = read([a, b], "skip", world_size=2)
    assert row_ids(ranks) == list(range(A_ROWS))
    assert records == [BadRecord(b, records[0].reason, None, column, 0, B_ROWS)]
    assert words in records[0].reason


def test_truncated_and_not_parquet_files(tmp_path: Path) -> None:
    a = write(tmp_path / "a.parquet", columns(0, A_ROWS))
    good = Path(write(tmp_path / "src.parquet", columns(A_ROWS, B_ROWS)))
    b, c = tmp_path / "b.parquet", tmp_path / "c.parquet"
    b.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    c.write_bytes(b"label,I1\n1,2\n")
    for bad in (b, c):
        with pytest.raises(DataError) as e:
            read([a, str(bad)], "fail")
        one_line(e, bad.name, "not a readable Parquet file")
    ranks, records = read([a, str(b), str(c)], "skip", world_size=2)
    assert row_ids(ranks) == list(range(A_ROWS))
    assert [(r.file, r.row_group, r.row, r.rows) for r in records] == [
        (str(b), None, None, None), (str(c), None, None, None)]
    assert count(records) == {"rows": 0, "row_groups": 0, "files": 2}


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_zero_row_files_are_fine(on_error: str, tmp_path: Path) -> None:
    empty = {k: v[:0] for k, v in columns(0, 1).items()}
    files = [write(tmp_path / "0.parquet", empty), write(tmp_path / "a.parquet", columns(0, A_ROWS)),
             write(tmp_path / "b.parquet", empty)]
    ranks, records = read(files, on_error, world_size=2)
    assert row_ids(ranks) == list(range(A_ROWS)) and records == []
    with pytest.raises(DataError, match="hold 0 rows"):
        read([files[0], files[2]], on_error)


def test_only_bad_files_is_an_error_under_skip(tmp_path: Path) -> None:
    b = drifted(tmp_path / "b.parquet", "missing")
    with pytest.raises(DataError, match=r"no usable rows: 1 of the 1 .*b.parquet.*missing"):
        read([b], "skip")


def smash_row_group(path: str, g: int) -> None:
    """Overwrite the first page header of row group g's first column with garbage."""
    chunk = pq.ParquetFile(path).metadata.row_group(g).column(0)
    at = chunk.dictionary_page_offset or chunk.data_page_offset
    with open(path, "r+b") as fh:
        fh.seek(at)
        fh.write(b"\xff" * 16)


def test_unreadable_row_group(tmp_path: Path) -> None:
    a = write(tmp_path / "a.parquet", columns(0, A_ROWS))
    smash_row_group(a, 1)
    with pytest.raises(DataError) as e:
        read([a], "fail", shuffle=False)
    one_line(e, "a.parquet", "row group 1", "cannot read")
    ranks, records = read([a], "skip", world_size=2, shuffle=False)
    assert row_ids(ranks) == [*range(8), *range(16, 24)]
    # rank 0 reads rows [0, 12), rank 1 [12, 24): each records its slice of row group 1
    assert sorted((r.row_group, r.row, r.rows) for r in records) == [(1, 8, 4), (1, 12, 4)]
    assert count(records) == {"rows": 8, "row_groups": 1, "files": 0}


def test_file_vanishing_mid_epoch(tmp_path: Path) -> None:
    def start(on_error: str) -> tuple[list[str], Any]:
        files = [write(tmp_path / on_error / "a.parquet", columns(0, A_ROWS)),
                 write(tmp_path / on_error / "b.parquet", columns(A_ROWS, B_ROWS))]
        reader = ParquetReader(files, SCHEMA, 8, on_error=on_error, shuffle_buffer=8, prefetch=0)
        it = reader.epoch(0)
        first = next(it)  # reads a's first row group only
        os.remove(files[1])
        return files, (reader, first, it)

    _, (_, _, it) = start("fail")
    with pytest.raises(DataError) as e:
        list(it)
    one_line(e, "b.parquet", "row group 0", "does not exist")

    files, (reader, first, it) = start("skip")
    rest = list(it)
    assert len(rest) + 1 == reader.steps_per_epoch() == 5
    assert row_ids([[first, *rest]]) == list(range(A_ROWS)) and [b.size for b in rest[-2:]] == [0, 0]
    assert [(r.file, r.row_group, r.row, r.rows, r.reason) for r in reader.bad_data.records] == [
        (files[1], 0, 0, 8, "does not exist"), (files[1], 1, 8, 8, "does not exist")]


# --------------------------------------------------------------------------- the CLI


def dataset(root: Path) -> dict[str, str]:
    """a: every bad value; b0: no rows; c: drifted; d: truncated; e: 16 good rows."""
    a = bad_a(root, list(VALUES))
    write(root / "b0.parquet", {k: v[:0] for k, v in columns(0, 1).items()})
    c = drifted(root / "c.parquet", "type")
    good = Path(write(root.parent / "src.parquet", columns(100, 16)))
    (root / "d.parquet").write_bytes(good.read_bytes()[:300])
    e = write(root / "e.parquet", columns(200, 16))
    return {"a": a, "c": c, "d": str(root / "d.parquet"), "e": e}


def train_argv(data: Path | str, run: Path, *extra: str) -> list[str]:
    return ["train", "--config", str(TINY), "--out", str(run), *tiny_overrides(),
            f"data.train={data}", "data.batch_size=8", "data.dense=[I1,I2]",
            "data.sparse=[C1,C2]", "data.rows={C1: 10, C2: 10}", *extra]


def test_cli_fail_names_the_first_bad_input(tmp_path: Path, capsys) -> None:
    files = dataset(tmp_path / "data")
    assert main(train_argv(tmp_path / "data", tmp_path / "run")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert "d.parquet" in err and "not a readable Parquet file" in err
    assert not (tmp_path / "run").exists()
    assert main(train_argv(f"{files['c']},{files['e']}", tmp_path / "run")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "c.parquet, column 'C1': type double" in err
    assert main(train_argv(f"{files['a']},{files['e']}", tmp_path / "run", "data.shuffle=false")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "a.parquet, column 'label', row group 0, row 2: null label" in err


def test_cli_skip_trains_and_reports_every_bad_input(tmp_path: Path, capsys) -> None:
    files = dataset(tmp_path / "data")
    run = tmp_path / "run"
    code = main(train_argv(tmp_path / "data", run, "data.on_error=skip", f"data.eval={files['a']}",
                           "train.epochs=1"))
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = [json.loads(x) for x in (run / "bad_data.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["split"] == "train"]
    want = {("a.parquet", c, row // GROUP, row) for c, row, _, _ in VALUES.values()}
    want |= {("c.parquet", "C1", None, 0), ("d.parquet", None, None, None)}
    assert {(Path(x["file"]).name, x["column"], x["row_group"], x["row"]) for x in train} == want
    assert len(train) == len(want)
    evals = [x for x in lines if x["split"] == "eval"]
    # at eval an id past its table is an unseen id (left out of its bag, counted), not a
    # bad row: the eval's bad rows are the others
    eval_bad = {(c, r) for key, (c, r, _, _) in VALUES.items() if key not in ("big_id", "bag_big")}
    assert {(x["column"], x["row"]) for x in evals} == eval_bad
    n_eval_bad = len({r for _, r in eval_bad})
    eval_groups = len({r // GROUP for _, r in eval_bad})

    summary = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]
    bad = summary["bad_data"]
    n_bad = len({row for _, row, _, _ in VALUES.values()})
    assert bad["rows"] == n_bad + B_ROWS and bad["row_groups"] == 3 and bad["files"] == 2
    assert bad["eval_rows"] == n_eval_bad and summary["eval_rows"] == A_ROWS - n_eval_bad
    assert summary["eval_unseen_ids"] == {"C1": 1, "C2": 1}
    # every row of the readable files is either trained or listed as bad
    assert bad["rows_trained"] == A_ROWS - n_bad + 16
    assert bad["rows_trained"] + bad["rows"] == A_ROWS + B_ROWS + 16
    assert (f"skipped {n_bad + B_ROWS} bad rows in 3 row groups and 2 whole files "
            f"(eval: {n_eval_bad} rows, {eval_groups} row groups, 0 files); "
            f"see {run / 'bad_data.jsonl'}") in out

    # dlrm eval under the run's policy lists what it skipped
    assert main(["eval", "--checkpoint", str(run), "--data", files["a"]]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["rows"] == A_ROWS - n_eval_bad and result["bad_data"]["rows"] == n_eval_bad
    assert {(x["column"], x["row"]) for x in result["bad_data"]["records"]} == eval_bad
    assert result["unseen_ids"] == {"C1": 1, "C2": 1}


def test_cli_skip_an_unreadable_row_group_trains_to_the_end_and_records_it(tmp_path: Path, capsys) -> None:
    """A row group that cannot be decoded, skipped: the run ends with its summary and
    the record is written (its slice's size came from numpy, an int64 json could not
    write: the run died at its final save and the record was lost, 2026-12-07)."""
    a = write(tmp_path / "data" / "a.parquet", columns(0, A_ROWS))
    smash_row_group(a, 1)
    run = tmp_path / "run"
    code = main(train_argv(tmp_path / "data", run, "data.on_error=skip", f"data.eval={a}"))
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = [json.loads(x) for x in (run / "bad_data.jsonl").read_text().splitlines()]
    assert sorted((x["split"], x["row_group"], x["row"], x["rows"]) for x in lines) == [
        ("eval", 1, GROUP, GROUP), ("train", 1, GROUP, GROUP)]
    assert f"skipped {GROUP} bad rows in 1 row groups" in out


def test_cli_skip_without_bad_data_writes_an_empty_report(tmp_path: Path, capsys) -> None:
    e = write(tmp_path / "e.parquet", columns(0, 40))
    code = main(train_argv(Path(e), tmp_path / "run", "data.on_error=skip"))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert (tmp_path / "run" / "bad_data.jsonl").read_text() == ""
    assert "skipped 0 bad rows in 0 row groups" in out
    summary = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary[-1]["bad_data"]["rows_trained"] == 40


def test_loss_is_normalised_by_the_rows_really_trained(tmp_path: Path, capsys) -> None:
    """One SGD step over file a with its bad rows skipped equals one step over a file
    holding only a's good rows, in the same order (a mean over 13 rows, not 24)."""
    a = bad_a(tmp_path / "bad", list(VALUES))
    bad_rows = {row for _, row, _, _ in VALUES.values()}
    good = {k: [v for i, v in enumerate(col) if i not in bad_rows]
            for k, col in columns(0, A_ROWS).items()}
    clean = write(tmp_path / "clean" / "a.parquet", good)
    sgd = ("optim.dense=sgd", "optim.sparse=sgd", "data.shuffle=false", "data.batch_size=32")
    assert main(train_argv(a, tmp_path / "skip", "data.on_error=skip", *sgd)) == 0
    assert main(train_argv(clean, tmp_path / "clean_run", *sgd)) == 0
    capsys.readouterr()
    assert_states_close(run_state(tmp_path / "skip"), run_state(tmp_path / "clean_run"),
                        "skip vs clean")


def _train_skip(rank: int, world_size: int, data: Path, out: Path) -> dict:
    argv = train_argv(data, out, "data.on_error=skip", f"data.eval={data / 'a.parquet'}")
    return train(load_config(TINY, argv[5:]), out, echo=lambda s: None)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_skip_the_rows_one_process_skips(tmp_path: Path) -> None:
    """No deadlock when ranks drop different numbers of rows; the 2-rank run equals one
    process reading its global batches (loss over the rows both ranks really trained)."""
    dataset(tmp_path / "data")
    summaries = run_ranks(2, _train_skip, tmp_path / "data", tmp_path / "w2")
    ref = tmp_path / "ref"
    argv = train_argv(tmp_path / "data", ref, "data.on_error=skip", "data.order_world_size=2",
                      f"data.eval={tmp_path / 'data' / 'a.parquet'}")
    want = train(load_config(TINY, argv[5:]), ref, echo=lambda s: None)
    assert_states_close(run_state(tmp_path / "w2"), run_state(ref), "skip W=2")
    for got in summaries:
        assert {k: v for k, v in got["bad_data"].items() if k != "records"} == \
            {k: v for k, v in want["bad_data"].items() if k != "records"}
    assert want["bad_data"]["rows_trained"] == A_ROWS - len({r for _, r, _, _ in VALUES.values()}) + 16

    def records(run: Path) -> set[str]:
        return set((run / "bad_data.jsonl").read_text().splitlines())

    assert records(tmp_path / "w2") == records(ref)


def test_resumed_run_keeps_the_records_of_the_first(tmp_path: Path, capsys) -> None:
    """Windows of 8 rows: the first incarnation reads only the first window; the resumed
    one never reads it again, so its records survive only through bad_data.jsonl."""
    dataset(tmp_path / "data")
    run = tmp_path / "run"
    argv = train_argv(tmp_path / "data", run, "data.on_error=skip", "data.shuffle_buffer=8")
    assert main([*argv, "train.max_steps=1"]) == 0
    first = set((run / "bad_data.jsonl").read_text().splitlines())
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out
    lines = (run / "bad_data.jsonl").read_text().splitlines()
    assert first < set(lines) and len(lines) == len(set(lines))
    rows = {(Path(x["file"]).name, x["row"]) for x in map(json.loads, lines)}
    assert rows == {("a.parquet", r) for _, r, _, _ in VALUES.values()} | {
        ("c.parquet", 0), ("d.parquet", None)}


def test_schema_inference_leaves_bad_files_out_under_skip(tmp_path: Path) -> None:
    from data.schema import infer_schema

    files = dataset(tmp_path / "data")  # a: ids up to 10 (C1) and 11 (C2)
    cols = columns(A_ROWS, B_ROWS)
    cols["C1"] = [500] * B_ROWS
    c = write(tmp_path / "c500.parquet", cols, {"C1": pa.float64()})  # drifted, ids to 500
    paths = [files["a"], c, files["d"], files["e"]]
    with pytest.raises(DataError, match="d.parquet: not a readable Parquet file"):
        infer_schema(paths, dense=["I1", "I2"])
    schema = infer_schema(paths, dense=["I1", "I2"], on_error="skip")
    assert [(f.name, f.rows, f.multi_hot) for f in schema.sparse] == [
        ("C1", 11, False), ("C2", 12, True)]  # max ids of a and e only


def test_a_data_error_quoting_a_library_message_over_several_lines_is_one_line() -> None:
    """pyarrow's message for a corrupt page runs over three lines (the last a lone ")"
    after the fit's "cannot read ("): every DataError is one line, and ``quoted`` makes
    a quoted message one line before it is put in parentheses."""
    from data.errors import quoted

    pyarrow_says = OSError("Couldn't deserialize thrift: Variable-length int over 10 bytes.\n"
                           "Deserializing page header failed.\n")
    e = DataError(f"cannot read ({quoted(pyarrow_says)})", file="a.parquet", row_group=2)
    assert str(e) == ("file a.parquet, row group 2: cannot read (Couldn't deserialize thrift: "
                      "Variable-length int over 10 bytes. Deserializing page header failed.)")
    assert str(DataError("first\n  second\n")) == "first second"
    assert quoted(ValueError("x" * 500)) == "x" * 200
