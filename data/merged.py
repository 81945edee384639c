"""One process reading in the order of a W-rank job.

Batch t here = the concatenation of batch t of ranks 0..W-1 of a W-rank job on
the same files and seed. Used to check a W-rank run against one process, and to
reproduce a multi-rank run on one machine (``data.order_world_size=W``).

    rank 0 batch t: [a a a]   rank 1 batch t: [b b]   ──►   merged batch t: [a a a b b]
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from data.bad_data import BadDataLog
from data.batch import Batch
from data.jagged import JaggedFeatures
from data.schema import Schema


def concat_batches(batches: list[Batch]) -> Batch:
    """Samples of ``batches`` one after another (features kept feature-major)."""
    return Batch(
        dense=torch.cat([b.dense for b in batches]),
        sparse=JaggedFeatures.cat([b.sparse for b in batches]),
        labels=torch.cat([b.labels for b in batches]),
    )


class MergedReader:
    """W ParquetReaders (ranks 0..W-1 of one job) read as one."""

    def __init__(self, readers: list) -> None:
        self.readers = readers

    @property
    def num_rows(self) -> int:
        return self.readers[0].num_rows

    def steps_per_epoch(self) -> int:
        return self.readers[0].steps_per_epoch()

    def global_batch_size(self, step: int) -> int:
        return self.readers[0].global_batch_size(step)

    @property
    def bad_data(self) -> BadDataLog:
        """What the W readers dropped (``on_error="skip"``), together."""
        return BadDataLog(rec for r in self.readers for rec in r.bad_data.records)

    @property
    def schema(self) -> Schema:
        return self.readers[0].schema

    @property
    def id_policy(self) -> str:
        return self.readers[0].id_policy

    @property
    def unseen_ids(self) -> dict[str, int]:
        """Ids the W readers dropped (``id_policy="drop"``), by column, together."""
        out: dict[str, int] = {}
        for r in self.readers:
            for name, n in r.unseen_ids.items():
                out[name] = out.get(name, 0) + n
        return out

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        streams = [r.epoch(epoch, start_step) for r in self.readers]
        for group in zip(*streams):
            yield concat_batches(list(group))
