"""Tensors copied into one page-locked block, on the calling thread.

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
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 64  # bytes: each tensor starts on a cache line


def pinned_copies(tensors: list[torch.Tensor], pin: bool = True) -> list[torch.Tensor]:
    """Copies of ``tensors`` (CPU), each a view of one new block, page-locked where
    ``pin`` (needs CUDA; False: ordinary memory, the same layout). As with
    ``pin_memory()``, a tensor pinned already is itself; one that is not contiguous is
    pinned by torch, apart."""
    if not tensors:
        return []
    kept = [pin and t.is_pinned() for t in tensors]
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
