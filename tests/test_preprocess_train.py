"""The preprocessing in whole runs: string data trains with no flag, data.dense_transform
equals transformed data, resume and dlrm eval reuse the saved mapping (never refit;
unseen values go to row 0), and 1, 2 and 3 ranks fit and train alike."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from data.errors import UserError
from data.preprocess import FILE
from dlrm.checkpoint.manager import CheckpointError
from dlrm.config import load_config
from dlrm.eval.evaluate import evaluate_checkpoint
from dlrm.train.trainer import train
from tests.conftest import TINY, tiny_overrides
from tests.multiprocess import run_ranks
from tests.run_state import assert_states_close, run_state


def string_dataset(path: Path, n: int, seed: int, log1p: bool = False) -> Path:
    """Hex-string categoricals (3 single-hot, 1 list<string>), 2 raw-count dense columns
    (``log1p``: given log(1 + x) already, by the reader's own float32 op), a planted signal."""
    rng = np.random.default_rng(seed)
    ids = {c: rng.zipf(1.4, n) % card for c, card in (("site", 50), ("app", 300), ("dev", 2000))}
    counts = np.floor(rng.pareto(1.1, (2, n)) * 4).astype(np.float32)
    logit = 0.9 * np.log1p(counts[0]) - 2.0 + np.where(ids["site"] % 3 == 0, 1.0, -0.5)
    label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    dense = np.log1p(np.maximum(counts, np.float32(0))) if log1p else counts
    cols = {"click": label, "n1": dense[0], "n2": dense[1]}
    for c, v in ids.items():
        cols[c] = [f"{x * 2654435761 % 2**32:08x}" for x in v]
    cols["tags"] = [[f"t{t}" for t in rng.integers(0, 20, rng.integers(0, 4))] for _ in range(n)]
    path.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), path / "part-0.parquet", row_group_size=500)
    return path


def cfg_for(train_dir: Path, eval_dir: Path, *extra: str):
    return load_config(TINY, tiny_overrides(**{"data.train": train_dir, "data.eval": eval_dir}) + [
        "data.label=click", "data.batch_size=256", "train.log_every=1", *extra])


def summary(run: Path) -> dict:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.fixture(scope="module")
def strings(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("strings")
    return {"train": string_dataset(root / "train", 2500, 1),
            "eval": string_dataset(root / "eval", 800, 2),
            "train_log": string_dataset(root / "train_log", 2500, 1, log1p=True),
            "eval_log": string_dataset(root / "eval_log", 800, 2, log1p=True)}


@pytest.mark.slow
def test_log1p_setting_equals_data_given_log1p(strings, tmp_path: Path) -> None:
    said: list[str] = []
    train(cfg_for(strings["train"], strings["eval"], "data.dense_transform=log1p"),
          tmp_path / "setting", echo=said.append)
    train(cfg_for(strings["train_log"], strings["eval_log"]), tmp_path / "given", echo=lambda s: None)
    a, b = run_state(tmp_path / "setting"), run_state(tmp_path / "given")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert summary(tmp_path / "setting")["eval_auc"] == summary(tmp_path / "given")["eval_auc"]
    assert not any("raw counts" in line for line in said)
    # without the setting the run names the columns and the setting
    said.clear()
    train(cfg_for(strings["train"], strings["eval"], "train.max_steps=1"), tmp_path / "raw",
          echo=said.append)
    assert [x for x in said if "raw counts" in x] == [
        ("dense columns n1, n2 look like raw counts (non-negative, max >= 100x median): "
        "set data.dense_transform=log1p")]


def _with_unseen(src: Path, dst: Path, replacement) -> Path:
    """The eval set with every 'dev' value of the first 300 rows replaced."""
    t = pq.read_table(src / "part-0.parquet")
    dev = t["dev"].to_pylist()
    dev[:300] = [replacement] * 300
    dst.mkdir()
    pq.write_table(t.set_column(t.schema.get_field_index("dev"), "dev", pa.array(dev, pa.string())),
                   dst / "part-0.parquet")
    return dst


@pytest.mark.slow
def test_resume_and_eval_reuse_the_saved_mapping(strings, tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(cfg_for(strings["train"], strings["eval"], "train.max_steps=8"), straight, echo=lambda s: None)
    train(cfg_for(strings["train"], strings["eval"], "train.max_steps=3"), resumed, echo=lambda s: None)
    # a refit with min_frequency=50 would shrink every table: the resume neither refits
    # nor ignores the setting (it did, silently), it stops with one line, writing nothing
    fit = (resumed / FILE).read_bytes()
    with pytest.raises(UserError, match=r"preprocessing.json: data.min_frequency is 50 here, 1 for the fit"):
        train(cfg_for(strings["train"], strings["eval"], "train.max_steps=8", "data.min_frequency=50"),
              resumed, echo=lambda s: None)
    assert (resumed / FILE).read_bytes() == fit
    train(cfg_for(strings["train"], strings["eval"], "train.max_steps=8"), resumed, echo=lambda s: None)
    a, b = run_state(straight), run_state(resumed)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert (straight / FILE).read_bytes() == (resumed / FILE).read_bytes()
    # dlrm eval: values never seen in training go to row 0, as nulls do
    unseen = evaluate_checkpoint(straight, str(_with_unseen(strings["eval"], tmp_path / "u", "zzz-new")))
    other = evaluate_checkpoint(straight, str(_with_unseen(strings["eval"], tmp_path / "o", "other")))
    null = evaluate_checkpoint(straight, str(_with_unseen(strings["eval"], tmp_path / "n", None)))
    assert unseen["logloss"] == other["logloss"] == null["logloss"]
    plain = evaluate_checkpoint(straight, str(strings["eval"]))
    assert plain["logloss"] != unseen["logloss"]
    assert plain["auc"] == pytest.approx(summary(straight)["eval_auc"], abs=1e-12)
    # the checkpoint is bound to its preprocessing by sha256
    body = json.loads((straight / FILE).read_text())
    body["stats_rows"] += 1
    (straight / FILE).write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match="preprocessing.json.*sha256"):
        evaluate_checkpoint(straight, str(strings["eval"]))


def _train_ranks(rank: int, world_size: int, data: dict[str, Path], out: Path) -> str:
    train(cfg_for(data["train"], data["eval"], "data.encodings={app: hash}", "data.rows={app: 64}",
                  "data.dense_transform=standardize"), out / f"W{world_size}", echo=lambda s: None)
    return (out / f"W{world_size}" / FILE).read_text()


@pytest.mark.distributed
@pytest.mark.slow
def test_one_two_three_ranks_map_and_train_alike(strings, tmp_path: Path) -> None:
    fitted = {1: [_train_ranks(0, 1, strings, tmp_path)]}  # one process: no spawn needed
    fitted.update({w: run_ranks(w, _train_ranks, strings, tmp_path) for w in (2, 3)})
    texts = [t for w in fitted for t in fitted[w]]
    assert all(t == texts[0] for t in texts)  # every rank of every world size: one mapping
    assert json.loads(texts[0])["encodings"] == {"site": "vocabulary", "app": "hash",
                                                  "dev": "vocabulary", "tags": "vocabulary"}
    for w in (2, 3):  # against one process reading the same global batches
        ref = tmp_path / f"ref{w}"
        train(cfg_for(strings["train"], strings["eval"], "data.encodings={app: hash}",
                      "data.rows={app: 64}", "data.dense_transform=standardize",
                      f"data.order_world_size={w}"), ref, echo=lambda s: None)
        assert (ref / FILE).read_text() == texts[0]
        assert_states_close(run_state(tmp_path / f"W{w}"), run_state(ref), f"W={w}")
        assert summary(tmp_path / f"W{w}")["eval_auc"] == pytest.approx(
            summary(ref)["eval_auc"], abs=1e-9)
