"""train.reuse_host_memory: a freed step-sized buffer stays with the process for
the next step instead of going back to the kernel (and being faulted in again).
Read from the process's resident set, in a fresh process each way."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

FREE_ONE_BUFFER = """
import sys, torch
from dlrm.train.host_memory import reuse_freed_memory
if sys.argv[1] == "tuned":
    assert reuse_freed_memory()
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
pooled = torch.ones(3_500_000)  # 14 MB: a bench step's pooled vectors
before = resident()
del pooled
print((before - resident()) / 2**20)
"""


def _returned_mb(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", FREE_ONE_BUFFER, mode], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    return float(out.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc, /proc")
@pytest.mark.slow
def test_freed_buffer_stays_with_the_process() -> None:
    assert _returned_mb("default") > 12  # glibc unmaps it: the next step faults it in
    assert _returned_mb("tuned") < 2  # kept in the heap for the next step
