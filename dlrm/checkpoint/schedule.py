"""When a run saves: every ``train.checkpoint_every`` steps, every
``train.checkpoint_seconds`` (rank 0's clock deciding for every rank), and when a
rank was signalled to stop (dlrm/train/preemption.py)."""

from __future__ import annotations

import time
from typing import NamedTuple

from dlrm.config import ConfigError
from dlrm.parallel.distributed import DistInfo, all_reduce_max

EXCHANGE_SECONDS = 0.5  # ranks compare clocks and signals about this often (>= every step)
MAX_STEPS_BETWEEN = 1000


class Verdict(NamedTuple):
    """What every rank does after a step, the same on all of them."""

    save: bool  # write a checkpoint now
    stop: int  # the signal that stops the run (the largest number any rank got), 0: go on


class CheckpointSchedule:
    """When to save: every ``train.checkpoint_every`` steps, once
    ``train.checkpoint_seconds`` passed since the last save, and before stopping.

    A save is a collective, so every rank must decide alike at the same step. At an
    exchange step the ranks all-reduce (MAX) three integers: rank 0's "the interval
    has passed" (the other ranks send 0: only rank 0's clock counts), each rank's
    stop signal (0 for none), and rank 0's count of steps to the next exchange, so
    that one falls about ``exchange_seconds`` later by rank 0's step time. Every
    rank counts the same steps down: one rank's SIGTERM stops all at the same step,
    within about half a second, and a tiny model's fast steps do not each pay a
    collective's latency (2-3 ms measured on a loaded 2-core host under gloo). With
    one process nothing is exchanged and every step looks."""

    def __init__(self, every_steps: int, every_seconds: float, keep: int, info: DistInfo,
                 saved_step: int | None = None, exchange_seconds: float = EXCHANGE_SECONDS) -> None:
        if every_steps < 0 or every_seconds < 0:
            raise ConfigError("train.checkpoint_every and train.checkpoint_seconds must be >= 0")
        if keep < 1:
            raise ConfigError(f"train.keep_checkpoints is {keep}: keep at least 1")
        self.every_steps, self.every_seconds, self.keep, self.info = every_steps, every_seconds, keep, info
        self.saved_step, self.exchange_seconds = saved_step, exchange_seconds
        self.saved_at = self._exchanged_at = time.monotonic()
        self._stretch = self._countdown = 1  # steps between exchanges, and left: the first after one

    def after_step(self, step: int, signum: int = 0) -> Verdict:
        """Save and/or stop after ``step``? ``signum``: the signal this rank got
        (0: none). Every rank calls it after every step; at exchange steps it is a
        collective (with several ranks)."""
        every = bool(self.every_steps) and step % self.every_steps == 0
        self._countdown -= 1
        if self._countdown > 0:
            return Verdict(save=every, stop=0)
        now = time.monotonic()
        late = self.info.is_main and self.every_seconds > 0 and now - self.saved_at >= self.every_seconds
        late, stop, self._countdown = all_reduce_max([int(late), signum, self._next_exchange(now)],
                                                     self.info)
        self._stretch = self._countdown
        return Verdict(save=bool(late) or every or bool(stop), stop=stop)

    def _next_exchange(self, now: float) -> int:
        """Rank 0: steps until about ``exchange_seconds`` from now at the pace since the
        last exchange (1 with one process: no collective to save). Others: 0."""
        if not self.info.is_main:
            return 0
        if self.info.world_size == 1:
            return 1
        step_s = (now - self._exchanged_at) / self._stretch
        self._exchanged_at = now
        return max(1, min(MAX_STEPS_BETWEEN, int(self.exchange_seconds / max(step_s, 1e-9))))

    def saved(self, step: int) -> None:
        self.saved_step, self.saved_at = step, time.monotonic()
