"""Column types a user's Parquet has beyond float, int and string.

A bool column (pandas writes ``is_mobile`` and a ``click`` label that way) trains as a
dense 0/1 value and a bool label as 0/1; before, a bool label was refused and a bool
feature dropped without a word. Columns no feature can take (timestamps, decimals,
structs) are named in one warning line instead of vanishing from the model.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.errors import DataError
from data.schema import check_files, infer_schema
from dlrm.config import load_config
from dlrm.train.inputs import make_reader, resolve_data
from dlrm.train.trainer import train
from tests.conftest import TINY, tiny_overrides

N = 512


def _write(path: Path, bool_copies: bool) -> dict[str, np.ndarray]:
    """label and flag as bool (or, for the reference, as float32), a float, an id, and a
    timestamp no feature takes."""
    rng = np.random.default_rng(3)
    label, flag = rng.random(N) < 0.3, rng.random(N) < 0.6
    cols = {"label": label if bool_copies else label.astype(np.float32),
            "x": rng.random(N).astype(np.float32),
            "flag": flag if bool_copies else flag.astype(np.float32),
            "c": rng.integers(0, 40, N),
            "seen_at": pa.array([datetime.datetime(2026, 1, 1) + datetime.timedelta(minutes=int(m))
                                 for m in rng.integers(0, 10**5, N)])}
    pq.write_table(pa.table(cols), path, row_group_size=128)
    return cols


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("types")
    out = {}
    for name, as_bool in (("bool", True), ("float", False)):
        (root / name).mkdir()
        _write(root / name / "part-0.parquet", as_bool)
        out[name] = root / name
    return out


def test_a_bool_column_is_a_dense_0_1_value_and_a_bool_label_works(sets) -> None:
    schema = infer_schema([str(sets["bool"] / "part-0.parquet")])
    assert schema.dense == ("x", "flag") and [f.name for f in schema.sparse] == ["c"]
    assert check_files([str(sets["bool"] / "part-0.parquet")], schema) == [N]
    batches = {}
    for name, path in sets.items():  # the float copy is the reference, standardized too
        cfg = load_config(TINY, [f"data.train={path}", "data.shuffle=false", "data.batch_size=256",
                                 "data.dense_transform=standardize"])
        data = resolve_data(cfg)
        reader = make_reader(cfg, data.train_files, data.schema, True, 0, 1, data.preprocess)
        batches[name] = list(reader.epoch(0))
        reader.close()
    assert len(batches["bool"]) == len(batches["float"]) == 2
    for got, want in zip(batches["bool"], batches["float"], strict=True):
        assert torch_equal(got.labels, want.labels) and torch_equal(got.dense, want.dense)
        assert set(got.labels.unique().tolist()) == {0.0, 1.0}


def torch_equal(a, b) -> bool:
    return bool((a == b).all()) and a.shape == b.shape and a.dtype == b.dtype


def test_a_bool_column_named_sparse_is_refused_with_the_way_to_use_it(sets) -> None:
    path = str(sets["bool"] / "part-0.parquet")
    schema = infer_schema([path], sparse=["c", "flag"])
    with pytest.raises(DataError, match=r"column 'flag': type bool is not the expected int: a bool "
                                        r"column trains as a dense 0/1 value \(data.dense\)"):
        check_files([path], schema)


def test_columns_no_feature_takes_are_named_in_one_warning(sets, tmp_path: Path) -> None:
    cfg = load_config(TINY, tiny_overrides(**{"data.train": sets["bool"], "data.eval": "",
                                              "train.max_steps": 1, "data.batch_size": 64}))
    lines: list[str] = []
    train(cfg, tmp_path / "run", echo=lambda s: lines.extend(s.splitlines()))
    warned = [x for x in lines if "left out" in x]
    assert warned == [("warning: columns of types no feature takes are left out: seen_at "
                      "(timestamp[us]); to train on one, cast it to float (dense) or to int or "
                      "string (sparse) in the Parquet files")]
    assert any(x.startswith("schema   2 dense, 1 sparse; inferred from the footer: float, bool") for x in lines)
