"""Real launches: `torchrun ... -m dlrm train/eval`, eval across ranks equal to one
process, a checkpoint of 2 ranks resumed on 3 and evaluated on 1 (resharding),
and 2 nodes x 2 processes over c10d rendezvous on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dlrm.cli import main
from tests.conftest import REPO, TINY
from tests.multiprocess import free_port
from tests.run_state import assert_states_close, run_state

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TRAIN = ["train.progress=false", "train.log_every=1", "data.batch_size=128", "data.prefetch=2",
         "embeddings.replicate_max_bytes=0"]


def torchrun(nproc: int, *args: str, nnodes: int = 1, node_rank: int = 0, endpoint: str | None = None,
             wait: bool = True):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    if nnodes > 1:
        cmd += [f"--nnodes={nnodes}", f"--node_rank={node_rank}", "--rdzv_backend=c10d",
                f"--rdzv_endpoint={endpoint}", "--rdzv_id=dlrm-test"]
    else:
        cmd += [f"--master_port={free_port()}"]
    cmd += ["-m", "dlrm", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def last_json(text: str) -> dict:
    lines = [line for line in text.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    from data.generate import generate_dataset
    from dlrm.config import load_config

    root = tmp_path_factory.mktemp("torchrun_data")
    cfg = load_config(TINY, ["generate.row_group_rows=500", "generate.table_rows=[300]"])
    generate_dataset(str(root / "train"), cfg.generate, seed=5, rows=1500)
    generate_dataset(str(root / "eval"), cfg.generate, seed=6, rows=700)
    return {"train": root / "train", "eval": root / "eval"}


def train_args(data: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["train", "--config", str(TINY), "--out", str(out), f"data.train={data['train']}",
            f"data.eval={data['eval']}", *TRAIN, *extra]


def test_torchrun_train_eval_and_resharding(data, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    out = torchrun(2, *train_args(data, run, "train.max_steps=4"))
    assert out.stdout.count('"event": "summary"') == 1  # rank 0 alone prints
    assert json.loads((run / "plan.json").read_text())["world_size"] == 2

    # Eval of the 2-rank checkpoint: on 3 ranks (resharded) and on 1 process.
    on3 = last_json(torchrun(3, "eval", "--checkpoint", str(run), "--data", str(data["eval"])).stdout)
    assert main(["eval", "--checkpoint", str(run), "--data", str(data["eval"])]) == 0
    on1 = last_json(capsys.readouterr().out)
    assert on3["rows"] == on1["rows"] == 700
    for key in ("auc", "logloss", "calibration"):
        assert on3[key] == pytest.approx(on1[key], rel=1e-9, abs=1e-12), key

    # Resume the 2-rank checkpoint on 3 ranks: same parameters as a straight 3-rank...
    # ...is not the claim (data order depends on W); the claim is that loading
    # reshards exactly: step 4's state read on 3 ranks equals what 2 ranks wrote.
    before = run_state(run)
    torchrun(3, *train_args(data, run, "train.max_steps=4"))  # resumes at step 4: nothing to do
    after = run_state(run)
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def test_two_nodes_two_processes_equal_one_process(data, tmp_path: Path) -> None:
    from dlrm.config import load_config
    from dlrm.train.trainer import train

    run = tmp_path / "nodes"
    endpoint = f"127.0.0.1:{free_port()}"
    args = train_args(data, run, "train.max_steps=3")
    nodes = [torchrun(2, *args, nnodes=2, node_rank=r, endpoint=endpoint, wait=False) for r in (0, 1)]
    outputs = [n.communicate(timeout=300)[0] for n in nodes]
    assert all(n.returncode == 0 for n in nodes), "\n".join(o[-3000:] for o in outputs)
    assert json.loads((run / "plan.json").read_text())["world_size"] == 4

    cfg = load_config(TINY, args[5:] + ["data.order_world_size=4"])
    train(cfg, tmp_path / "ref", echo=lambda s: None)
    # 2e-5: at 4 ranks the dense gradients are gathered and added in rank order (a resume
    # at 3+ ranks is bit-equal, dlrm/parallel/ddp.py), another order than one process's;
    # the top MLP's last weight came 1.15e-5 apart (1e-5 passed with the ring all-reduce)
    assert_states_close(run_state(run), run_state(tmp_path / "ref"), "2 nodes x 2", rtol=2e-5)
