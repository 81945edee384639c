"""``train.profile_steps``: a profile of a few steps, one report per rank.

    train.profile_mode=torch (torch.profiler; the steps run eager, uncaptured):
      RUN/profile/rank-R.txt          operators by self CPU time (CUDA time with a GPU)
      RUN/profile/rank-R.json         the Chrome trace (chrome://tracing, Perfetto)
    train.profile_mode=python (cProfile of the step loop's thread; the steps run as
    they would, CUDA graphs replayed):
      RUN/profile/rank-R-python.txt   functions by own time, then by time with callees
    train.profile_mode=threads (nothing recorded during the steps, which run as they
    would):
      RUN/profile/rank-R-threads.txt  each thread's CPU and context switches a step

Every report starts with the window's thread census (dlrm/train/thread_census.py):
which threads of the process used the CPU, and how often each waited.

Steps ``train.profile_start`` .. ``+ train.profile_steps - 1`` (global steps,
counted from 0) are recorded; give the warm-up a few steps before them.

The python mode answers where a step's host time goes when the device waits for the
host (the 2026-11-27 H200: the captured Hotline step took 3.44 ms, its replay 1.47 ms
of GPU time): what the step loop itself runs, not the operators the device runs.
cProfile costs about a microsecond a Python call, so its times are inflated alike.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import resource
import threading
import time
from pathlib import Path

import torch

from data.atomic import atomic_path, write_atomic
from dlrm.train import thread_census


class StepProfiler:
    def __init__(self, start: int, steps: int, run_dir: Path, rank: int, device: torch.device,
                 mode: str = "torch") -> None:
        self.start, self.stop = start, start + steps
        self.dir = run_dir / "profile"
        self.rank = rank
        self.cuda = device.type == "cuda"
        self.mode = mode
        self._prof: torch.profiler.profile | cProfile.Profile | str | None = None
        self._done = steps <= 0

    def before(self, step: int) -> None:
        """Called before global step ``step`` runs."""
        if self._done or self._prof is not None or not self.start <= step < self.stop:
            return
        self._first = self._last = step
        self._threads = thread_census.sample()
        self._loop = threading.current_thread().name
        if self.mode == "threads":  # only the census: nothing runs during the steps
            self._prof = "threads"
            self._usage = resource.getrusage(resource.RUSAGE_SELF)
            self._wall = time.perf_counter()
            return
        if self.mode == "python":
            self._prof = cProfile.Profile()
            self._usage = resource.getrusage(resource.RUSAGE_SELF)
            self._wall = time.perf_counter()
            self._prof.enable()
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
        self._prof.__enter__()
        self._usage = resource.getrusage(resource.RUSAGE_SELF)
        self._wall = time.perf_counter()

    def after(self, step: int) -> None:
        """Called once global step ``step`` finished (``step`` counted from 0)."""
        if self._prof is not None:
            self._last = step
            if step + 1 >= self.stop:
                self.close()

    def close(self) -> None:
        """Write the report of what was recorded (a run shorter than the window too)."""
        if self._prof is None:
            return
        prof, self._prof, self._done = self._prof, None, True
        if isinstance(prof, cProfile.Profile):
            prof.disable()
        elif prof != "threads":
            prof.__exit__(None, None, None)
        steps = self._last - self._first + 1
        threads = thread_census.table(self._threads, thread_census.sample(), steps,
                                      time.perf_counter() - self._wall, self._loop)
        wall = (time.perf_counter() - self._wall) / steps
        now, then = resource.getrusage(resource.RUSAGE_SELF), self._usage
        # Page faults (fresh memory being mapped in) and involuntary context switches
        # (another process or thread wanted this core) per step: costs the operator
        # table cannot show.
        usage = (f"per step: wall {1000 * wall:.1f} ms, user {1000 * (now.ru_utime - then.ru_utime) / steps:.1f} ms, "
                 f"system {1000 * (now.ru_stime - then.ru_stime) / steps:.1f} ms, "
                 f"{(now.ru_minflt - then.ru_minflt) / steps:,.0f} page faults, "
                 f"{(now.ru_nivcsw - then.ru_nivcsw) / steps:,.0f} involuntary and "
                 f"{(now.ru_nvcsw - then.ru_nvcsw) / steps:,.0f} voluntary context switches "
                 f"(this process)\n{threads}")
        self.dir.mkdir(parents=True, exist_ok=True)
        if prof == "threads":
            write_atomic(self.dir / f"rank-{self.rank}-threads.txt",
                         f"steps {self._first}..{self._first + steps - 1}, rank {self.rank}, "
                         f"unprofiled\n{usage}")
            return
        if isinstance(prof, cProfile.Profile):
            write_atomic(self.dir / f"rank-{self.rank}-python.txt",
                         f"steps {self._first}..{self._first + steps - 1}, rank {self.rank}, the step loop's "
                         f"thread under cProfile (times are totals over the {steps} steps)\n{usage}\n"
                         + _python_table(prof, steps, "own") + _python_table(prof, steps, "with callees"))
            return
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=60)
        write_atomic(self.dir / f"rank-{self.rank}.txt",
                     f"steps {self._first}..{self._first + steps - 1}, rank {self.rank} (under the "
                     f"profiler: slower than unprofiled)\n{usage}\n{table}\n")
        with atomic_path(self.dir / f"rank-{self.rank}.json") as trace:
            prof.export_chrome_trace(str(trace))


def _python_table(prof: cProfile.Profile, steps: int, by: str, rows: int = 40) -> str:
    """The ``rows`` first functions by own time (``by`` "own") or by time with their
    callees ("with callees"): each one's microseconds and calls a step (a GPU step's
    host time is a few ms: pstats' totals in ms would round most rows to 0)."""
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]  # (file, line, name) -> (cc, nc, tt, ct, _)
    key = 2 if by == "own" else 3
    ranked = sorted(stats.items(), key=lambda item: -item[1][key])[:rows]
    lines = [f"\n== by {by} time, per step: own us, with callees us, calls, function"]
    for (path, line, name), (_, calls, own, total, _) in ranked:
        where = f"{os.path.basename(path)}:{line}({name})" if path != "~" else name
        lines.append(f"{1e6 * own / steps:10.1f} {1e6 * total / steps:12.1f} {calls / steps:8.1f}  {where}")
    return "\n".join(lines) + "\n"
