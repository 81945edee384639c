"""Columns a user's file carries that are no feature (Avazu's per-row ``id``), as pandas
writes them: ``data.exclude`` leaves them out of the inference, the fit warns about a
column whose values are nearly all distinct (naming the exclude), and a file with no
dense column builds its model without torch's zero-element warning. References:
``infer_schema`` told the same columns by ``data.sparse``; numpy's count of distinct
values."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from data.errors import DataError
from data.preprocess import fit
from data.schema import infer_schema
from dlrm.config import load_config
from dlrm.models.dlrm import mlp
from dlrm.train.header import left_out_warning
from dlrm.train.inputs import prep_options
from tests.conftest import TINY
from tests.data_helpers import write_parquet

N = 3000


@pytest.fixture(scope="module")
def avazu_like(tmp_path_factory) -> str:
    rng = np.random.default_rng(0)
    cols = {
        "id": np.array([f"{v:020d}" for v in rng.permutation(10**6)[:N]]),  # one per row
        "click": rng.integers(0, 2, N),
        "site_id": np.array([f"s{v}" for v in rng.integers(0, 300, N)]),
        "device_ip": np.array([f"ip{v}" for v in rng.integers(0, 2000, N)]),  # many, not all, distinct
        "C14": rng.integers(0, 50, N),
    }
    return write_parquet(tmp_path_factory.mktemp("avazu_like") / "f.parquet", cols)


def test_exclude_leaves_a_column_out_of_the_inference(avazu_like: str) -> None:
    excluded = infer_schema([avazu_like], label="click", exclude=["id"])
    told = infer_schema([avazu_like], label="click", sparse=["site_id", "device_ip", "C14"])
    assert excluded == told and "id" not in excluded.columns
    with pytest.raises(DataError, match="column 'nope'.*missing"):
        infer_schema([avazu_like], label="click", exclude=["nope"])
    with pytest.raises(DataError, match="data.exclude names a column data.dense or data.sparse takes"):
        infer_schema([avazu_like], label="click", sparse=["id", "C14"], exclude=["id"])


def test_the_fit_names_a_row_identifier_and_the_exclude(avazu_like: str) -> None:
    import pyarrow.parquet as pq

    ids = pq.read_table(avazu_like).column("id").to_numpy()
    cfg = load_config(TINY, ["data.label=click"])
    schema = infer_schema([avazu_like], label="click")
    notes = fit([avazu_like], schema, prep_options(cfg)).notes
    (warning,) = [n for n in notes if n.startswith("warning:")]
    assert f"id ({len(np.unique(ids)):,} distinct values in {N:,} rows)" in warning
    assert warning.endswith("leave it out with data.exclude=[id]")
    assert "device_ip" not in warning  # 2000 possible values over 3000 rows: repeats
    kept = infer_schema([avazu_like], label="click", exclude=["id"])
    assert not [n for n in fit([avazu_like], kept, prep_options(cfg)).notes if n.startswith("warning:")]


def test_an_excluded_column_of_no_feature_type_is_not_warned_about(tmp_path: Path) -> None:
    import datetime

    when = np.array([datetime.datetime(2026, 1, 1)] * 10, dtype="datetime64[us]")
    path = write_parquet(tmp_path / "f.parquet", {"label": np.zeros(10, np.float32), "ts": when,
                                                 "c": np.arange(10)})
    schema = infer_schema([path], exclude=["ts"])
    assert left_out_warning(schema, path) is not None  # not excluded: named
    assert left_out_warning(schema, path, ["ts"]) is None


def test_no_dense_column_builds_the_bottom_mlp_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bottom = mlp(0, [8, 4], relu_last=True)
    out = bottom(torch.zeros(3, 0))
    assert out.shape == (3, 4)  # a learned constant vector: the bias alone


@pytest.fixture(scope="module")
def hashed_ids(tmp_path_factory) -> Path:
    """Avazu's id as pandas reads it: uint64 values past 2^63, one per row."""
    rng = np.random.default_rng(1)
    root = tmp_path_factory.mktemp("hashed")
    cols = {"click": rng.integers(0, 2, N).astype(np.float32),
            "id": rng.integers(2**63, 2**64 - 1, N, dtype=np.uint64),
            "site_id": np.array([f"s{v}" for v in rng.integers(0, 300, N)])}
    write_parquet(root / "f.parquet", cols)
    return root


def test_an_identity_table_of_hashed_ids_is_one_line_before_anything_is_written(
        hashed_ids: Path, tmp_path: Path, capsys) -> None:
    from dlrm.cli import main

    run = tmp_path / "run"
    argv = ["train", "--config", str(TINY), "--out", str(run), f"data.train={hashed_ids}", "data.eval=",
            "data.label=click", "train.max_steps=2"]
    assert main([*argv, "data.encodings={id: identity}"]) == 2  # before: an overflow traceback
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "table 'id' would have" in err
    assert "data.encodings={id: vocabulary}" in err and "data.exclude=[id]" in err and not run.exists()
    assert main(["plan", "--config", str(TINY), "--world-size", "2", "--data", str(hashed_ids),
                 "data.label=click", "data.encodings={id: identity}"]) == 2
    assert "more than any machine holds" in capsys.readouterr().err
    assert main([*argv]) == 0  # auto: a vocabulary, as before


def test_a_reused_fit_without_a_column_is_one_line(hashed_ids: Path, tmp_path: Path, capsys) -> None:
    from dlrm.cli import main

    fitted = tmp_path / "fit"
    assert main(["fit", "--config", str(TINY), "--data", str(hashed_ids), "--out", str(fitted),
                 "data.label=click", "data.exclude=[id]"]) == 0
    capsys.readouterr()
    run = tmp_path / "run"
    argv = ["train", "--config", str(TINY), "--out", str(run), f"data.train={hashed_ids}", "data.eval=",
            "data.label=click", "train.max_steps=2", f"data.preprocessing={fitted}"]
    assert main(argv) == 2  # before: an overflow traceback (id left to identity)
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"data.preprocessing={fitted} has no mapping for the sparse column id: it was "
                        "fitted over other columns; run with the data.sparse / data.exclude it was "
                        "fitted with, or fit again")
    assert main([*argv, "data.exclude=[id]"]) == 0
