"""``data.in_memory=true``: train on batches read once and kept, to measure the step alone.

    first epoch()   reader.epoch(0) ──► the first n batches, moved once to the device ──► kept
    every epoch     batch t = kept[t % n], t = start_step .. steps_per_epoch - 1

n = min(steps per epoch, the run's train.max_steps x train.accumulate): the batches
the run will take, no more. A benchmark setting (``dlrm bench``'s ``in_memory`` row):
beside the same engine reading Parquet, the ratio of the two rates is the share of the
step's time that the input costs. Every epoch replays epoch 0's batches (no reshuffle).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Protocol

import torch

from data.batch import Batch


class EpochSource(Protocol):
    def steps_per_epoch(self) -> int: ...

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]: ...


class StagedBatches:
    """Epochs of ``reader``'s first ``limit`` batches of epoch 0, kept on ``device``."""

    def __init__(self, reader: EpochSource, device: torch.device, limit: int = 0) -> None:
        self.reader, self.device = reader, device
        steps = reader.steps_per_epoch()
        self.n = min(steps, limit) if limit > 0 else steps
        self.kept: list[Batch] | None = None

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        if self.kept is None:
            self.kept = [b.to(self.device) for b in itertools.islice(self.reader.epoch(0), self.n)]
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # staged before the first step is timed
        kept = self.kept
        if not kept:
            return iter(())
        return (kept[t % len(kept)] for t in range(start_step, self.reader.steps_per_epoch()))
