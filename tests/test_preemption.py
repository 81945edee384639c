"""Preemption: SIGTERM to one rank of a 2-rank torchrun job mid-run stops every rank
after the same step with a checkpoint and exit code 75; the same command then
resumes, is stopped again by SIGTERM to torchrun itself, resumes again and ends with
the parameters of a run never stopped, bit for bit. Under
torchrun --max-restarts=1 a SIGINT to one rank does the same within one job. A
default-config run checkpoints on its time interval, and one process stops on
SIGINT the same way."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dlrm.checkpoint import manager as ck
from dlrm.config import load_config
from dlrm.train.preemption import PREEMPTED, Preemption, ignore_agent_signals
from tests.conftest import REPO, TINY
from tests.multiprocess import free_port
from tests.run_state import run_state

STEPS = 400  # signals sent 3 steps into a job land within an exchange (0.5 s of steps) of it: well before the end
ARGS = ["train.progress=false", "train.log_every=1", "data.batch_size=128",
        "embeddings.replicate_max_bytes=0"]


def train_cmd(data: Path, out: Path, *extra: str) -> list[str]:
    return ["-m", "dlrm", "train", "--config", str(TINY), "--out", str(out), f"data.train={data}",
            "data.eval=", *ARGS, *extra]


def start(cmd: list[str], out: Path) -> subprocess.Popen:
    """``cmd`` running, its output appended to OUT.log (a pipe nobody reads could fill up)."""
    log = open(out.with_name(out.name + ".log"), "a")  # noqa: SIM115 - lives as long as the job
    return subprocess.Popen([sys.executable, *cmd], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=log, stderr=subprocess.STDOUT, text=True)


def torchrun(data: Path, out: Path, restarts: int = 0) -> subprocess.Popen:
    return start(["-m", "torch.distributed.run", "--nproc_per_node=2", f"--max-restarts={restarts}",
                  f"--master_port={free_port()}", *train_cmd(data, out, f"train.max_steps={STEPS}")],
                 out)


def output(out: Path) -> str:
    return out.with_name(out.name + ".log").read_text()


def logged(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def wait_for_step(job: subprocess.Popen, out: Path, step: int) -> None:
    deadline = time.time() + 200
    while max([x["step"] for x in logged(out) if x.get("event") == "train"], default=0) < step:
        assert job.poll() is None and time.time() < deadline, output(out)[-3000:]
        time.sleep(0.02)


def signal_rank(agent: subprocess.Popen, rank: int, sig: signal.Signals) -> None:
    """Signal one worker of a torchrun agent (its children are rank 0, 1 in order)."""
    workers = [int(c) for c in Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()]
    os.kill(workers[rank], sig)


def newest_step(out: Path) -> int:
    return json.loads((ck.find_checkpoint(out) / "meta.json").read_text())["progress"]["global_step"]


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_signals_only_set_a_flag_while_entered() -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with Preemption() as preemption:
        assert preemption.signum == 0
        os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler as kill returns
        os.kill(os.getpid(), signal.SIGINT)  # a later signal changes nothing
        assert preemption.signum == signal.SIGTERM
    assert {sig: signal.getsignal(sig) for sig in before} == before
    ignore_agent_signals()  # not a torchrun worker (no TORCHELASTIC_RUN_ID): nothing changes
    assert {sig: signal.getsignal(sig) for sig in before} == before


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    from data.generate import generate_dataset

    root = tmp_path_factory.mktemp("preemption")
    cfg = load_config(TINY, ["generate.row_group_rows=500", "generate.table_rows=[300]"])
    generate_dataset(str(root / "train"), cfg.generate, seed=8, rows=2500)
    job = torchrun(root / "train", root / "straight")
    assert job.wait(timeout=300) == 0, output(root / "straight")[-3000:]
    return root / "train", run_state(root / "straight")


@pytest.mark.distributed
@pytest.mark.slow
def test_sigterm_to_one_rank_then_to_torchrun_resumes_bit_equal(straight, tmp_path: Path) -> None:
    data, want = straight
    run = tmp_path / "run"
    job = torchrun(data, run)
    wait_for_step(job, run, 3)
    signal_rank(job, 1, signal.SIGTERM)
    assert job.wait(timeout=300) != 0  # torchrun reports its workers' non-zero exits
    log = output(run)
    # both ranks stopped, with the documented code (torchrun's report lists each)
    assert len(re.findall(rf"exitcode\s*: {PREEMPTED} ", log)) == 2, log[-3000:]
    stopped = newest_step(run)
    assert 3 <= stopped < STEPS
    assert f"stopped by SIGTERM after step {stopped} of {STEPS}" in log  # rank 0 says so
    summary = [x for x in logged(run) if x.get("event") == "summary"]
    assert summary[-1]["preempted"] == "SIGTERM" and summary[-1]["steps"] == stopped

    # The same command resumes; SIGTERM to torchrun itself now (what a scheduler
    # sends): the agent forwards it to both workers, which stop and save again.
    job = torchrun(data, run)
    wait_for_step(job, run, stopped + 3)
    os.kill(job.pid, signal.SIGTERM)
    assert job.wait(timeout=300) != 0
    log = output(run)
    assert f"resumed from {run / ck.CHECKPOINTS / f'step-{stopped:09d}'} at step {stopped}" in log
    again = newest_step(run)
    print(f"first stop at step {stopped}, second at {again} of {STEPS}")
    assert stopped + 3 <= again < STEPS and f"stopped by SIGTERM after step {again} of {STEPS}" in log

    job = torchrun(data, run)  # the same command, to the end
    assert job.wait(timeout=300) == 0, output(run)[-3000:]
    assert f"at step {again}" in output(run) and newest_step(run) == STEPS
    assert_bit_equal(run_state(run), want)


@pytest.mark.distributed
@pytest.mark.slow
def test_max_restarts_resumes_after_sigint_to_one_rank(straight, tmp_path: Path) -> None:
    data, want = straight
    run = tmp_path / "run"
    job = torchrun(data, run, restarts=1)
    wait_for_step(job, run, 3)
    signal_rank(job, 0, signal.SIGINT)
    assert job.wait(timeout=300) == 0, output(run)[-3000:]  # restarted once, then finished
    log = output(run)
    assert f"exitcode: {PREEMPTED})" in log or f"exitcode: {PREEMPTED} " in log, log[-3000:]
    stopped = int(re.search(r"stopped by SIGINT after step (\d+)", log).group(1))
    assert f"resumed from {run / ck.CHECKPOINTS / f'step-{stopped:09d}'} at step {stopped}" in log
    assert_bit_equal(run_state(run), want)


@pytest.mark.slow
def test_default_config_checkpoints_on_time_and_stops_on_sigint(straight, tmp_path: Path) -> None:
    # The shipped defaults save on a clock (README: every 30 minutes); shortened here.
    interval = 3.0
    assert load_config(TINY).train.checkpoint_seconds == 1800
    assert load_config(TINY).train.checkpoint_every == 0
    data, _ = straight
    run = tmp_path / "run"
    job = start(train_cmd(data, run, "train.max_steps=1000000", f"train.checkpoint_seconds={interval}"), run)
    wait_for_step(job, run, 1)
    started = time.time()  # the clock started before step 1 (at the trainer's construction)
    while not ck.checkpoints(run):
        assert job.poll() is None, output(run)[-3000:]
        assert time.time() - started < interval + 30, "no checkpoint within its interval"
        time.sleep(0.05)
    assert time.time() - started < interval + 30  # the interval, plus a save on a busy machine
    assert 0 < newest_step(run) < 1000000
    job.send_signal(signal.SIGINT)
    assert job.wait(timeout=120) == PREEMPTED, output(run)[-3000:]
    stopped = newest_step(run)
    assert f"stopped by SIGINT after step {stopped}" in output(run)


@pytest.mark.slow
def test_hotline_sigterm_mid_run_resumes_bit_equal(tmp_path: Path) -> None:
    """One process, Hotline splitting each next mini-batch a step ahead and refreshing its
    hot set: SIGTERM lands between steps, after a split was made ahead for a batch never
    trained; the resumed run (no split carried over) ends with the parameters of a run
    never stopped, bit for bit."""
    from data.generate import generate_dataset

    cfg = load_config(TINY, ["generate.row_group_rows=500", "generate.table_rows=[300]"])
    generate_dataset(str(tmp_path / "train"), cfg.generate, seed=8, rows=2500)
    steps = 300
    hotline = ["embeddings.placement=hotline", "hotline.budget=8KB", "hotline.refresh_every=7",
               f"train.max_steps={steps}"]

    def job(out: Path) -> subprocess.Popen:
        return start(train_cmd(tmp_path / "train", out, *hotline), out)

    straight = tmp_path / "straight"
    assert job(straight).wait(timeout=300) == 0, output(straight)[-3000:]
    run = tmp_path / "run"
    first = job(run)
    # past step 14: step 7's plan swapped in there (a refresh step swaps in the plan of
    # the one before), the next planned, and a split made ahead for a batch never trained
    wait_for_step(first, run, 15)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=120) == PREEMPTED, output(run)[-3000:]
    stopped = newest_step(run)
    assert 15 <= stopped < steps and f"stopped by SIGTERM after step {stopped}" in output(run)
    ahead = [x for x in logged(run) if x.get("event") == "summary"][-1]["hotline"]
    assert ahead["split_ahead"] > 0.5 and ahead["refreshes"] >= 1, ahead  # what the stop cuts across
    assert job(run).wait(timeout=300) == 0, output(run)[-3000:]
    assert f"at step {stopped}" in output(run) and newest_step(run) == steps
    assert_bit_equal(run_state(run), run_state(straight))
