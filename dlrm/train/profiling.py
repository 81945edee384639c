"""``train.profile_steps``: torch.profiler over a few steps, one report per rank.

    RUN/profile/rank-R.txt    operators by self CPU time (CUDA time with a GPU)
    RUN/profile/rank-R.json   the Chrome trace (chrome://tracing, Perfetto)

Steps ``train.profile_start`` .. ``+ train.profile_steps - 1`` (global steps,
counted from 0) are recorded; give the warm-up a few steps before them.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import torch

from data.atomic import atomic_path, write_atomic


class StepProfiler:
    def __init__(self, start: int, steps: int, run_dir: Path, rank: int, device: torch.device) -> None:
        self.start, self.stop = start, start + steps
        self.dir = run_dir / "profile"
        self.rank = rank
        self.cuda = device.type == "cuda"
        self._prof: torch.profiler.profile | None = None
        self._done = steps <= 0

    def before(self, step: int) -> None:
        """Called before global step ``step`` runs."""
        if self._done or self._prof is not None or not self.start <= step < self.stop:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
        self._prof.__enter__()
        self._first = self._last = step
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
        prof.__exit__(None, None, None)
        steps = self._last - self._first + 1
        wall = (time.perf_counter() - self._wall) / steps
        now, then = resource.getrusage(resource.RUSAGE_SELF), self._usage
        # Page faults (fresh memory being mapped in) and involuntary context switches
        # (another process or thread wanted this core) per step: costs the operator
        # table cannot show.
        usage = (f"per step: wall {1000 * wall:.1f} ms, user {1000 * (now.ru_utime - then.ru_utime) / steps:.1f} ms, "
                 f"system {1000 * (now.ru_stime - then.ru_stime) / steps:.1f} ms, "
                 f"{(now.ru_minflt - then.ru_minflt) / steps:,.0f} page faults, "
                 f"{(now.ru_nivcsw - then.ru_nivcsw) / steps:,.0f} involuntary and "
                 f"{(now.ru_nvcsw - then.ru_nvcsw) / steps:,.0f} voluntary context switches")
        self.dir.mkdir(parents=True, exist_ok=True)
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=60)
        write_atomic(self.dir / f"rank-{self.rank}.txt",
                     f"steps {self._first}..{self._first + steps - 1}, rank {self.rank} (under the "
                     f"profiler: slower than unprofiled)\n{usage}\n{table}\n")
        with atomic_path(self.dir / f"rank-{self.rank}.json") as trace:
            prof.export_chrome_trace(str(trace))
