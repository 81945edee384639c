"""What a run measures of itself: loss and samples/s per log window, the rate over
the timed steps (after a warm-up), time by section, peak memory; JSON lines out.

    step ─► add_loss (per micro-batch, a device tensor: no sync) ─► add_step ─►
    every train.log_every steps: take_window() ─► {"event": "train", loss, samples_per_s}

Rates are wall time between points where the host has waited for the device, never
the sum of the steps' host times: a GPU step (a replayed CUDA graph above all) is
queued in microseconds and runs later, so the host's per-step clock measures how fast
work is queued. The first GPU bench (H200, 781912d) reported 34M samples/s that way.

    step 1 .. warmup      │ timed steps ....................│ eval/save │ steps ...
    span (not timed) ─────┤sync  span ──────────── take_window: sync ┤ close_span ...
                                 seconds += wall time from the span's first fetch
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dlrm.parallel.distributed import DistInfo, all_gather_rows, all_reduce_sum
from embeddings.timing import TIMER

READER_WARN_SHARE = 0.10  # data wait above this share of step time: the reader is named
# ... and above this many seconds in all: a run of a few seconds (64 steps of 256 rows on
# the Avazu sample waited 12%, 0.1 s, mostly at its two epochs' starts) is told nothing
READER_WARN_SECONDS = 1.0
SECTIONS = ("data_wait", "input_alltoall", "lookup", "output_alltoall", "mlp",
            "embedding_update", "dense_update")


class JsonLog:
    """Appends one JSON object per line to RUN/metrics.jsonl (rank 0 only); with
    ``tensorboard``, their numbers also go to RUN/tensorboard/ (dlrm/train/tensorboard.py)."""

    def __init__(self, path: Path, enabled: bool = True, tensorboard: bool = False) -> None:
        self.path = path
        self.enabled = enabled
        self.board = None
        if tensorboard:
            from dlrm.train.tensorboard import TensorBoardLog, summary_writer

            summary_writer()  # every rank: without the package, all stop (one line)
            if enabled:
                self.board = TensorBoardLog(path.parent)

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            line = (json.dumps(record) + "\n").encode()
            with open(self.path, "ab", buffering=0) as fh:  # unbuffered: nothing left for close
                end = fh.seek(0, os.SEEK_END)
                try:
                    while line:  # a raw write may take part of it; the next one says why
                        line = line[fh.write(line):]
                except OSError as e:  # a full disk: no half line for a resume to read
                    os.ftruncate(fh.fileno(), end)
                    raise OSError(e.errno, e.strerror, str(self.path)) from None
            if self.board is not None:
                self.board.write(record)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None


class Meter:
    """Loss since the last log line, samples/s over the window and the timed steps.

    The first ``warmup`` steps are left out of the rate and the sections (caches,
    allocator and thread pools are still filling)."""

    def __init__(self, info: DistInfo, time_sections: bool, warmup: int = 5,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.info, self.warmup, self.clock = info, warmup, clock
        self.loss = torch.zeros((), device=info.device)  # BCE sum of this rank's rows
        self.local_rows = 0
        self.window_rows, self.window_seconds = 0, 0.0  # global rows, wall time
        self.timed_rows, self.timed_seconds, self.timed_steps = 0, 0.0, 0
        self.timed_wait = 0.0  # seconds of the timed steps the host waited for a batch
        self.exposed_wait = 0.0  # of which the device had nothing queued (see ``device_idle``)
        # recorded behind each step's work on CUDA (one event, recorded again each step;
        # never recorded, it reads as done)
        self._queued = torch.cuda.Event() if info.device.type == "cuda" else None
        # the open span: the clock at its first step's fetch, and whether it is timed
        self.span_start: float | None = None
        self.span_timed, self.span_rows = False, 0
        TIMER.enabled = time_sections
        TIMER.reset()

    def add_loss(self, bce: torch.Tensor, rows: int) -> None:
        self.loss += bce.detach()
        self.local_rows += rows

    def step_queued(self) -> None:
        """After a step's work is queued: on CUDA an event behind it (no wait)."""
        if self._queued is not None:
            self._queued.record()

    def device_idle(self) -> bool:
        """Whether the device has finished the last step's work (asked as the next batch
        arrives; no wait). While it still runs, the host's wait for input cost nothing:
        the step after it could not have started sooner. A CPU step runs as it is
        called: always idle."""
        return self._queued is None or self._queued.query()

    def add_step(self, step: int, global_rows: int, started: float, wait: float, inside: float,
                 dense_update: float, device_idle: bool = True) -> None:
        """After ``step`` (counted from 1): its rows, the clock when its fetch began;
        ``wait`` for data, ``inside``: forward and backward, ``dense_update``: the dense
        optimizer (host seconds, for the sections); ``device_idle``: the device had
        finished the previous step when the batch arrived (the wait counts as exposed,
        at most all of it)."""
        if self.span_start is None:
            self.span_start, self.span_timed = started, step > self.warmup
        self.window_rows += global_rows
        if step == self.warmup:
            TIMER.reset()  # sections count timed steps only
            self.close_span()  # the warm-up's queued work ends outside the timed steps
        if step <= self.warmup:
            return
        self.span_rows += global_rows
        self.timed_steps += 1
        self.timed_wait += wait
        self.exposed_wait += wait if device_idle else 0.0
        TIMER.totals["data_wait"] += wait
        TIMER.totals["mlp"] += inside
        TIMER.totals["dense_update"] += dense_update

    def close_span(self) -> None:
        """Waits for the device, then counts the wall time since the open span's first
        fetch; called where the host waits anyway (a log line reads the loss, an eval
        or a checkpoint reads the device) and at the end. The next step opens a span."""
        if self.span_start is None:
            return
        if self.info.device.type == "cuda":
            torch.cuda.synchronize(self.info.device)
        seconds = self.clock() - self.span_start
        self.window_seconds += seconds
        if self.span_timed:
            self.timed_seconds += seconds
            self.timed_rows += self.span_rows
        self.span_start, self.span_rows = None, 0

    @property
    def rate(self) -> float:
        """Samples/s over the timed steps in closed spans (``close_span``)."""
        return self.timed_rows / self.timed_seconds if self.timed_seconds else 0.0

    @property
    def data_wait_share(self) -> float:
        """This rank's waits for input batches while its device had nothing queued, over
        its timed steps' wall time (in closed spans). On the CPU every wait; on CUDA a
        wait during which the previous step still ran is hidden: the 2026-11-26 H200 bench
        (153cd2f, replayed steps) waited 27% of step time on the host, and trained 4%
        slower from Parquet than from batches staged in memory."""
        return self.exposed_wait / self.timed_seconds if self.timed_seconds else 0.0

    @property
    def host_wait_share(self) -> float:
        """The host's waits for input batches, hidden or not, over the same wall time."""
        return self.timed_wait / self.timed_seconds if self.timed_seconds else 0.0

    def reader_warning(self, remedy: str = "") -> str | None:
        """A line naming the reader as the bottleneck when the exposed wait share
        passes 10% and the waits a second in all; ``remedy``: what to change, said after."""
        share = self.data_wait_share
        if share <= READER_WARN_SHARE or self.exposed_wait < READER_WARN_SECONDS:
            return None
        idle = " with the device idle" if self.info.device.type == "cuda" else ""
        # 10.4% as "10.4%": "10% ... (above 10%)" read as a contradiction
        pct = f"{share:.1%}" if round(share * 100) == round(READER_WARN_SHARE * 100) else f"{share:.0%}"
        line = (f"warning: the Parquet reader is the bottleneck: {pct} of step time "
                f"waited for input batches{idle} (above {READER_WARN_SHARE:.0%})")
        return f"{line}; {remedy}" if remedy else line

    def window_loss(self) -> float:
        """The loss summed since the last log line over all ranks (collective; the window
        goes on)."""
        return all_reduce_sum([float(self.loss)], self.info)[0]

    def take_window(self) -> dict[str, float]:
        """The window's mean loss (all ranks) and samples/s; a new window starts."""
        self.close_span()
        loss_sum, rows = all_reduce_sum([float(self.loss), self.local_rows], self.info)
        out = {"loss": loss_sum / max(rows, 1), "samples_per_s": self.rate,
               "window_samples_per_s": self.window_rows / max(self.window_seconds, 1e-9)}
        self.loss.zero_()
        self.local_rows, self.window_rows, self.window_seconds = 0, 0, 0.0
        return out

    def summary(self) -> dict[str, Any]:
        """Samples/s, peak memory of every rank, and ms per step by section if timed."""
        self.close_span()
        out: dict[str, Any] = {"samples_per_s": self.rate, "world_size": self.info.world_size,
                               "peak_memory_mb": peak_memory_mb(self.info),
                               "data_wait_share": self.data_wait_share,
                               "host_wait_share": self.host_wait_share}
        if TIMER.enabled and self.timed_steps:
            out["sections_ms"] = {name: 1000 * TIMER.totals[name] / self.timed_steps
                                  for name in SECTIONS}
        TIMER.enabled = False
        return out


def peak_memory_mb(info: DistInfo) -> list[float]:
    """Peak memory of every rank: CUDA allocations on a GPU, else the process's max RSS."""
    if info.device.type == "cuda":
        mine = torch.cuda.max_memory_allocated(info.device) / 2**20
    else:
        mine = peak_rss_kib() / 1024
    return all_gather_rows(torch.tensor([mine], dtype=torch.float64), info).tolist()


def peak_rss_kib() -> int:
    """This process's peak resident set in KiB: Linux's VmHWM, of this program alone.
    ru_maxrss (used where /proc has no VmHWM) survives fork and exec: a run started
    from a larger process (a notebook, a test, a driver script) reported that parent's
    peak as its own."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
