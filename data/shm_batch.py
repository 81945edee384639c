"""A Batch handed from a decode worker to the trainer through one shared-memory block.

    worker    Batch ──pack──► /dev/shm block [dense | labels | values | lengths] + a small handle
    queue     the handle (block name, shapes; a few hundred bytes pickled)
    trainer   handle ──take──► Batch: one copy out of the block (into pinned memory where
              CUDA is present, so the H2D copy can be async); the worker reuses the block

A worker writes into a ring of blocks it reuses (:class:`BlockRing`; fresh blocks
would cost a page fault per 4 KiB on both sides); the trainer maps each block once.
One copy on each side: far cheaper than torch's tensor sharing, which passes a file
descriptor over a socket per tensor.
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

    def take(self, pin: bool = False) -> Batch:
        """The batch, copied out of the block (into pinned memory if ``pin``)."""
        buf = _ATTACHED.get(self.name)
        out, at = [], 0
        for shape, dtype in zip(self.shapes, self.dtypes):
            dt = np.dtype(dtype)
            n = int(np.prod(shape))
            t = torch.empty(shape, dtype=torch.from_numpy(np.empty(0, dt)).dtype, pin_memory=pin)
            t.numpy().reshape(-1)[:] = np.frombuffer(buf, dt, n, at)
            out.append(t)
            at += n * dt.itemsize
        dense, labels, values, lengths = out
        return Batch(dense=dense, labels=labels,
                     sparse=JaggedFeatures(keys=self.keys, values=values, lengths=lengths,
                                           stride=self.stride))


class BlockRing:
    """A worker's ``slots`` blocks, used in turn and grown when a batch needs more.

    Reuse is safe without a message back: the queue holds at most ``depth`` items and
    the consumer copies an item out before it takes the next, so when item n + depth + 2
    is written, item n was copied out long ago (``slots = depth + 2``). The worker
    unlinks its blocks when it exits (:meth:`close`); the consumer only maps them.
    """

    def __init__(self, slots: int) -> None:
        self.blocks: list = [None] * slots
        self.next = 0

    def pack(self, batch: Batch) -> SharedBatch:
        from multiprocessing import shared_memory

        arrays = [batch.dense.numpy(), batch.labels.numpy(), batch.sparse.values().numpy(),
                  batch.sparse.lengths().numpy()]
        need = max(1, sum(a.nbytes for a in arrays))
        i, self.next = self.next, (self.next + 1) % len(self.blocks)
        shm = self.blocks[i]
        if shm is None or shm.size < need:
            if shm is not None:
                shm.close()
                shm.unlink()
            # registered with the job's resource tracker: unlinked at the end even if
            # this worker is killed before close()
            shm = shared_memory.SharedMemory(create=True, size=need + need // 4)
            self.blocks[i] = shm
        at = 0
        for a in arrays:
            np.frombuffer(shm.buf, a.dtype, a.size, at)[:] = a.reshape(-1)
            at += a.nbytes
        return SharedBatch(shm.name, list(batch.sparse.keys()), batch.sparse.stride(),
                           [a.shape for a in arrays], [a.dtype.str for a in arrays])

    def close(self) -> None:
        for shm in self.blocks:
            if shm is not None:
                shm.close()
                shm.unlink()
        self.blocks = [None] * len(self.blocks)


class _Attached:
    """The consumer's mappings of workers' blocks, by name (at most ``keep``; the oldest
    are unmapped first: their workers replaced or unlinked them)."""

    def __init__(self, keep: int = 256) -> None:
        self.keep, self.maps = keep, {}

    def get(self, name: str) -> memoryview:
        shm = self.maps.get(name)
        if shm is None:
            from multiprocessing import shared_memory

            shm = shared_memory.SharedMemory(name=name)
            self.maps[name] = shm
            while len(self.maps) > self.keep:
                self.maps.pop(next(iter(self.maps))).close()
        return shm.buf


_ATTACHED = _Attached()
