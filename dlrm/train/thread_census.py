"""Each thread of this process over a window of steps: its CPU and context switches.

    thread                        threads  CPU ms/step  of a core  voluntary/step  involuntary/step
    MainThread (the step loop)          1         1.91        78%            54.0               0.3
    hotline-gather                      1         0.40        16%            12.0               0.0
    [python3] (not Python's)           16         0.31        13%             3.1               0.0
    ...

A Hotline step on a GPU is host-bound (the 2026-11-28 H200: a 1.13 ms replay in a
~2.4 ms step), and its host time is spread over threads that share one GIL and the
machine's cores: the step loop, the cold gather, the host update, the reader's taking
thread, torch's intra-op pool (OpenMP: threads that spin after each parallel op), the
decode workers (processes of their own, not here). cProfile times one thread, or
every thread at once (Python 3.12 and up) with its own cost in each; this census
costs nothing during the steps: it reads ``/proc/self/task`` before and after.

Threads are grouped by name: Python's name with its pool index taken off
(``hotline-gather_0`` → ``hotline-gather``); a thread Python did not start (torch's
pool, CUDA's, pyarrow's) by the kernel's name for it, in brackets. The CPU is the
scheduler's nanoseconds (``schedstat``), or the 10 ms ticks of ``stat`` where the
kernel keeps no schedstat. A thread that ended inside the window is missed; one that
started inside it counts from zero. Linux only: elsewhere the census is empty.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

_TASKS = Path("/proc/self/task")


@dataclass(frozen=True)
class ThreadSample:
    name: str  # the group it is counted in
    cpu_s: float
    voluntary: int  # switches away because it waited (a lock, the GIL, I/O, a sleep)
    involuntary: int  # switches away because another thread wanted its core


def sample() -> dict[int, ThreadSample]:
    """Every thread of this process now, by its kernel id ({} where there is no /proc)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    try:
        tids = [int(tid) for tid in os.listdir(_TASKS)]
    except OSError:
        return {}
    for tid in tids:
        try:
            out[tid] = _read(tid, names.get(tid))
        except (OSError, ValueError, IndexError, AttributeError):  # it ended meanwhile
            continue
    return out


def _read(tid: int, python_name: str | None) -> ThreadSample:
    task = _TASKS / str(tid)
    status = (task / "status").read_text()
    voluntary = int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.MULTILINE).group(1))  # type: ignore[union-attr]
    involuntary = int(re.search(r"^nonvoluntary_ctxt_switches:\s+(\d+)", status, re.MULTILINE).group(1))  # type: ignore[union-attr]
    try:
        cpu = int((task / "schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    if python_name is None:
        name = f"[{(task / 'comm').read_text().strip()}] (not Python's)"
    else:
        name = re.sub(r"_\d+$", "", python_name)
    return ThreadSample(name, cpu, voluntary, involuntary)


def table(before: dict[int, ThreadSample], after: dict[int, ThreadSample], steps: int,
          wall_s: float, loop: str = "MainThread") -> str:
    """The window's census, busiest group first (``loop``: the step loop's thread name,
    marked). Empty where there was nothing to sample."""
    if not after or steps <= 0:
        return ""
    groups: dict[str, list[float]] = {}  # name -> [threads, cpu s, voluntary, involuntary]
    for tid, now in after.items():
        then = before.get(tid)
        if then is not None and then.name != now.name:  # the id was reused by another thread
            then = None
        g = groups.setdefault(now.name, [0, 0.0, 0, 0])
        g[0] += 1
        g[1] += now.cpu_s - (then.cpu_s if then else 0.0)
        g[2] += now.voluntary - (then.voluntary if then else 0)
        g[3] += now.involuntary - (then.involuntary if then else 0)
    total = sum(g[1] for g in groups.values())
    lines = [(f"threads over {steps} steps ({1000 * wall_s / steps:.2f} ms of wall time a step; "
              f"this process's CPU {1000 * total / steps:.2f} ms a step, {total / max(wall_s, 1e-9):.2f} cores)"),
             (f"{'thread':40s} {'threads':>7s} {'CPU ms/step':>11s} {'of a core':>9s} "
              f"{'voluntary/step':>14s} {'involuntary/step':>16s}")]
    for name, (count, cpu, vol, invol) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        shown = f"{name} (the step loop)" if name == loop else name
        lines.append(f"{shown[:40]:40s} {count:7.0f} {1000 * cpu / steps:11.2f} "
                     f"{cpu / max(wall_s, 1e-9):9.0%} {vol / steps:14.1f} {invol / steps:16.1f}")
    return "\n".join(lines) + "\n"
