"""A run stopped by SIGTERM at a step whose eval was due (train.eval_every) saves and
leaves without it; the resumed run evaluates first, at that step (issue 25, item 7).
In-process: the signal is sent to this process after step 4's update, as an agent's
would arrive then. The reference is the run never stopped: same eval at the same
step (resume is bit-equal, so its metrics are equal to the last digit)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from dlrm.config import load_config
from dlrm.train import trainer as trainer_mod
from dlrm.train.trainer import train
from tests.conftest import TINY, tiny_overrides


def run(tiny_data, out: Path) -> dict:
    cfg = load_config(TINY, tiny_overrides(**{
        "data.train": tiny_data["train"], "data.eval": tiny_data["eval"], "train.max_steps": 6,
        "train.eval_every": 2, "data.batch_size": 256, "data.eval_batch_size": 4096}))
    return train(cfg, out, echo=lambda s: None)


def evals(out: Path) -> dict[int, dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if r["event"] == "eval"}


@pytest.mark.slow
def test_resumed_run_evaluates_the_step_a_signal_skipped(tiny_data, tmp_path: Path,
                                                          monkeypatch) -> None:
    straight = evals((run(tiny_data, tmp_path / "straight"), tmp_path / "straight")[1])
    assert sorted(straight) == [2, 4, 6]

    step = trainer_mod.Trainer.step

    def step_then_signal(self, batches):
        done = step(self, batches)
        if self.progress.global_step == 4:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler sets the flag as kill returns
        return done

    monkeypatch.setattr(trainer_mod.Trainer, "step", step_then_signal)
    out = tmp_path / "stopped"
    assert run(tiny_data, out).get("preempted") == "SIGTERM"
    assert sorted(evals(out)) == [2]  # step 4's eval was due and skipped
    monkeypatch.setattr(trainer_mod.Trainer, "step", step)
    assert "preempted" not in run(tiny_data, out)
    got = evals(out)
    assert sorted(got) == [2, 4, 6]
    for s in (4, 6):
        assert got[s]["auc"] == straight[s]["auc"] and got[s]["logloss"] == straight[s]["logloss"]
