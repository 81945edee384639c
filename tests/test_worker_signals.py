"""Decode workers under the signals a cluster sends (data/forkserver_signals.py,
data/decode_workers.py).

- SIGTERM (SLURM's preemption, torchrun's stop) and SIGINT (Ctrl-C) reach a whole
  process group. Before, the forkserver died of SIGTERM and every worker then read as
  dead (exit code 255): the trainer's graceful stop became "Parquet decode worker 0
  died", and its close unlinked the workers' blocks under them (their tracebacks).
  Now the trainer stops as for a signal to itself: a checkpoint, exit 75, nothing else.
- A trainer killed outright (the OOM killer): before, its forkserver, workers and
  resource tracker, and the workers' shared memory, stayed for ever. Now they go.
- A process that leaves without closing its reader exits (multiprocessing's exit hook
  joins daemon workers with no timeout; they ignore its SIGTERM now).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY
from tests.data_helpers import tiny_dataset

pytestmark = [pytest.mark.slow, pytest.mark.distributed,
              pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc")]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("worker_signals") / "data"
    root.mkdir()
    tiny_dataset(root, file_rows=(4000, 4000), row_group_rows=500, table_rows=200)
    return root


def start(data: Path, run: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dlrm", "train", "--config", str(TINY), "--out", str(run),
           f"data.train={data}", "data.eval=", "data.workers=2", "data.shuffle_buffer=1000",
           "data.batch_size=64", "train.epochs=1000", "train.progress=false", "train.log_every=1"]
    return subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            continue
        found.update(kids)
        todo.extend(kids)
    return found


def wait_for_steps(run: Path, proc: subprocess.Popen, steps: int = 20) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        log = run / "metrics.jsonl"
        if log.is_file() and log.read_text().count('"train"') >= steps:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {steps} steps logged: {proc.poll()}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_process_group_stops_with_a_checkpoint(data: Path, tmp_path: Path, sig) -> None:
    run = tmp_path / "run"
    proc = start(data, run)
    wait_for_steps(run, proc)
    assert len(descendants(proc.pid)) >= 3  # the forkserver and its two workers
    os.killpg(proc.pid, sig)  # as SLURM, torchrun or a terminal signals: everyone
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert f"stopped by {sig.name}" in out and "checkpoint saved" in out
    assert err.strip() == "", err[-3000:]  # no "decode worker died", no worker traceback
    assert any((run / "checkpoints").iterdir())


def test_workers_leave_with_a_trainer_killed_outright(data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start(data, run)
    wait_for_steps(run, proc)
    helpers = descendants(proc.pid)
    assert len(helpers) >= 3
    proc.kill()  # the OOM killer: no handler, no close
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in helpers):
        time.sleep(0.2)
    left = [p for p in helpers if Path(f"/proc/{p}").exists()]
    assert not left, [Path(f"/proc/{p}/cmdline").read_text() for p in left]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"dlrm-{proc.pid}-")]


_LEAVES = """
import sys
from dlrm.config import load_config
from dlrm.train.inputs import make_reader, resolve_data
if __name__ == "__main__":
    cfg = load_config(sys.argv[1], [f"data.train={sys.argv[2]}", "data.workers=2",
                                    "data.shuffle_buffer=1000", "data.batch_size=64"])
    data = resolve_data(cfg)
    reader = make_reader(cfg, data.train_files, data.schema, True, 0, 1, data.preprocess)
    batches = reader.epoch(0)
    next(batches), next(batches)
    print("leaving", flush=True)  # without reader.close()
"""


def test_a_process_that_leaves_without_closing_its_reader_exits(data: Path, tmp_path: Path) -> None:
    script = tmp_path / "leaves.py"
    script.write_text(_LEAVES)
    proc = subprocess.run([sys.executable, str(script), str(TINY), str(data)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0 and proc.stdout.strip() == "leaving", proc.stderr[-3000:]
