"""Held-out eval with ids training never saw (issue 25, items 2 and 3): by default an
id past its trained table is left out of its bag (looked up as nothing) and counted
per column beside the AUC; ``--strict-ids`` refuses it as before. The reference is
the same checkpoint scored on batches built here with those ids taken out of their
bags by numpy, and sklearn's metrics of those scores."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import log_loss, roc_auc_score

from data.batch import Batch
from data.jagged import JaggedFeatures
from dlrm.cli import main
from tests.conftest import TINY, tiny_overrides
from tests.data_helpers import write_parquet

N_TRAIN, N_EVAL = 800, 400


def columns(rng: np.random.Generator, n: int, clicks: int, uid: int, tag: int) -> dict:
    return {
        "label": rng.integers(0, 2, n).astype(np.float32),
        "spend": rng.random(n).astype(np.float32),
        "clicks_7d": rng.integers(0, clicks, n),  # a count taken as sparse (item 2)
        "user_id": rng.integers(0, uid, n),
        "tags": [list(rng.integers(0, tag, int(k))) for k in rng.integers(0, 4, n)],
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    rng = np.random.default_rng(3)
    root = tmp_path_factory.mktemp("unseen")
    train = columns(rng, N_TRAIN, 42, 100, 50)
    for name, top in (("clicks_7d", 41), ("user_id", 99)):  # the training maxima, surely
        train[name][:1] = top
    train["tags"][0] = [49]
    evals = columns(rng, N_EVAL, 60, 130, 70)  # past each maximum: counts, ids, bag ids
    write_parquet(root / "train.parquet", train)
    write_parquet(root / "eval.parquet", evals)
    run = root / "run"
    assert main(["train", "--config", str(TINY), "--out", str(run), *tiny_overrides(),
                 f"data.train={root / 'train.parquet'}", "data.eval=", "data.batch_size=64",
                 "train.max_steps=6"]) == 0
    return {"run": run, "eval": root / "eval.parquet", "cols": evals,
            "rows": {"clicks_7d": 42, "user_id": 100, "tags": 50}}


def reference_scores(trained: dict) -> tuple[np.ndarray, np.ndarray]:
    """The checkpoint's scores on the eval rows with the unseen ids taken out by numpy."""
    from dlrm.checkpoint import manager as ck
    from dlrm.checkpoint import manifest
    from dlrm.config import Config, from_dict
    from dlrm.eval.predict import predict
    from dlrm.parallel.parallelize import build_model

    ckpt = ck.find_checkpoint(trained["run"])
    meta = manifest.load_meta(ckpt)
    cfg, schema = from_dict(Config, meta["config"], ""), manifest.schema_from_json(meta["schema"])
    model = build_model(cfg, schema)
    ck.load_checkpoint(ckpt, model, None, None, schema)
    cols, values, lengths = trained["cols"], [], []
    for name in schema.sparse_names:
        bags = [[v] if np.isscalar(v) or np.ndim(v) == 0 else list(v) for v in cols[name]]
        kept = [[int(v) for v in bag if v < trained["rows"][name]] for bag in bags]
        values += [v for bag in kept for v in bag]
        lengths += [len(bag) for bag in kept]
    assert schema.dense == ("spend",)
    batch = Batch(dense=torch.from_numpy(cols["spend"][:, None].copy()),
                  sparse=JaggedFeatures(keys=schema.sparse_names, values=torch.tensor(values),
                                        lengths=torch.tensor(lengths), stride=N_EVAL),
                  labels=torch.from_numpy(cols["label"]))
    scores, labels = predict(model, [batch])
    return scores.numpy(), labels.numpy()


@pytest.mark.slow
def test_eval_looks_up_unseen_ids_as_nothing_and_counts_them(trained, capsys) -> None:
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(trained["run"]), "--data", str(trained["eval"])]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cols, rows = trained["cols"], trained["rows"]
    expected = {"clicks_7d": int((cols["clicks_7d"] >= 42).sum()),
                "user_id": int((cols["user_id"] >= 100).sum()),
                "tags": sum(int(v >= 50) for bag in cols["tags"] for v in bag)}
    assert all(n > 0 for n in expected.values())
    assert result["unseen_ids"] == expected
    scores, labels = reference_scores(trained)
    assert result["rows"] == N_EVAL
    assert result["auc"] == pytest.approx(roc_auc_score(labels, scores), abs=1e-9)
    assert result["logloss"] == pytest.approx(log_loss(labels, scores), rel=1e-6)
    assert set(rows) == set(expected)


def test_the_eval_set_does_not_size_the_tables(trained, tmp_path: Path, capsys) -> None:
    """Trained beside its eval set: the tables the training data gives, the same
    parameters as without the eval set, and its ids past them counted as unseen, as
    ``dlrm eval`` counts them. Until 2026-12-07 the eval files sized the tables too (this
    module's fixture trained without its eval set for that): the eval set changed the
    model trained, and one eval id of 2,000,000 made a table of 2M rows."""
    from tests.run_state import run_state

    run = tmp_path / "run"
    assert main(["train", "--config", str(TINY), "--out", str(run), *tiny_overrides(),
                 f"data.train={trained['eval'].parent / 'train.parquet'}", f"data.eval={trained['eval']}",
                 "data.batch_size=64", "train.max_steps=6"]) == 0
    rows = {f["name"]: f["rows"] for f in json.loads((run / "schema.json").read_text())["sparse"]}
    assert rows == trained["rows"]
    got, want = run_state(run), run_state(trained["run"])
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    summary = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(trained["run"]), "--data", str(trained["eval"])]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["eval_unseen_ids"] == result["unseen_ids"] and summary["eval_auc"] == result["auc"]


@pytest.mark.slow
def test_strict_ids_keeps_the_refusal(trained, capsys) -> None:
    capsys.readouterr()
    code = main(["eval", "--checkpoint", str(trained["run"]), "--data", str(trained["eval"]),
                 "--strict-ids"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert ">= table rows" in err[0] and "clicks_7d" in err[0] and "eval.parquet" in err[0]


def test_reader_drop_policy_against_numpy(tmp_path: Path) -> None:
    """id_policy="drop" on its own: bags equal numpy's filtering, in two row groups (one
    with nothing dropped, so chunks of both forms are joined), and the count per column."""
    from data.reader import ParquetReader
    from data.schema import Schema, SparseFeature

    uid = np.array([1, 7, 2, 9, 0, 3, 1, 2])  # row group 2 (rows 4-7) has nothing >= 5
    tags = [[1, 6], [], [8], [2, 3], [0], [4], [], [1]]
    write_parquet(tmp_path / "f.parquet", {"label": np.zeros(8, np.float32), "uid": uid,
                                           "tags": tags}, row_group_size=4)
    schema = Schema("label", (), (SparseFeature("uid", 5), SparseFeature("tags", 5, multi_hot=True)))
    reader = ParquetReader([str(tmp_path / "f.parquet")], schema, 8, prefetch=0, id_policy="drop")
    (batch,) = list(reader.epoch(0))
    kept = [[v] if v < 5 else [] for v in uid] + [[v for v in bag if v < 5] for bag in tags]
    assert batch.sparse.values().tolist() == [v for bag in kept for v in bag]
    assert batch.sparse.lengths().tolist() == [len(bag) for bag in kept]
    assert reader.unseen_ids == {"uid": 2, "tags": 2}
