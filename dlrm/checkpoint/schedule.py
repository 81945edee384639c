"""When a run saves: every ``train.checkpoint_every`` steps and/or every
``train.checkpoint_seconds``, rank 0's clock deciding for every rank."""

from __future__ import annotations

import time

from dlrm.config import ConfigError
from dlrm.parallel.distributed import DistInfo, broadcast_flag


class CheckpointSchedule:
    """When to save: every ``train.checkpoint_every`` steps and/or once
    ``train.checkpoint_seconds`` passed since the last save.

    Time is read on rank 0 and its verdict broadcast, so every rank saves at the
    same step (a save is a collective); with ``checkpoint_seconds`` 0 nothing is
    exchanged."""

    def __init__(self, every_steps: int, every_seconds: float, keep: int, info: DistInfo,
                 saved_step: int | None = None) -> None:
        if every_steps < 0 or every_seconds < 0:
            raise ConfigError("train.checkpoint_every and train.checkpoint_seconds must be >= 0")
        if keep < 1:
            raise ConfigError(f"train.keep_checkpoints is {keep}: keep at least 1")
        self.every_steps, self.every_seconds, self.keep, self.info = every_steps, every_seconds, keep, info
        self.saved_step = saved_step
        self.saved_at = time.monotonic()

    def due(self, step: int) -> bool:
        """Whether to save after ``step`` (a collective when checkpoint_seconds > 0)."""
        due = bool(self.every_steps) and step % self.every_steps == 0
        if self.every_seconds > 0:
            late = time.monotonic() - self.saved_at >= self.every_seconds
            due = broadcast_flag(late, self.info) or due
        return due

    def saved(self, step: int) -> None:
        self.saved_step, self.saved_at = step, time.monotonic()
