"""Several machines, a run directory that is not shared: one line, before anything is
written (dlrm/parallel/shared_dir.py).

Before, each machine's ranks wrote their table shards to their own disk; the run ended
with exit 0 and checkpoints that neither a resume nor ``dlrm eval`` could load. Here
rank 1 runs in its own mount namespace with a fresh tmpfs over the run directory's
parent: the same path, another file system, as on a second machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dlrm.parallel.distributed import DistInfo
from dlrm.parallel.shared_dir import PROBE_PREFIX, NotShared, check_same_file, check_shared_dir
from tests.conftest import REPO, TINY, needs_mount_namespace
from tests.data_helpers import tiny_dataset
from tests.multiprocess import free_port, run_ranks


def _rank_cmd(rank: int, port: int, data: Path, run: Path, private: Path | None) -> list[str]:
    cmd = [sys.executable, "-m", "dlrm", "train", "--config", str(TINY), "--out", str(run),
           f"data.train={data}", "data.eval=", "train.progress=false", "train.epochs=1",
           "data.batch_size=128"]
    if private is None:
        return cmd
    # another machine: the run directory's parent is a file system of its own here
    line = " ".join(f"'{c}'" for c in cmd)
    return ["unshare", "-m", "sh", "-c", f"mount -t tmpfs tmpfs '{private}' && exec {line}"]


@needs_mount_namespace
@pytest.mark.distributed
def test_a_run_directory_not_shared_by_the_machines_is_refused_in_one_line(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    tiny_dataset(data, file_rows=(300,), row_group_rows=100)
    runs = tmp_path / "runs"
    runs.mkdir()
    run = runs / "run"
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
        procs.append(subprocess.Popen(_rank_cmd(rank, port, data, run, runs if rank == 1 else None),
                                      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    results = [p.communicate(timeout=240) for p in procs]
    for proc, (_, err) in zip(procs, results):
        assert proc.returncode == 2, err[-2000:]
        lines = [x for x in err.splitlines() if x.strip()]
        assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
        assert f"the run directory {run} is not shared by the ranks: rank 1" in lines[0]
    assert list(runs.iterdir()) == []  # no run directory, no probe left behind


def _probe_shared(rank: int, world_size: int, where: str) -> list[str]:
    check_shared_dir(Path(where) / "new" / "run", DistInfo(rank, world_size))
    return sorted(os.listdir(where))


@pytest.mark.distributed
def test_a_shared_directory_passes_and_leaves_nothing(tmp_path: Path) -> None:
    # the run directory does not exist yet: probed in its nearest parent, then removed
    seen = run_ranks(3, _probe_shared, str(tmp_path))
    assert seen == [[], [], []]
    assert not [p for p in tmp_path.rglob(f"{PROBE_PREFIX}*")]


def _compare(rank: int, world_size: int, root: str) -> tuple[str, str]:
    """(what a rank is told of one relative path that each rank resolves in its own
    directory, as machines without a shared file system do; what it is told of two
    ranks naming different checkpoints)."""
    info = DistInfo(rank, world_size)
    check_same_file(Path(root) / "same.json", info, "checkpoint's file")
    said = []
    os.chdir(Path(root) / f"machine{rank}")
    for path in (Path("meta.json"), Path(root) / f"step-{1 if rank < 2 else 2}" / "meta.json"):
        try:
            check_same_file(path, info, "checkpoint's file")
            said.append("")
        except NotShared as e:
            said.append(str(e))
    return said[0], said[1]


@pytest.mark.distributed
def test_a_checkpoint_file_that_differs_on_a_rank_is_named(tmp_path: Path) -> None:
    (tmp_path / "same.json").write_text("{}")
    for rank, body in enumerate(['{"step": 10}', '{"step": 10}', '{"step": 5}', None]):
        (tmp_path / f"machine{rank}").mkdir()
        if body is not None:  # rank 2 has a stale copy; rank 3 none
            (tmp_path / f"machine{rank}" / "meta.json").write_text(body)
    for step in (1, 2):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / "meta.json").write_text(str(step))
    said = run_ranks(4, _compare, str(tmp_path))
    assert len(set(said)) == 1
    copies, picked = said[0]
    assert copies.startswith("the checkpoint's file meta.json is not the same on every rank: rank 2 (")
    assert "reads other bytes than rank 0 (" in copies and "rank 3 (" in copies
    assert copies.index("rank 3 (") < copies.index("cannot read it") and "rank 1 " not in copies
    # a save between the ranks' looks: each found its own newest; not a file-system fault
    assert picked == (f"the ranks found different newest checkpoints ({tmp_path}/step-1/meta.json on "
                      f"rank 0, {tmp_path}/step-2/meta.json on rank 2): the run saved one meanwhile; "
                      "evaluate again, or name a checkpoint directory (RUN/checkpoints/step-N)")
