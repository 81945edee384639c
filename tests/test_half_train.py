"""Training with fp16/bf16 tables end to end (dlrm train on the generated tiny set).

Reference: the same run with fp32 tables. AUC within 0.001 (the issue's target), and
a half-table run resumed from a checkpoint equals the uninterrupted one bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlrm.config import load_config
from dlrm.train.trainer import train
from tests.conftest import TINY, tiny_overrides
from tests.run_state import run_state


def run_train(tiny_data, run: Path, **extra) -> dict:
    cfg = load_config(
        TINY,
        tiny_overrides(**{"data.train": tiny_data["train"], "data.eval": tiny_data["eval"],
                          "optim.sparse": "rowwise_adagrad", **extra}),
    )
    return train(cfg, run, echo=lambda s: None)


@pytest.mark.slow
def test_half_tables_auc_within_a_thousandth_of_fp32(tiny_data, tmp_path: Path) -> None:
    auc = {}
    for dtype in ("fp32", "bf16", "fp16"):
        summary = run_train(tiny_data, tmp_path / dtype, **{"embeddings.dtype": dtype})
        auc[dtype] = summary["eval_auc"]
    assert auc["fp32"] > 0.70, auc
    assert abs(auc["bf16"] - auc["fp32"]) <= 0.001, auc
    assert abs(auc["fp16"] - auc["fp32"]) <= 0.001, auc
    weights = {d: run_state(tmp_path / d) for d in auc}
    key = next(k for k in weights["bf16"] if k.endswith(".weight") and "tables" in k)
    assert weights["bf16"][key].dtype == torch.bfloat16 and weights["fp32"][key].dtype == torch.float32


@pytest.mark.slow
def test_half_tables_resume_equals_uninterrupted(tiny_data, tmp_path: Path) -> None:
    extra = {"embeddings.dtype": "fp16", "train.max_steps": 60}
    run_train(tiny_data, tmp_path / "straight", **extra)
    run_train(tiny_data, tmp_path / "resumed", **{**extra, "train.max_steps": 25})
    run_train(tiny_data, tmp_path / "resumed", **extra)
    a, b = run_state(tmp_path / "straight"), run_state(tmp_path / "resumed")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.slow
def test_int8_eval_auc_within_half_a_thousandth(tiny_data, tmp_path: Path, capsys) -> None:
    import json

    from dlrm.cli import main

    run_train(tiny_data, tmp_path / "run")
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--data", str(tiny_data["eval"]),
                 "--tables", "int8"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["auc"] > 0.70
    assert abs(result["int8"]["auc"] - result["auc"]) <= 0.0005, result
    assert result["int8"]["auc"] != result["auc"]  # the tables were quantised
    state = run_state(tmp_path / "run")
    weights = [v for k, v in state.items() if k.startswith("tables.") and k.endswith(".weight")]
    assert result["int8"]["table_bytes"] == sum(w.shape[0] * (w.shape[1] + 8) for w in weights)
