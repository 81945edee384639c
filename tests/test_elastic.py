"""Elastic restart: SIGKILL one rank of a 2-rank torchrun job mid-run (before the
first checkpoint and after one); torchrun restarts the group (--max-restarts), training resumes
from the latest complete checkpoint and ends with exactly the parameters of a run
never interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, TINY
from tests.multiprocess import free_port
from tests.run_state import run_state

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def launch(data: Path, out: Path, restarts: int) -> subprocess.Popen:
    """The job, its output in OUT.log (a pipe nobody reads while we poll could fill up)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--max-restarts={restarts}", f"--master_port={free_port()}", "-m", "dlrm", "train",
           "--config", str(TINY), "--out", str(out), f"data.train={data}", "data.eval=",
           "train.progress=false", "train.log_every=1", "train.checkpoint_every=3",
           "train.max_steps=12", "data.batch_size=128", "embeddings.replicate_max_bytes=0"]
    log = open(out.with_name(out.name + ".log"), "w")  # noqa: SIM115 - lives as long as the job
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=log, stderr=subprocess.STDOUT, text=True)


def output(out: Path) -> str:
    return out.with_name(out.name + ".log").read_text()


def steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return 0
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return max([x["step"] for x in lines if x.get("event") == "train"], default=0)


def worker_pids(agent: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{agent}/task/{agent}/children").read_text().split()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    from data.generate import generate_dataset
    from dlrm.config import load_config

    root = tmp_path_factory.mktemp("elastic")
    cfg = load_config(TINY, ["generate.row_group_rows=500", "generate.table_rows=[300]"])
    generate_dataset(str(root / "train"), cfg.generate, seed=8, rows=2500)
    job = launch(root / "train", root / "straight", restarts=0)
    assert job.wait(timeout=300) == 0, output(root / "straight")[-3000:]
    return root / "train", run_state(root / "straight")


# Killed before the first checkpoint (the job restarts from scratch) and after one
# (it resumes from the newest; 6 is itself a checkpoint step, so the kill may also land
# in that save). A kill later in the run (10, resumed from 9) took the second path again.
@pytest.mark.parametrize("kill_at", [2, 6])
def test_killed_rank_restarts_and_ends_bit_equal(straight, tmp_path: Path, kill_at: int) -> None:
    data, want = straight
    job = launch(data, tmp_path / "killed", restarts=1)
    deadline = time.time() + 200
    while steps_logged(tmp_path / "killed") < kill_at:
        assert job.poll() is None and time.time() < deadline, output(tmp_path / "killed")[-3000:]
        time.sleep(0.02)
    os.kill(worker_pids(job.pid)[-1], signal.SIGKILL)  # rank 1, mid-step
    assert job.wait(timeout=300) == 0, output(tmp_path / "killed")[-3000:]
    # Checkpoints every 3 steps: killed at step 2 the job restarts from scratch.
    assert ("resumed from" in output(tmp_path / "killed")) == (kill_at > 3)
    got = run_state(tmp_path / "killed")
    for key, value in want.items():
        assert torch.equal(got[key], value), key
