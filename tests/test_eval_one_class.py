"""An eval set of one class (a slice of clicks only, a day with no click logged) has
no AUC: the eval inside training says so in one line and the run goes on (saved,
finished, exit 0). Before, the run died at its first eval with a traceback
(``ValueError: AUC is undefined``), after hours of training for the final one. The
reason is metrics.auc's own message on the same labels."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlrm.checkpoint import manager as ck
from dlrm.cli import main
from dlrm.eval import metrics
from tests.conftest import TINY, tiny_overrides


def test_a_one_class_eval_set_warns_and_the_run_goes_on(tiny_data, tmp_path: Path, capsys) -> None:
    table = pq.read_table(min(Path(tiny_data["eval"]).glob("*.parquet")))
    labels = np.zeros(table.num_rows, np.float32)
    (tmp_path / "eval").mkdir()
    pq.write_table(table.set_column(0, "label", pa.array(labels)), tmp_path / "eval" / "p.parquet")
    with pytest.raises(ValueError) as expected:
        metrics.auc(np.full(table.num_rows, 0.5), labels)
    run = tmp_path / "run"
    argv = ["train", "--config", str(TINY), "--out", str(run), *tiny_overrides(),
            f"data.train={tiny_data['train']}", f"data.eval={tmp_path / 'eval'}",
            "train.max_steps=4", "train.eval_every=2", "data.batch_size=256"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for step in (2, 4):
        assert f"warning: the eval at step {step} has no metrics: {expected.value}" in out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    skipped = [r for r in records if r["event"] == "eval_skipped"]
    assert [r["step"] for r in skipped] == [2, 4] and skipped[0]["reason"] == str(expected.value)
    assert not [r for r in records if r["event"] == "eval"]
    assert ck.find_checkpoint(run).name == "step-000000004"
