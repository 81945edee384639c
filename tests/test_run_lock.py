"""One training job per run directory (dlrm/train/run_lock.py).

Before, a second ``dlrm train --out RUN`` started while the first ran resumed from the
first's checkpoint, removed its in-progress save as stale and appended to its log.
Here "the other job" is a lock taken by the test itself (a flock on its own open file,
which conflicts with the trainer's as another process's would).
"""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

import pytest

from dlrm.cli import main
from dlrm.config import load_config
from dlrm.train.run_lock import LOCK_FILE, RunInUse
from dlrm.train.trainer import train
from tests.conftest import TINY, tiny_overrides
from tests.data_helpers import tiny_dataset
from tests.multiprocess import run_ranks


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("run_lock") / "data"
    root.mkdir()
    tiny_dataset(root, file_rows=(400,), row_group_rows=100)
    return root


def argv(data: Path, run: Path) -> list[str]:
    return ["train", "--config", str(TINY), "--out", str(run), *tiny_overrides(), f"data.train={data}",
            "data.eval=", "train.max_steps=3", "data.batch_size=16"]


def hold(run: Path):  # another job's hold on the run directory
    run.mkdir(parents=True, exist_ok=True)
    fh = open(run / LOCK_FILE, "a+")  # noqa: SIM115 - the caller closes it
    fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    fh.write(json.dumps({"pid": 4242, "host": "node7", "started": "2026-11-26 08:00:00 UTC"}) + "\n")
    fh.flush()
    return fh


def test_a_second_job_on_a_run_directory_in_use_stops_in_one_line(data: Path, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    other = hold(run)
    try:
        code = main(argv(data, run))
        err = capsys.readouterr().err.strip()
    finally:
        other.close()
    assert code == 2 and err.splitlines() == [
        (f"dlrm train: error: the run directory {run} is in use by another training job (pid 4242 on "
        "node7, started 2026-11-26 08:00:00 UTC); wait for it to end, or train into another --out "
        f"(if that job is gone with its machine, delete {run / LOCK_FILE})")]
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]  # it wrote nothing
    # once the other job is gone the same command trains, and leaves the directory free
    assert main(argv(data, run)) == 0
    assert main(argv(data, run)) == 0  # a rerun: "nothing trained", the lock taken again
    assert "nothing trained" in capsys.readouterr().out


def _train_rank(rank: int, world_size: int, data: str, run: str) -> str:
    args = argv(Path(data), Path(run))
    try:
        train(load_config(TINY, args[args.index("--out") + 2:]), run)
    except RunInUse as e:
        return str(e)
    return ""


def test_deleting_a_lock_left_by_a_dead_machine_frees_the_directory(data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    other = hold(run)  # an NFS server still holding a crashed machine's lock
    try:
        (run / LOCK_FILE).unlink()  # what the refusal says to do
        assert main(argv(data, run)) == 0
    finally:
        other.close()


@pytest.mark.distributed
def test_every_rank_stops_with_rank_0(data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    other = hold(run)
    try:
        said = run_ranks(2, _train_rank, str(data), str(run))
    finally:
        other.close()
    assert said[0] == said[1] and said[0].startswith(f"the run directory {run} is in use")
    assert not (run / "checkpoints").exists()
