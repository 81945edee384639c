"""``Scorer`` (dlrm/eval/scorer.py): rows held in memory scored from Python. The
reference is ``dlrm eval --scores``, which reads the same rows from their Parquet files
through the reader, in the data's order: every score must be the one it wrote for the
same row (to float32's last bit where the rows are cut into other batches): a run with
multi-hot bags and unseen ids, one with string vocabularies, an int8 export and a
TorchRec run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from data.errors import DataError, UserError
from dlrm.cli import main
from dlrm.eval.scorer import Scorer
from tests.conftest import TINY, requires_torchrec, tiny_overrides


def _eval_scores(run: Path, data: Path, out: Path) -> np.ndarray:
    assert main(["eval", "--checkpoint", str(run), "--data", str(data), "--scores", str(out)]) == 0
    return pq.read_table(out).column("score").to_numpy()


def _rows(data: Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(f) for f in sorted(data.glob("*.parquet")))


def _train(run: Path, train: Path, **extra: object) -> Path:
    assert main(["train", "--config", str(TINY), "--out", str(run),
                 *tiny_overrides(**{"data.train": train, "data.eval": "", "train.max_steps": 20,
                                    "data.batch_size": 512, **extra})]) == 0
    return run


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("scorer") / "run", tiny_data["train"])


def test_scores_of_a_table_a_frame_and_a_batch_are_the_evals(trained: Path, tiny_data, tmp_path: Path) -> None:
    want = _eval_scores(trained, tiny_data["eval"], tmp_path / "s.parquet")
    rows = _rows(tiny_data["eval"])
    assert any(pa.types.is_list(t) for t in rows.schema.types)  # multi-hot bags are scored too
    with Scorer(trained) as scorer:
        np.testing.assert_array_equal(scorer.score(rows), want)
        frame = rows.slice(1000, 2345).to_pandas().drop(columns=["label"])  # no label, a slice
        # cut into other batches than the eval's: a matmul's float32 sums may differ in the last bit
        np.testing.assert_allclose(scorer.score(frame), want[1000:3345], rtol=1e-6, atol=0)
        unlabelled = frame.assign(label=np.nan)  # rows not labelled yet: a null label was refused
        np.testing.assert_allclose(scorer.score(unlabelled), want[1000:3345], rtol=1e-6, atol=0)
        categories = frame.astype({"C1": "category", "I3": "category"})  # was "type dictionary<...> does not fit"
        np.testing.assert_allclose(scorer.score(categories), want[1000:3345], rtol=1e-6, atol=0)
        batch = rows.slice(17, 5).to_batches()[0]
        np.testing.assert_allclose(scorer.score(batch), want[17:22], rtol=1e-6, atol=0)
        assert scorer.score(rows.slice(0, 0)).shape == (0,)


def test_unseen_ids_are_taken_as_the_eval_takes_them(trained: Path, tiny_data, tmp_path: Path) -> None:
    """Ids past the trained tables look up as nothing in both, and are counted."""
    rows = _rows(tiny_data["eval"]).slice(0, 3000)
    ids = rows.column("C1").to_numpy().copy()
    ids[::7] += 10**9
    rows = rows.set_column(rows.schema.get_field_index("C1"), "C1", pa.array(ids, rows.schema.field("C1").type))
    (tmp_path / "unseen").mkdir()
    pq.write_table(rows, tmp_path / "unseen" / "part-0.parquet")
    want = _eval_scores(trained, tmp_path / "unseen", tmp_path / "s.parquet")
    with Scorer(trained) as scorer:
        np.testing.assert_array_equal(scorer.score(rows), want)
        assert scorer.unseen_ids == {"C1": len(ids[::7])}


def test_string_vocabularies_and_an_int8_export(tiny_data, tmp_path: Path) -> None:
    """String columns (a vocabulary fitted by the run) given as Python strings in a
    DataFrame; an int8 export scored as `dlrm eval` scores it."""
    data = {}
    for split in ("train", "eval"):
        t = _rows(tiny_data[split])
        for name in ("C2", "C5"):
            words = pa.array([f"w{v}" for v in t.column(name).to_numpy()], pa.string())
            t = t.set_column(t.schema.get_field_index(name), name, words)
        (tmp_path / split).mkdir()
        pq.write_table(t, tmp_path / split / "part-0.parquet", row_group_size=4096)
        data[split] = t
    run = _train(tmp_path / "run", tmp_path / "train")
    export = tmp_path / "export"
    assert main(["export", "--checkpoint", str(run), "--out", str(export), "--tables", "int8"]) == 0
    for model in (run, export):
        want = _eval_scores(model, tmp_path / "eval", tmp_path / f"{model.name}.parquet")
        with Scorer(model) as scorer:
            np.testing.assert_array_equal(scorer.score(data["eval"].to_pandas()), want)
            words = data["eval"].to_pandas().astype({"C2": "category"})  # dictionary<string>, as read
            np.testing.assert_array_equal(scorer.score(words), want)
    assert not np.array_equal(_eval_scores(run, tmp_path / "eval", tmp_path / "a.parquet"),
                              _eval_scores(export, tmp_path / "eval", tmp_path / "b.parquet"))


@requires_torchrec
def test_a_torchrec_run_scores_as_its_eval(tiny_data, tmp_path: Path) -> None:
    run = _train(tmp_path / "run", tiny_data["train"], **{"embeddings.backend": "torchrec"})
    want = _eval_scores(run, tiny_data["eval"], tmp_path / "s.parquet")
    with Scorer(run) as scorer:
        np.testing.assert_array_equal(scorer.score(_rows(tiny_data["eval"])), want)


def test_bad_rows_name_the_column_and_the_row(trained: Path, tiny_data) -> None:
    frame = _rows(tiny_data["eval"]).slice(0, 3000).to_pandas()
    with Scorer(trained) as scorer:
        with pytest.raises(DataError, match=r"^column 'C3': column is missing from the rows to score"):
            scorer.score(frame.drop(columns=["C3"]))
        frame.loc[2500, "I2"] = float("nan")
        with pytest.raises(DataError, match=r"^column 'I2', row 2500: null dense value"):
            scorer.score(frame)


@pytest.mark.gpu
def test_scores_on_the_gpu_are_the_cpus(trained: Path, tiny_data) -> None:
    """The model loaded onto CUDA (its tables on the Triton kernels) scores as on the CPU."""
    rows = _rows(tiny_data["eval"])
    with Scorer(trained) as cpu, Scorer(trained, device="cuda") as gpu:
        np.testing.assert_allclose(gpu.score(rows), cpu.score(rows), rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_cuda_asked_for_where_there_is_none_is_one_line(trained: Path) -> None:
    with pytest.raises(UserError, match=r"^device cuda: this machine has no CUDA device; score on the CPU"):
        Scorer(trained, device="cuda")
