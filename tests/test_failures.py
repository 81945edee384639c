"""Failures that are not the data's: a peer rank that hangs or dies mid-training or
never joins, and a table that does not fit memory. Each ends the process with one
line saying what happened (a hang after train.timeout_s instead of forever; every
process group, the embeddings' own included, has that timeout)."""

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

from dlrm.cli import main
from embeddings.collection import AllocationError, LocalEmbeddingCollection
from embeddings.optim import make_sparse_optimizer
from embeddings.table import TableSpec
from tests.conftest import REPO, TINY, tiny_overrides
from tests.data_helpers import tiny_dataset
from tests.multiprocess import free_port, run_ranks

TIMEOUT_S = 5


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("failures") / "data"
    root.mkdir()
    tiny_dataset(root, file_rows=(300, 170, 530, 41), row_group_rows=50)
    return root


def start_rank(rank: int, port: int, data: Path, run: Path) -> subprocess.Popen:
    """One rank of a 2-rank job started by hand (no torchrun agent to kill the others)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
    cmd = [sys.executable, "-m", "dlrm", "train", "--config", str(TINY), "--out", str(run),
           f"data.train={data}", "data.eval=", "train.progress=false", "train.log_every=1",
           "train.epochs=1000", "data.batch_size=128", f"train.timeout_s={TIMEOUT_S}"]
    err = open(run.with_name(f"{run.name}.rank{rank}.err"), "w")  # noqa: SIM115 - lives with the job
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)


def steps_logged(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return 0
    records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return max([r["step"] for r in records if r.get("event") == "train"], default=0)


@pytest.mark.parametrize("fault", ["hang", "die"])
@pytest.mark.distributed
@pytest.mark.slow
def test_a_peer_that_hangs_or_dies_ends_the_job_with_one_line(data, tmp_path: Path, fault: str) -> None:
    run = tmp_path / "run"
    port = free_port()
    ranks = [start_rank(r, port, data, run) for r in (0, 1)]
    try:
        deadline = time.time() + 120
        while steps_logged(run) < 3:
            assert all(p.poll() is None for p in ranks) and time.time() < deadline
            time.sleep(0.05)
        # SIGSTOP: alive and silent (a hang); SIGKILL: gone (its sockets close)
        os.kill(ranks[1].pid, signal.SIGSTOP if fault == "hang" else signal.SIGKILL)
        stopped = time.time()
        code = ranks[0].wait(timeout=TIMEOUT_S + 60)
        waited = time.time() - stopped
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    err = run.with_name("run.rank0.err").read_text()
    assert code == 3, err
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.startswith("dlrm train: error:")]
    assert len(lines) == 1, err
    timed_out = f"dlrm train: error: rank 0: a collective timed out after {TIMEOUT_S}s (train.timeout_s)"
    lost = "dlrm train: error: rank 0: a collective lost its connection to a peer: a peer died"
    if fault == "hang":
        assert lines[0].startswith(timed_out), lines[0]
        assert TIMEOUT_S - 1 <= waited < TIMEOUT_S + 30, waited
    else:
        # Usually the closed socket is noticed at once; a collective already
        # waiting may time out instead. Either way: one line, well before a hang.
        assert lines[0].startswith((lost, timed_out)), lines[0]
        assert waited < TIMEOUT_S + 30, waited


def _embedding_group_collective(rank: int, world_size: int) -> tuple[float, str] | None:
    from data.schema import Schema, SparseFeature
    from dlrm.config import load_config
    from dlrm.parallel.distributed import DistInfo
    from dlrm.parallel.parallelize import build_model

    cfg = load_config(TINY, ["train.timeout_s=2", "embeddings.replicate_max_bytes=0"])
    schema = Schema("label", ("I1",), (SparseFeature("C1", 50), SparseFeature("C2", 50)))
    info = DistInfo(rank, world_size, rank, torch.device("cpu"), "gloo", timeout_s=2)
    model = build_model(cfg, schema, info.device, info)
    if rank == 1:
        time.sleep(6)  # never joins the collective below
        return None
    t0 = time.time()
    try:
        torch.distributed.all_reduce(torch.ones(1), group=model.embeddings.group)
    except RuntimeError as e:
        return time.time() - t0, str(e)
    return time.time() - t0, "no error"


@pytest.mark.distributed
@pytest.mark.slow
def test_the_embedding_group_times_out_after_timeout_s() -> None:
    # Its own process group (not the default one): without the job's timeout it
    # would wait torch's default of 30 minutes.
    waited, error = run_ranks(2, _embedding_group_collective)[0]
    assert "Timed out" in error and 1.5 < waited < 5, (waited, error)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_whose_peers_never_join_stops_after_the_timeout(data, tmp_path: Path) -> None:
    run = tmp_path / "run"
    alone = start_rank(0, free_port(), data, run)  # WORLD_SIZE=2, nobody else comes
    t0 = time.time()
    try:
        code = alone.wait(timeout=TIMEOUT_S + 60)
    finally:
        if alone.poll() is None:
            alone.kill()
    err = run.with_name("run.rank0.err").read_text().strip()
    assert code == 3 and len(err.splitlines()) == 1, err
    assert err.startswith("dlrm train: error: rank 0: the other ranks did not all join"), err
    assert "1/2 clients joined" in err and time.time() - t0 < TIMEOUT_S + 30, err


def test_table_too_big_for_memory_names_the_table(data, tmp_path: Path, capsys) -> None:
    # 2**40 rows x 16 floats = 64 TiB: the allocator refuses at once (no lazy overcommit)
    code = main(["train", "--config", str(TINY), "--out", str(tmp_path / "run"), *tiny_overrides(),
                 f"data.train={data}", "data.batch_size=128", "train.max_steps=1",
                 f"data.rows={{C2: {2**40}}}"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "out of memory allocating the embedding weight" in err, err
    assert "largest: C2, 1,099,511,627,776 rows" in err and "64.0 TiB on cpu" in err, err


class _GreedyAdagrad(type(make_sparse_optimizer("rowwise_adagrad"))):
    """Row-wise Adagrad whose state asks for 2**36 floats a row: more than any machine."""

    def init_state(self, rows: int, dim: int, device: torch.device) -> dict[str, torch.Tensor]:
        state = super().init_state(rows, dim, device)
        if rows > 3:  # the state it declares (state_layout) stays the usual one
            state["sum"] = torch.zeros(rows << 36, device=device)
        return state


def test_optimizer_state_too_big_names_the_state_and_table() -> None:
    tables = [TableSpec("small", rows=10, dim=4, features=("a",))]
    with pytest.raises(AllocationError, match=r"out of memory allocating the _GreedyAdagrad state of "
                                              r"table small \(10 rows x 4\): 40 B on cpu; "
                                              r"the allocator was asked for 2\.5 TiB"):
        LocalEmbeddingCollection(tables, _GreedyAdagrad())
