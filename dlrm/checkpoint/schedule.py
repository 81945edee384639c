"""When a run saves: every ``train.checkpoint_every`` steps, every
``train.checkpoint_seconds`` (rank 0's clock deciding for every rank), and when a
rank was signalled to stop (dlrm/train/preemption.py)."""

from __future__ import annotations

import time
from typing import NamedTuple

from dlrm.config import ConfigError
from dlrm.parallel.distributed import DistInfo, all_reduce_max


class Verdict(NamedTuple):
    """What every rank does after a step, the same on all of them."""

    save: bool  # write a checkpoint now
    stop: int  # the signal that stops the run (the largest number any rank got), 0: go on


class CheckpointSchedule:
    """When to save: every ``train.checkpoint_every`` steps, once
    ``train.checkpoint_seconds`` passed since the last save, and before stopping.

    A save is a collective, so every rank must decide alike at the same step. After
    each step the ranks all-reduce (MAX) two integers: rank 0's "the interval has
    passed" (the other ranks send 0: only rank 0's clock counts) and each rank's
    stop signal (0 for none). One rank's SIGTERM stops every rank at the same step.
    With one process nothing is exchanged."""

    def __init__(self, every_steps: int, every_seconds: float, keep: int, info: DistInfo,
                 saved_step: int | None = None) -> None:
        if every_steps < 0 or every_seconds < 0:
            raise ConfigError("train.checkpoint_every and train.checkpoint_seconds must be >= 0")
        if keep < 1:
            raise ConfigError(f"train.keep_checkpoints is {keep}: keep at least 1")
        self.every_steps, self.every_seconds, self.keep, self.info = every_steps, every_seconds, keep, info
        self.saved_step = saved_step
        self.saved_at = time.monotonic()

    def after_step(self, step: int, signum: int = 0) -> Verdict:
        """Save and/or stop after ``step``? ``signum``: the signal this rank got
        (0: none). A collective with several ranks: every rank calls it every step."""
        late = (self.info.is_main and self.every_seconds > 0
                and time.monotonic() - self.saved_at >= self.every_seconds)
        late, stop = all_reduce_max([int(late), signum], self.info)
        every = bool(self.every_steps) and step % self.every_steps == 0
        return Verdict(save=bool(late) or every or bool(stop), stop=stop)

    def saved(self, step: int) -> None:
        self.saved_step, self.saved_at = step, time.monotonic()
