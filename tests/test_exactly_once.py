"""Exactly once, and crash-safe saves: a 2-rank torchrun job trains 2 shuffled epochs
on uneven files whose rows carry their own ids (dense column I1 = row number), with
``train.trace_rows=I1`` recording what each rank consumed at every step.

* Uninterrupted: per epoch, the rows of all steps of both ranks are every row once.
* Killed during a checkpoint save (DLRM_FAULT, see dlrm/checkpoint/faults.py): rank 1 once its
  shards are written, or rank 0 with everything written just before the rename.
  torchrun restarts the job (--max-restarts=1); the half-saved checkpoint is
  ignored, the job resumes from the previous one, and
    - ends with the parameters of the uninterrupted run, bit for bit;
    - the steps run again after the restart consumed the rows of the lost ones, and
      the committed steps plus the re-run ones are every row once per epoch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dlrm.checkpoint import manager as ck
from tests.conftest import REPO, TINY
from tests.data_helpers import tiny_dataset
from tests.multiprocess import free_port
from tests.run_state import run_state

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FILE_ROWS = (300, 170, 530, 41)  # uneven files, row groups of 50: N = 1041 rows
N = sum(FILE_ROWS)
STEPS_PER_EPOCH = 9  # ceil(521 / 64): rank 1 holds rows [520, 1041), 64 a batch
EPOCHS = 2
SAVE_EVERY = 4  # checkpoints at 4, 8, 12, 16 and 18 (the end); the last two kept
KILLED_SAVE = 12  # the save a kill interrupts: the job resumes from step 8


def torchrun(data: Path, out: Path, restarts: int, fault: str = "") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--max-restarts={restarts}", f"--master_port={free_port()}", "-m", "dlrm", "train",
           "--config", str(TINY), "--out", str(out), f"data.train={data}", "data.eval=",
           "train.progress=false", "train.log_every=100", f"train.checkpoint_every={SAVE_EVERY}",
           f"train.epochs={EPOCHS}", "data.batch_size=128", "embeddings.replicate_max_bytes=0",
           "train.trace_rows=I1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DLRM_FAULT": fault}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400,
                          check=False)


def traces(run: Path) -> dict[int, list[dict]]:
    """Every record of every rank, in the order written (incarnations appended)."""
    out = {}
    for rank in (0, 1):
        lines = (run / "trace" / f"rank-{rank}.jsonl").read_text().splitlines()
        out[rank] = [json.loads(x) for x in lines]
    return out


def committed(records: list[dict]) -> dict[int, dict]:
    """Step → the record that counts: the one of the latest incarnation (largest start)."""
    out: dict[int, dict] = {}
    for rec in records:
        if rec["step"] not in out or rec["start"] >= out[rec["step"]]["start"]:
            out[rec["step"]] = rec
    return out


def assert_each_row_once_per_epoch(by_rank: dict[int, dict[int, dict]]) -> None:
    for rank, steps in by_rank.items():
        assert sorted(steps) == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1)), rank
    for epoch in range(EPOCHS):
        rows = [r for steps in by_rank.values() for rec in steps.values() if rec["epoch"] == epoch
                for r in rec["rows"]]
        assert len(rows) == N, (epoch, len(rows))
        assert sorted(rows) == list(range(N)), f"epoch {epoch}: rows missing or repeated"


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("exactly_once")
    (root / "data").mkdir()
    tiny_dataset(root / "data", file_rows=FILE_ROWS, row_group_rows=50)
    job = torchrun(root / "data", root / "straight", restarts=0)
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-3000:]
    return root / "data", root / "straight"


def test_each_row_once_per_epoch_across_ranks(straight) -> None:
    _, run = straight
    records = traces(run)
    by_rank = {rank: committed(recs) for rank, recs in records.items()}
    assert all(len(recs) == len(by_rank[rank]) for rank, recs in records.items())  # no repeats
    assert_each_row_once_per_epoch(by_rank)
    # shuffled: rank 0 sees its rows in another order (and other rows) in epoch 1
    order = [[r for rec in by_rank[0].values() if rec["epoch"] == e for r in rec["rows"]] for e in (0, 1)]
    assert order[0] != order[1]


@pytest.mark.parametrize("fault", [f"kill_after_shards:{KILLED_SAVE}:1",
                                   f"kill_before_rename:{KILLED_SAVE}:0"])
def test_kill_during_save_resumes_from_previous_checkpoint(straight, tmp_path: Path, fault: str) -> None:
    data, reference = straight
    run = tmp_path / "killed"
    job = torchrun(data, run, restarts=1, fault=fault)
    log = job.stdout + job.stderr
    assert job.returncode == 0, log[-4000:]
    assert "SIGKILL" in log or "Signals.SIGKILL" in log or "exitcode: -9" in log, log[-4000:]
    previous = f"{ck.CHECKPOINTS}/step-{KILLED_SAVE - SAVE_EVERY:09d} at step {KILLED_SAVE - SAVE_EVERY}"
    assert "resumed from" in log and previous in log, log[-4000:]
    # the half-written save was never used and is gone; the newest two are kept
    assert sorted(p.name for p in (run / ck.CHECKPOINTS).iterdir()) == [
        "step-000000016", "step-000000018"]

    got, want = run_state(run), run_state(reference)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key

    records = traces(run)
    by_rank = {rank: committed(recs) for rank, recs in records.items()}
    assert_each_row_once_per_epoch(by_rank)
    resumed_at = KILLED_SAVE - SAVE_EVERY
    for rank, recs in records.items():
        lost = {r["step"]: r for r in recs if r["start"] == 0 and r["step"] > resumed_at}
        assert sorted(lost) == list(range(resumed_at + 1, KILLED_SAVE + 1)), rank  # done, then lost
        for step, rec in lost.items():  # re-run on the same rows, in the same order
            assert by_rank[rank][step]["start"] == resumed_at
            assert by_rank[rank][step]["rows"] == rec["rows"], (rank, step)
    assert committed(traces(reference)[0]) == {
        s: {**r, "start": 0} for s, r in by_rank[0].items()}
