"""``dlrm eval --scores FILE [--keep COLS]`` (dlrm/eval/scores.py): every eval row's
score and label in the data's order, with the kept columns beside them. References:
the data's own label and kept columns read with pyarrow (the order is right only if
they match row for row), sklearn's AUC of the written scores against the eval's
``auc``, and the file written by one process against the one written by two ranks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlrm.cli import main
from tests.conftest import TINY, tiny_overrides
from tests.multiprocess import run_ranks


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("scores") / "run"
    assert main(["train", "--config", str(TINY), "--out", str(run), *tiny_overrides(),
                 f"data.train={tiny_data['train']}", "data.eval=", "train.max_steps=30",
                 "data.batch_size=512"]) == 0
    return run


def data_columns(tiny_data, names: list[str]) -> pa.Table:
    files = sorted(Path(tiny_data["eval"]).glob("*.parquet"))
    return pa.concat_tables(pq.read_table(f, columns=names) for f in files)


def test_scores_are_in_the_datas_order_with_the_kept_columns(trained: Path, tiny_data, tmp_path: Path,
                                                             capsys) -> None:
    from sklearn.metrics import roc_auc_score

    out = tmp_path / "out" / "scores.parquet"
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(trained), "--data", str(tiny_data["eval"]),
                 "--scores", str(out), "--keep", "C3,I1", "--batch-size", "777"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["scores"] == str(out)
    written = pq.read_table(out)
    assert written.column_names == ["C3", "I1", "score", "label"]
    want = data_columns(tiny_data, ["C3", "I1", "label"])
    assert written.num_rows == want.num_rows == result["rows"] == 10_000
    assert written["C3"].equals(want["C3"]) and written["I1"].equals(want["I1"])
    assert np.array_equal(written["label"].to_numpy(), want["label"].to_numpy())
    assert roc_auc_score(written["label"].to_numpy(), written["score"].to_numpy()) == pytest.approx(
        result["auc"], abs=1e-12)


def _eval_rank(rank: int, world_size: int, run: str, data: str, out: str) -> None:
    from dlrm.eval.evaluate import evaluate_checkpoint

    evaluate_checkpoint(run, data, scores_path=out, keep=["C1"], batch_size=300)


@pytest.mark.distributed
def test_two_ranks_write_the_file_one_process_writes(trained: Path, tiny_data, tmp_path: Path) -> None:
    one, two = tmp_path / "one.parquet", tmp_path / "two.parquet"
    _eval_rank(0, 1, str(trained), str(tiny_data["eval"]), str(one))
    run_ranks(2, _eval_rank, str(trained), str(tiny_data["eval"]), str(two))
    a, b = pq.read_table(one), pq.read_table(two)
    assert a["C1"].equals(b["C1"]) and a["label"].equals(b["label"])
    assert np.allclose(a["score"].to_numpy(), b["score"].to_numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("args, says", [
    (["--keep", "C1"], "--keep names columns of the --scores file: give --scores FILE.parquet too"),
    (["--scores", "S", "--keep", "nope"], "column 'nope': column is missing (named by --keep)"),
    (["--scores", "S", "--keep", "label"], "--keep label: the scores file writes a 'label' column itself"),
    (["--scores", "DIR"], "--scores DIR: is a directory; name a .parquet file"),
])
def test_bad_scores_arguments_are_one_line(trained: Path, tiny_data, tmp_path: Path, capsys,
                                           args: list[str], says: str) -> None:
    (tmp_path / "DIR").mkdir()
    args = [str(tmp_path / a) if a in ("S", "DIR") else a for a in args]
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(trained), "--data", str(tiny_data["eval"]), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says.replace("DIR", str(tmp_path / "DIR")) in err, err
    assert not (tmp_path / "S").exists()


def test_rows_dropped_by_on_error_skip_refuse_the_scores_file(tiny_data, tmp_path: Path, capsys) -> None:
    """A bad dense value drops its row under data.on_error=skip: the scores no longer line
    up with the data's rows, so the file is refused (the metrics alone still work)."""
    first = min(Path(tiny_data["eval"]).glob("*.parquet"))
    table = pq.read_table(first)
    i1 = table.column("I1").to_numpy().copy()
    i1[5] = np.nan
    (tmp_path / "eval").mkdir()
    pq.write_table(table.set_column(table.schema.get_field_index("I1"), "I1", pa.array(i1)),
                   tmp_path / "eval" / "p.parquet")
    run = tmp_path / "run"
    assert main(["train", "--config", str(TINY), "--out", str(run), *tiny_overrides(),
                 f"data.train={tiny_data['train']}", "data.eval=", "train.max_steps=2",
                 "data.on_error=skip"]) == 0
    capsys.readouterr()
    out = tmp_path / "scores.parquet"
    data = str(tmp_path / "eval")
    assert main(["eval", "--checkpoint", str(run), "--data", data, "--scores", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{table.num_rows - 1:,} rows were scored of the data's {table.num_rows:,}" in err
    assert not out.exists()
    assert main(["eval", "--checkpoint", str(run), "--data", data]) == 0


def test_a_kept_column_stored_narrower_in_another_file_is_written(trained: Path, tiny_data,
                                                                   tmp_path: Path, capsys) -> None:
    """Files may store a column in another width (int32 here, int64 there): the reader
    takes both, and so does the scores file (in the first file's type)."""
    first = min(Path(tiny_data["eval"]).glob("*.parquet"))
    table = pq.read_table(first)
    (tmp_path / "eval").mkdir()
    half = table.num_rows // 2
    pq.write_table(table.slice(0, half), tmp_path / "eval" / "a.parquet")
    rest = table.slice(half)
    i = rest.schema.get_field_index("C1")
    pq.write_table(rest.set_column(i, "C1", rest.column("C1").cast(pa.int32())), tmp_path / "eval" / "b.parquet")
    out = tmp_path / "scores.parquet"
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(trained), "--data", str(tmp_path / "eval"),
                 "--scores", str(out), "--keep", "C1"]) == 0
    written = pq.read_table(out)
    assert written.schema.field("C1").type == pa.int64()
    assert written["C1"].to_pylist() == table["C1"].to_pylist()
