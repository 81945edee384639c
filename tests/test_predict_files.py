"""``dlrm predict`` (dlrm/eval/predict_files.py): scores of rows that need no label,
written row group by row group in the data's order. References: ``dlrm eval --scores``
of the same rows (its own reader, batches and gather), and the data's own columns read
with pyarrow (the order is right only if the kept columns match row for row)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlrm.cli import main
from tests.conftest import TINY, tiny_overrides


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("predict") / "run"
    assert main(["train", "--config", str(TINY), "--out", str(run),
                 *tiny_overrides(**{"data.train": tiny_data["train"], "data.eval": "",
                                    "train.max_steps": 20, "data.batch_size": 512})]) == 0
    return run


def _unlabeled(tiny_data, out: Path) -> pa.Table:
    """The eval files without their label column, as one file of small row groups."""
    rows = pa.concat_tables(pq.read_table(f) for f in sorted(Path(tiny_data["eval"]).glob("*.parquet")))
    out.mkdir()
    pq.write_table(rows.drop_columns(["label"]), out / "part-00000.parquet", row_group_size=3000)
    return rows


def test_scores_of_unlabeled_rows_are_the_evals_in_the_datas_order(trained: Path, tiny_data,
                                                                   tmp_path: Path, capsys) -> None:
    assert main(["eval", "--checkpoint", str(trained), "--data", str(tiny_data["eval"]),
                 "--scores", str(tmp_path / "eval.parquet")]) == 0
    want = pq.read_table(tmp_path / "eval.parquet").column("score").to_numpy()
    rows = _unlabeled(tiny_data, tmp_path / "unlabeled")
    capsys.readouterr()
    out = tmp_path / "out" / "scores.parquet"
    assert main(["predict", "--checkpoint", str(trained), "--data", str(tmp_path / "unlabeled"),
                 "--out", str(out), "--keep", "C1,I3,C1", "--device", "cpu"]) == 0
    assert '"rows": 10000' in capsys.readouterr().out
    got = pq.read_table(out)
    assert got.column_names == ["C1", "I3", "score"]
    assert got.select(["C1", "I3"]).equals(rows.select(["C1", "I3"]))
    # row groups of 3000 are other batches than the eval's: float32's last bit may differ
    np.testing.assert_allclose(got.column("score").to_numpy(), want, rtol=1e-6, atol=0)


def test_a_bad_value_is_one_line_naming_where_and_nothing_is_written(trained: Path, tiny_data,
                                                                     tmp_path: Path, capsys) -> None:
    rows = _unlabeled(tiny_data, tmp_path / "ok").drop_columns(["label"])
    dense = rows.column("I2").to_numpy().copy()
    dense[7123] = np.nan  # row group 2 (rows 6000..8999) of the file
    bad = rows.set_column(rows.schema.get_field_index("I2"), "I2", pa.array(dense))
    (tmp_path / "bad").mkdir()
    pq.write_table(bad, tmp_path / "bad" / "part-00000.parquet", row_group_size=3000)
    out = tmp_path / "scores.parquet"
    capsys.readouterr()
    assert main(["predict", "--checkpoint", str(trained), "--data", str(tmp_path / "bad"),
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("dlrm predict: error: "), err
    assert "part-00000.parquet, column 'I2', row group 2, row 7123: dense value nan" in err, err
    assert not out.exists() and list(tmp_path.glob("*.tmp*")) == [] and list(tmp_path.glob(".*")) == []
    pq.write_table(rows.drop_columns(["C4"]), tmp_path / "bad" / "part-00000.parquet")
    assert main(["predict", "--checkpoint", str(trained), "--data", str(tmp_path / "bad"),
                 "--out", str(out)]) == 2
    assert "column 'C4': column is missing" in capsys.readouterr().err


def test_a_kept_column_of_other_types_in_other_files_is_widened_or_one_line(trained: Path, tiny_data,
                                                                             tmp_path: Path, capsys) -> None:
    """An id column int32 in one file and int64 in the next: the first file's type was the
    output's, and the next file's ids past int32 stopped predict with a pyarrow traceback."""
    rows = _unlabeled(tiny_data, tmp_path / "ok").drop_columns(["label"])
    ids = np.arange(rows.num_rows, dtype=np.int64) + 2**40
    data = tmp_path / "mixed"
    data.mkdir()
    pq.write_table(rows.slice(0, 4000).append_column("id", pa.array(np.arange(4000, dtype=np.int32))),
                   data / "part-00000.parquet")
    pq.write_table(rows.slice(4000).append_column("id", pa.array(ids[4000:])), data / "part-00001.parquet")
    out = tmp_path / "scores.parquet"
    assert main(["predict", "--checkpoint", str(trained), "--data", str(data), "--out", str(out),
                 "--keep", "id"]) == 0
    got = pq.read_table(out).column("id")
    assert got.type == pa.int64()
    np.testing.assert_array_equal(got.to_numpy(), np.concatenate([np.arange(4000), ids[4000:]]))
    pq.write_table(rows.slice(4000).append_column("id", pa.array([f"u{i}" for i in range(rows.num_rows - 4000)])),
                   data / "part-00001.parquet")
    capsys.readouterr()
    assert main(["predict", "--checkpoint", str(trained), "--data", str(data), "--out", str(out),
                 "--keep", "id"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "part-00001.parquet, column 'id': column kept by --keep is int32 in " in err, err
    assert err.endswith("part-00000.parquet and string here: no one type holds both"), err


@pytest.mark.parametrize("verb", ["predict", "eval"])
def test_an_output_never_overwrites_the_data_nor_lands_among_it(trained: Path, tiny_data, tmp_path: Path,
                                                                 capsys, verb: str) -> None:
    """``predict --out`` and ``eval --scores`` naming a --data file overwrote it without a
    word (found 2026-12-07); one inside a --data directory would be read as data by every
    later run. Both are one line, exit 2, the data as it was; a name the reader skips
    (``_scores.parquet``) and a file beside the directory are written."""
    data = tmp_path / "data"
    data.mkdir()
    src = min(Path(tiny_data["eval"]).glob("*.parquet"))
    (data / "part-0.parquet").write_bytes(src.read_bytes())
    before = (data / "part-0.parquet").read_bytes()
    flag = "--out" if verb == "predict" else "--scores"
    cases = [(str(data / "part-0.parquet"), str(data), "is one of the --data files"),
             (str(data / "part-0.parquet"), str(data / "part-0.parquet"), "is one of the --data files"),
             (str(data / "scores.parquet"), str(data), "is inside the --data directory")]
    for out, given, words in cases:
        capsys.readouterr()
        assert main([verb, "--checkpoint", str(trained), "--data", given, flag, out]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and f"{flag} {out}: {words}" in err, err
    assert (data / "part-0.parquet").read_bytes() == before and sorted(p.name for p in data.iterdir()) == [
        "part-0.parquet"]
    for out in (data / "_scores.parquet", tmp_path / "scores.parquet"):
        assert main([verb, "--checkpoint", str(trained), "--data", str(data), flag, str(out)]) == 0
        assert pq.read_table(out).num_rows == pq.read_table(src).num_rows
