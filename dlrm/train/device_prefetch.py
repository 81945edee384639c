"""The next batch already on the device: pinned, copied on a side stream during the step.

    host batches   ──pin──► b1 (pinned) ──copy on the side stream──► b1 on the device
    compute stream    [ step on b0 ............ ] wait(b1's event) [ step on b1 ... ]
    side stream          [ H2D b1 ]                                   [ H2D b2 ]

``DevicePrefetcher(batches, device)`` is an iterator of batches on ``device``: taking
batch t hands out the copy started one step earlier and starts the copy of batch t+1.
The compute stream waits only on batch t's own copy (a CUDA event), and each handed-out
tensor is ``record_stream``-ed on the compute stream, so the caching allocator does not
reuse its memory for the next copy while the step still reads it.

CUDA graphs replay fixed addresses: ``next(into=static)`` copies the prefetched batch
into the caller's device tensors (``static``, a Batch of the same shapes) on the compute
stream, a device-to-device copy ordered after the previous replay, and returns
``static``. The host-to-device copy itself still ran ahead on the side stream.

On CPU (or any non-CUDA device) batches pass through ``Batch.to`` unchanged, with no
stream and no pinning: the same batches as without the prefetcher.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator

import torch

from data.batch import Batch


class DevicePrefetcher:
    """Batches of ``batches`` on ``device``, the next one copied while the caller works."""

    def __init__(self, batches: Iterator[Batch], device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.source = iter(batches)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._ahead: tuple[Batch, torch.cuda.Event | None] | None = None
        self._done = False
        self._start_next()

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> Batch:
        return self.next()

    def next(self, into: Batch | None = None) -> Batch:
        """The next batch on the device (``into``: copied into these tensors, returned)."""
        if self._ahead is None:
            raise StopIteration
        batch, ready = self._ahead
        if ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(ready)  # only this batch's copy, not the whole side stream
            batch.record_stream(current)
        self._start_next()
        if into is None:
            return batch
        _copy_into(into, batch)
        return into

    def close(self) -> None:
        """Stop reading ``batches`` (closing it if it is a generator)."""
        self._ahead, self._done = None, True
        if isinstance(self.source, Generator):
            self.source.close()

    def _start_next(self) -> None:
        """Take the next host batch and start its copy (CUDA: pinned, side stream)."""
        if self._done:
            self._ahead = None
            return
        try:
            host = next(self.source)
        except StopIteration:
            self._ahead, self._done = None, True
            return
        if not self.cuda:
            self._ahead = (host.to(self.device), None)
            return
        with torch.cuda.stream(self.stream):
            # one H2D copy of one page-locked block (data/batch.py: pinned first, where
            # the batch is not one already as the reader's are)
            moved = host.to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        self._ahead = (moved, ready)


def _copy_into(static: Batch, batch: Batch) -> None:
    """Copy ``batch``'s tensors into ``static``'s (same shapes), on the current stream."""
    pairs = [(static.dense, batch.dense), (static.labels, batch.labels),
             (static.sparse.values(), batch.sparse.values()),
             (static.sparse.lengths(), batch.sparse.lengths())]
    for out, src in pairs:
        if out.shape != src.shape:
            raise ValueError(f"static batch tensor of shape {tuple(out.shape)} cannot hold "
                             f"{tuple(src.shape)}: pad batches to the captured shapes")
        out.copy_(src, non_blocking=True)
    static.sparse.offsets().copy_(batch.sparse.offsets(), non_blocking=True)  # cached in static
