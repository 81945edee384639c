"""``dlrm <verb> ... | head``: a reader that goes away ends the command quietly, with
no BrokenPipeError traceback (dlrm/cli.py main). The reader is gone before the
command writes (the pipe's read end is closed first), so the failure is certain,
not a race with ``head``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


def run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader went away before the first line
    try:
        return subprocess.run([sys.executable, "-m", "dlrm", *args], cwd=REPO, stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=300, check=False)
    finally:
        os.close(write_end)


def assert_quiet(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == "", proc.stderr
    assert proc.returncode == 128 + 13  # as a process killed by SIGPIPE reports it


def test_help_into_a_closed_pipe_is_quiet() -> None:
    assert_quiet(run_into_closed_pipe("--help"))


@pytest.mark.slow
def test_plan_into_a_closed_pipe_is_quiet() -> None:
    assert_quiet(run_into_closed_pipe("plan", "--config", "configs/criteo_kaggle.yaml",
                                      "--world-size", "8"))


@pytest.mark.slow
def test_plan_piped_into_head_prints_its_first_line_only() -> None:
    """The everyday form: the first line comes through, the rest goes quietly."""
    proc = subprocess.run(f"{sys.executable} -m dlrm plan --config configs/criteo_kaggle.yaml "
                          "--world-size 8 | head -1", shell=True, cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 1, proc
    assert proc.stderr.strip() == "", proc.stderr
