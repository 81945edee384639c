"""The host memory a training process holds before it has a single table row.

A rank is a Python process: the interpreter, torch and the libraries ``dlrm train``
imports (pyarrow, and through torch.optim's constructors torch._dynamo with sympy and
triton; numba for fp16/bf16 tables on the CPU). On a 2-core CPU machine that is about
0.4-0.45 GiB of resident memory per rank, which the plan's tables, optimizer state and
buffers did not count: where the tables live in host memory (a CPU run, Hotline's host
tier) ``dlrm plan`` put a run that needed 1.6 GB per rank at 1.0 GiB.

:func:`process_bytes` measures it in a fresh interpreter that imports what a training
process imports, so the figure is this machine's and this install's, and does not
depend on what the planning process has read. It is not fed to the planner: each rank
plans on its own, and a measured figure differing between ranks must not change which
rank holds which table. ``dlrm plan`` adds it to each rank's total and says when the
total no longer fits the budget.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import torch

from dlrm.config import Config
from embeddings.plan.sizes import format_bytes

_PROBE = """
import sys
import torch
import dlrm.train.trainer            # everything dlrm train imports before its tables
import torch._dynamo                 # torch.optim's constructors import it (torch/_compile.py)
if sys.argv[1] == "half":
    import numba                     # the CPU rounding kernels of fp16/bf16 tables
from dlrm.train.meter import peak_rss_kib   # VmHWM: ru_maxrss keeps the parent's peak
print(peak_rss_kib())
"""


@functools.cache
def process_bytes(half_tables_on_cpu: bool) -> int:
    """Peak resident bytes of a fresh interpreter that imported what a training process
    imports before building its tables (numba too where ``half_tables_on_cpu``). Once
    per process and argument: a few seconds, the imports' time."""
    root = Path(__file__).resolve().parents[2]  # import this checkout's dlrm in the child
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    arg = "half" if half_tables_on_cpu else "fp32"
    proc = subprocess.run([sys.executable, "-c", _PROBE, arg], capture_output=True, text=True,
                          env=env, timeout=300, check=True)
    return int(proc.stdout.split()[-1]) * 1024


def tables_in_host_memory(cfg: Config) -> tuple[bool, str]:
    """Whether the plan's tables sit in host memory (so the process shares the budget
    with them), and why, in a few words for the plan's last line."""
    if cfg.embeddings.placement == "hotline":
        return True, "embeddings.placement=hotline: the planned tables are the host tier"
    if cfg.train.device == "cpu":
        return True, "train.device=cpu"
    if cfg.train.device == "cuda":
        return False, "train.device=cuda"
    if torch.cuda.is_available():
        return False, "train.device=auto, CUDA here"
    return True, "train.device=auto, no CUDA here"


def half_tables(cfg: Config) -> bool:
    """Whether any table or optimizer state is fp16/bf16 (the CPU kernels import numba)."""
    dtypes = {cfg.embeddings.dtype, cfg.embeddings.state_dtype, *cfg.embeddings.dtypes.values()}
    return bool(dtypes & {"fp16", "bf16"})


def process_note(process: int | None, why: str) -> str:
    """The plan's line on what its totals hold besides tables, state and buffers."""
    if process is None:
        return (f"process: the tables are on the GPU ({why}); the totals leave out the CUDA "
                "context and the MLPs' weights and activations on each device")
    return (f"process: {format_bytes(process)} a rank in the totals, the host memory of a fresh "
            f"Python with what dlrm train imports, measured here ({why}, so the tables share "
            "host memory with it); not counted: the MLPs' weights and activations, the reader's batches")
