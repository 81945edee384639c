"""Tensors copied into one page-locked block, on the calling thread, and to a GPU in one copy.

    tensors   a [B, 13] f32    b [B] f32    c [N] i64 ...
    block     [ a | pad | b | pad | c ... ]   uint8, pinned; each tensor a view of it,
              starting on a cache line

What ``tensor.pin_memory()`` does for each tensor, with one allocation and numpy's
copies: ``pin_memory()`` copies with torch's ``copy_``, which spreads a copy over
torch's intra-op threads and returns when the last is done. Where decode workers hold
the cores (a GPU run), one of those threads not scheduled holds the copy up: on this
2-core machine, with two busy processes beside it, a 1 MB ``copy_`` took 15 us at the
median and 3.7 ms on average; ``np.copyto``, one thread with the GIL released, 24 us
both. The views share the block's storage, so a ``non_blocking`` H2D copy from any of
them keeps the block from being handed out again until the copy ends (torch's host
allocator tracks it by storage).

``to_device`` moves such a set of tensors (a batch's dense, labels, ids and lengths)
to a GPU as that one block: one pinned block at most (none where they view one
already: the reader's batches), one H2D copy, and the device tensors views of one
device block, so one ``record_stream`` covers them all: where four copies a batch
were four device allocations, four launches and four ``record_stream`` calls of the
step loop (a Hotline step is bound by that thread's time on a GPU).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

_ALIGN = 64  # bytes: each tensor starts on a cache line
# non_blocking copies from the callers' page-locked blocks, in flight: (an event after
# the copy, the block). Torch's host allocator keeps a pinned block of its own from
# reuse until the copy ends; memory it does not own (a decode worker's slot, registered
# with CUDA: data/shm_batch.py) only this keeps: dropped, the slot would be freed and
# written again while the DMA reads it. Let go once the event has passed (oldest first).
_IN_FLIGHT: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()
_IN_FLIGHT_LOCK = threading.Lock()


def pinned_copies(tensors: list[torch.Tensor], pin: bool = True, keep_pinned: bool = True) -> list[torch.Tensor]:
    """Copies of ``tensors`` (CPU), each a view of one new block, page-locked where
    ``pin`` (needs CUDA; False: ordinary memory, the same layout). As with
    ``pin_memory()``, a tensor pinned already is itself (``keep_pinned`` False: copied
    too, so that all are in the block); one that is not contiguous is pinned by torch,
    apart."""
    if not tensors:
        return []
    kept = [pin and keep_pinned and t.is_pinned() for t in tensors]
    copied = [t.is_contiguous() and not keep for t, keep in zip(tensors, kept, strict=True)]
    starts, end = [], 0
    for t, copy in zip(tensors, copied, strict=True):
        if copy:
            starts.append(end)
            end += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    # no block where nothing is copied (the reader's batches, pinned already): an empty
    # pinned one took ~68 us a call on the 2026-11-28 H200, 4 calls a step
    block = torch.empty(end, dtype=torch.uint8, pin_memory=pin) if starts else None
    target = None if block is None else block.numpy()
    out, at = [], iter(starts)
    for t, keep, copy in zip(tensors, kept, copied, strict=True):
        if keep:
            out.append(t)
            continue
        if not copy:
            out.append(t.pin_memory() if pin else t.clone())
            continue
        start, size = next(at), t.numel() * t.element_size()
        view = block[start:start + size]
        np.copyto(target[start:start + size], _bytes(t))
        out.append(view.view(t.dtype).view(t.shape))
    return out


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's bytes as a flat numpy array (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)


def one_block(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """Where every tensor with elements is a contiguous view of one storage, close
    together: a uint8 view of the bytes they span and each one's start in it (an empty
    one: 0); else None.

        storage  [ ... | dense | pad | labels | pad | values | lengths | ... ]
        block          ^0            ^starts[1]     ^starts[2] ^starts[3]
    """
    storage, starts, ends = None, [], []
    for t in tensors:
        if not t.numel():
            starts.append(None)
            continue
        if not t.is_contiguous():
            return None
        s = t.untyped_storage()
        if storage is None:
            storage = s
        elif s.data_ptr() != storage.data_ptr():
            return None
        start = t.storage_offset() * t.element_size()
        starts.append(start)
        ends.append(start + t.numel() * t.element_size())
    if storage is None:
        return None
    # from a cache line: the views of a fresh (aligned) device block keep their alignment
    lo = min(s for s in starts if s is not None) // _ALIGN * _ALIGN
    if max(ends) - lo > 2 * sum(t.numel() * t.element_size() for t in tensors) + 4096:
        return None  # views far apart in a larger storage: copying the span would move more than them
    whole = torch.empty(0, dtype=torch.uint8, device=tensors[0].device).set_(storage)
    return whole[lo:max(ends)], [0 if s is None else s - lo for s in starts]


def to_device(tensors: list[torch.Tensor], device: torch.device, non_blocking: bool = True) -> list[torch.Tensor]:
    """``tensors`` (CPU) on ``device`` in one copy of one block (see the module's
    docstring): views of one device block, the same shapes and dtypes. ``non_blocking``:
    from page-locked memory, a copy the host does not wait for (tensors not in one
    pinned block are copied into one first); a device tensor among them, or nothing to
    copy, and each goes by its own ``to``."""
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return [t.to(device, non_blocking=non_blocking) for t in tensors]
    found = one_block(tensors)
    theirs = found is not None and (not non_blocking or found[0].is_pinned())
    if not theirs:
        found = one_block(pinned_copies([t.contiguous() for t in tensors], pin=non_blocking, keep_pinned=False))
        if found is None:  # every tensor empty
            return [t.to(device, non_blocking=non_blocking) for t in tensors]
    block, starts = found
    moved = block.to(device, non_blocking=non_blocking)
    if theirs and non_blocking and moved.device.type == "cuda":
        _keep_until_copied(block)
    return [moved[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, at in zip(tensors, starts, strict=True)]


def record_once(tensors: list[torch.Tensor], stream: torch.cuda.Stream) -> None:
    """``record_stream`` on each storage of ``tensors`` once: the caching allocator
    tracks a block by its storage, so one call keeps all its views' memory."""
    seen: set[int] = set()
    for t in tensors:
        if not t.numel():  # no memory read
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            t.record_stream(stream)


def _keep_until_copied(block: torch.Tensor) -> None:
    """Hold ``block`` until the copy just queued from it on the current stream is done;
    let go of those whose copies are (see ``_IN_FLIGHT``)."""
    copied = torch.cuda.Event()
    copied.record()
    with _IN_FLIGHT_LOCK:
        while _IN_FLIGHT and _IN_FLIGHT[0][0].query():
            _IN_FLIGHT.popleft()
        _IN_FLIGHT.append((copied, block))


# CUDA graph captures in progress, in any thread (``capturing``). While any stream of the
# device captures, a device synchronize from any thread is invalid and invalidates that
# capture (CUDA's programming guide, "Prohibited and unhandled operations"; a
# thread_local capture spares other threads' unsafe calls, not that): a slot let go
# by the batch-taking thread (data/shm_batch.py) waited for the device so, and the
# capture it met ran every later step eager. Registration calls are put off while a
# capture runs (``when_no_capture``). Re-entrant: the garbage collector, run by the
# capture's own entry, may finalize a reader and let its slots go on this thread.
_CAPTURES = 0
_CAPTURE_LOCK = threading.RLock()


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Around every CUDA graph capture (dlrm/train/graphs.py, split_graphs.py,
    dense_graphs.py): no ``when_no_capture`` call runs meanwhile."""
    global _CAPTURES
    with _CAPTURE_LOCK:  # waits for a registration call under way
        _CAPTURES += 1
    try:
        yield
    finally:
        with _CAPTURE_LOCK:
            _CAPTURES -= 1


def when_no_capture(call: Callable[[], object]) -> tuple[bool, object]:
    """(True, ``call()``) where no capture is in progress (none begins until it returns),
    else (False, None), not called."""
    with _CAPTURE_LOCK:
        if _CAPTURES:
            return False, None
        return True, call()


def on_cuda_thread(call: Callable[[], object], device: int | None) -> object:
    """``call()`` (a CUDA registration call) on a thread of its own, on CUDA ``device``
    (None: the runtime's default for a new thread, device 0), waited for. A failed
    CUDA runtime call leaves its error in the calling thread's last-error state, which
    torch has no call to clear, and the next kernel launch's check in that thread
    would raise it as its own; no kernel is launched on this thread. (The decode
    workers' slots, data/shm_batch.py; the host tier's tables,
    embeddings/hotline/mapped.py.)"""

    def on_device() -> object:
        if device is not None:
            torch.cuda.set_device(device)
        return call()

    return _cuda_thread().submit(on_device).result()


@functools.cache
def _cuda_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="cuda-register")
