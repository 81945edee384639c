"""A Batch handed from a decode worker to the trainer through one shared-memory block.

    worker    Batch ──pack──► /dev/shm block [dense | labels | values | lengths] + a small handle
    queue     the handle (block name, shapes; a few hundred bytes pickled)
    trainer   handle ──take──► Batch: one copy out of the block (into pinned memory where
              CUDA is present, so the H2D copy can be async), then the block is unlinked

One block per batch, one copy on each side: far cheaper than torch's tensor sharing,
which passes a file descriptor over a socket per tensor. A handle never taken (an
abandoned epoch) is released with :meth:`SharedBatch.release`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from data.batch import Batch
from data.jagged import JaggedFeatures

_FIELDS = ("dense", "labels", "values", "lengths")


@dataclass
class SharedBatch:
    """Where a batch's four arrays lie in the block ``name`` (picklable, small)."""

    name: str
    keys: list[str]
    stride: int
    shapes: list[tuple[int, ...]]
    dtypes: list[str]

    @staticmethod
    def pack(batch: Batch) -> SharedBatch:
        from multiprocessing import resource_tracker, shared_memory

        arrays = [batch.dense.numpy(), batch.labels.numpy(), batch.sparse.values().numpy(),
                  batch.sparse.lengths().numpy()]
        shm = shared_memory.SharedMemory(create=True, size=max(1, sum(a.nbytes for a in arrays)))
        at = 0
        for a in arrays:
            np.frombuffer(shm.buf, a.dtype, a.size, at)[:] = a.reshape(-1)
            at += a.nbytes
        # the trainer unlinks it; the worker's exit must not
        resource_tracker.unregister(shm._name, "shared_memory")
        shm.close()
        return SharedBatch(shm.name, list(batch.sparse.keys()), batch.sparse.stride(),
                           [a.shape for a in arrays], [a.dtype.str for a in arrays])

    def take(self, pin: bool = False) -> Batch:
        """The batch, copied out of the block (into pinned memory if ``pin``); the block
        is gone afterwards."""
        from multiprocessing import shared_memory

        shm = shared_memory.SharedMemory(name=self.name)
        try:
            out, at = [], 0
            for shape, dtype in zip(self.shapes, self.dtypes):
                dt = np.dtype(dtype)
                n = int(np.prod(shape))
                t = torch.empty(shape, dtype=torch.from_numpy(np.empty(0, dt)).dtype,
                                pin_memory=pin)
                view = np.frombuffer(shm.buf, dt, n, at)
                t.numpy().reshape(-1)[:] = view
                del view  # no view may outlive the block
                out.append(t)
                at += n * dt.itemsize
        finally:
            shm.close()
            shm.unlink()
        dense, labels, values, lengths = out
        return Batch(dense=dense, labels=labels,
                     sparse=JaggedFeatures(keys=self.keys, values=values, lengths=lengths,
                                           stride=self.stride))

    def release(self) -> None:
        """Unlink the block without reading it."""
        from multiprocessing import shared_memory

        try:
            shm = shared_memory.SharedMemory(name=self.name)
        except FileNotFoundError:
            return
        shm.close()
        shm.unlink()
