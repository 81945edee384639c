"""What a helper thread's work costs beside a step loop that dispatches small torch ops.

    python -m dlrm.bench.gil_handoff [--ops 0,200,1000] [--intervals 5,0.5,0.1] [--rounds 50]

A Hotline step on a GPU is a Python loop of small torch calls (launches, copies,
events), with helper threads beside it: the gather thread, the host-update thread, the
reader's taking thread. Each torch call drops the interpreter lock for its native part
and takes it back after; a helper that wants the lock meanwhile must win it, and
CPython's switch interval only forces a hand-off from a thread that held the lock that
whole interval. This times one helper task (``--helper-calls`` torch reductions over a
large tensor, each a drop and a take of the lock, as a gather's calls are) submitted at
a "step's" start, while the step loop runs ``--ops`` tiny in-place adds and then waits
for it, as the Hotline step waits for its cold rows:

    helper_alone_ms   the task on its own
    helper_ms         its wall time beside the loop (submission to its end)
    loop_alone_ms     the loop's ops with a helper task of no call (a hand-off, nothing more)
    loop_ms           the loop's ops beside the helper's task
    step_ms           submission to the loop's receipt of the result

One JSON line per (switch interval, ops). Torch runs on one thread (the loop's ops and
the helper's calls would otherwise wait for torch's pool, another effect). The
2026-12-07 2-core CPU machine, two runs: the helper's 0.61-0.76 ms took 1.5-2.7 ms
beside 1,000 ops, at 0.1, 0.5 and 5 ms alike, and 0.8-1.2 ms beside 200 (README, "The
tables read and written in place"). ``scripts/gpu_session.sh bench`` runs it on the
GPU machine's host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def helper_task(big: torch.Tensor, calls: int) -> float:
    """The helper's work: ``calls`` reductions (each drops and retakes the lock); its wall seconds."""
    t0 = time.perf_counter()
    for _ in range(calls):
        big.sum()
    return time.perf_counter() - t0


def one_step(pool: ThreadPoolExecutor, big: torch.Tensor, small: torch.Tensor, ops: int,
             calls: int) -> tuple[float, float, float]:
    """(step, loop, helper) seconds of one step: the helper submitted, ``ops`` small ops, the wait."""
    t0 = time.perf_counter()
    done = pool.submit(helper_task, big, calls)
    for _ in range(ops):
        small.add_(1)
    loop = time.perf_counter() - t0
    helper = done.result()
    return time.perf_counter() - t0, loop, helper


def measure(interval_ms: float, ops_list: list[int], rounds: int, calls: int, elements: int) -> list[dict]:
    """The rows for one switch interval (restored after)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval_ms / 1000)
    big, small = torch.randn(elements), torch.zeros(16)
    rows = []
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="helper") as pool:
            alone = statistics.median(helper_task(big, calls) for _ in range(rounds))
            for ops in ops_list:
                loop_alone = statistics.median(one_step(pool, big, small, ops, 0)[1] for _ in range(rounds))
                steps = [one_step(pool, big, small, ops, calls) for _ in range(rounds)]
                rows.append({"switch_interval_ms": interval_ms, "ops": ops,
                             "helper_alone_ms": round(1000 * alone, 3),
                             "loop_alone_ms": round(1000 * loop_alone, 3),
                             "helper_ms": round(1000 * statistics.median(s[2] for s in steps), 3),
                             "loop_ms": round(1000 * statistics.median(s[1] for s in steps), 3),
                             "step_ms": round(1000 * statistics.median(s[0] for s in steps), 3)})
    finally:
        sys.setswitchinterval(before)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dlrm.bench.gil_handoff", description=__doc__.split("\n")[0])
    parser.add_argument("--ops", default="0,200,1000", help="the loop's small ops a step, comma-separated")
    parser.add_argument("--intervals", default="5,0.5,0.1", help="switch intervals in ms, comma-separated")
    parser.add_argument("--rounds", type=int, default=50, help="steps a row (medians)")
    parser.add_argument("--helper-calls", type=int, default=4, help="torch calls of the helper's task")
    parser.add_argument("--elements", type=int, default=2_000_000, help="elements each helper call reduces")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ops_list = [int(x) for x in args.ops.split(",")]
    for interval in (float(x) for x in args.intervals.split(",")):
        for row in measure(interval, ops_list, args.rounds, args.helper_calls, args.elements):
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
