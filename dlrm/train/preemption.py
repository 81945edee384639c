"""Preemption: SIGTERM or SIGINT on any rank ends training at a step every rank
agrees on, with a checkpoint, and ``dlrm train`` exits with ``PREEMPTED`` (75).

    SIGTERM on rank r ──► handler: remember the signal's number, nothing else
    ... the step in progress finishes on every rank ...
    after each step: CheckpointSchedule.after_step, one all-reduce (MAX) of
        [rank 0's "checkpoint interval passed", this rank's signal number]
    ──► every rank sees the signal after the same step: save RUN/checkpoints/step-N
    ──► exit 75; the same command resumes at step N (and ends bit-equal)

The handler does no I/O and raises nothing: it may run while the main thread waits
in a collective, and a rank that left mid-step would leave its peers waiting. More
signals change nothing (a scheduler signals every process, then torchrun's agent
forwards its own SIGTERM to its workers). Outside the training loop (start-up, the
final evaluation after the last checkpoint) signals act as usual: there is nothing
a checkpoint would keep.

Why 75 (sysexits.h's EX_TEMPFAIL, "try again later"): it is not 0, so torchrun's
agent counts the group failed and restarts it when ``--max-restarts`` allows (one
restart per preemption, resuming from the checkpoint, not from step 0); and it is
not 143 or 130, so a wrapper or a Kubernetes podFailurePolicy can tell "stopped
with a checkpoint, run me again" from "killed".
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any, Self

PREEMPTED = 75  # exit code of `dlrm train` stopped by a signal with its checkpoint written
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
    """While entered, SIGTERM and SIGINT set ``signum`` instead of ending the process.

    Python runs signal handlers in the main thread only: entered elsewhere (a run
    started from a thread) it installs nothing and signals act as usual."""

    def __init__(self) -> None:
        self.signum = 0  # the first signal received, 0 while none
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = self.signum or signum


def ignore_agent_signals() -> None:
    """For a torchrun worker that stopped with its checkpoint and is only leaving:
    SIGTERM and SIGINT are ignored from now on. The agent SIGTERMs the ranks still
    leaving once the first one exited 75; they would die of it, reported as the
    failure's root cause, instead of exiting 75 themselves. Outside torchrun (no
    TORCHELASTIC_RUN_ID, which the agent sets for its workers: one process, or
    ``main`` called in-process by a test) nothing changes."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15."""
    return signal.Signals(signum).name
