"""A static Hotline step's staged cold rows carried from one step to the next (the
patch and the keep of embeddings/hotline/cold_stage.py), each one launch that touches
only the U rows staged, not the C the buffers hold.

    ids       [C]  this step's staged ids, ascending, first ``count`` valid
    prev_ids  [C]  the last step's, first ``prev_count`` valid
    rows      [C, D], state: up to two tensors [C] or [C, D] (the optimizer's, per row)

    patch  program i < count: j = the place of ids[i] in prev_ids[:prev_count] (a binary
           search); where prev_ids[j] == ids[i]: rows[i], state[i] = prev_rows[j], prev_state[j]
    keep   program i < count: prev_*[i] = this step's; prev_count = count

Every size is the buffers' (C programs; those past ``count`` return at once), so both
run inside a CUDA graph; ``count`` and ``prev_count`` are read on the device. The torch
references (``patch_reference``, ``keep_reference``) do the same over all C rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from embeddings.kernels.pooled import block_d, warps

NO_STATE, PER_ROW, PER_ELEMENT = 0, 1, 2  # a state tensor's width: none, [C], [C, D]


@triton.jit
def _copy_row(dst_ptr, src_ptr, to, at, dim, cols, WIDTH: tl.constexpr):
    """dst row ``to`` = src row ``at``: a whole row of ``dim`` (PER_ELEMENT) or one value."""
    if WIDTH == 2:
        in_row = cols < dim
        value = tl.load(src_ptr + at * dim + cols, mask=in_row)
        tl.store(dst_ptr + to * dim + cols, value, mask=in_row)
    elif WIDTH == 1:
        tl.store(dst_ptr + to, tl.load(src_ptr + at))


@triton.jit
def _patch_kernel(ids_ptr, count_ptr, prev_ids_ptr, prev_count_ptr, rows_ptr, prev_rows_ptr,
                  s1_ptr, p1_ptr, s2_ptr, p2_ptr, dim,
                  W1: tl.constexpr, W2: tl.constexpr, STEPS: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    if i < tl.load(count_ptr):
        target = tl.load(ids_ptr + i)
        n = tl.load(prev_count_ptr)
        lo = n * 0
        hi = n
        for _ in range(STEPS):  # the first place whose id is not below target
            mid = (lo + hi) // 2
            open_range = lo < hi
            below = tl.load(prev_ids_ptr + mid, mask=open_range, other=0) < target
            lo = tl.where(open_range & below, mid + 1, lo)
            hi = tl.where(open_range & (below == 0), mid, hi)
        inside = lo < n
        if inside & (tl.load(prev_ids_ptr + lo, mask=inside, other=-1) == target):  # ids are >= 0
            cols = tl.arange(0, BLOCK_D)
            _copy_row(rows_ptr, prev_rows_ptr, i, lo, dim, cols, 2)
            _copy_row(s1_ptr, p1_ptr, i, lo, dim, cols, W1)
            _copy_row(s2_ptr, p2_ptr, i, lo, dim, cols, W2)


@triton.jit
def _keep_kernel(ids_ptr, count_ptr, prev_ids_ptr, rows_ptr, prev_rows_ptr, s1_ptr, p1_ptr, s2_ptr, p2_ptr,
                 dim, W1: tl.constexpr, W2: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    if i < tl.load(count_ptr):
        cols = tl.arange(0, BLOCK_D)
        tl.store(prev_ids_ptr + i, tl.load(ids_ptr + i))
        _copy_row(prev_rows_ptr, rows_ptr, i, i, dim, cols, 2)
        _copy_row(p1_ptr, s1_ptr, i, i, dim, cols, W1)
        _copy_row(p2_ptr, s2_ptr, i, i, dim, cols, W2)


def _states(state: list[torch.Tensor], prev: list[torch.Tensor], filler: torch.Tensor
            ) -> tuple[list[torch.Tensor], list[int]]:
    """Two (state, prev state) pointer pairs and their widths (absent ones: ``filler``)."""
    if len(state) > 2:
        raise ValueError(f"at most two per-row state tensors, got {len(state)}")
    pairs, widths = [], []
    for k in range(2):
        if k < len(state):
            pairs += [state[k], prev[k]]
            widths.append(PER_ROW if state[k].dim() == 1 else PER_ELEMENT)
        else:
            pairs += [filler, filler]
            widths.append(NO_STATE)
    return pairs, widths


def patch_rows(ids: torch.Tensor, count: torch.Tensor, prev_ids: torch.Tensor, prev_count: torch.Tensor,
               rows: torch.Tensor, prev_rows: torch.Tensor, state: list[torch.Tensor],
               prev_state: list[torch.Tensor]) -> None:
    """Each of the first ``count`` staged rows that ``prev_ids[:prev_count]`` holds takes
    the last step's row and state (module docstring), in place."""
    capacity, dim = rows.shape
    pairs, (w1, w2) = _states(state, prev_state, rows)
    steps = max(1, int(capacity).bit_length())  # halvings of [0, C] down to one place
    _patch_kernel[(capacity,)](ids, count, prev_ids, prev_count, rows, prev_rows, *pairs, dim,
                               W1=w1, W2=w2, STEPS=steps, BLOCK_D=block_d(dim), num_warps=warps(dim))


def keep_rows(ids: torch.Tensor, count: torch.Tensor, prev_ids: torch.Tensor, prev_count: torch.Tensor,
              rows: torch.Tensor, prev_rows: torch.Tensor, state: list[torch.Tensor],
              prev_state: list[torch.Tensor]) -> None:
    """The first ``count`` staged ids, rows and state become the last step's."""
    capacity, dim = rows.shape
    pairs, (w1, w2) = _states(state, prev_state, rows)
    _keep_kernel[(capacity,)](ids, count, prev_ids, rows, prev_rows, *pairs, dim,
                              W1=w1, W2=w2, BLOCK_D=block_d(dim), num_warps=warps(dim))
    prev_count.copy_(count)


def patch_reference(ids: torch.Tensor, count: torch.Tensor, prev_ids: torch.Tensor, prev_count: torch.Tensor,
                    rows: torch.Tensor, prev_rows: torch.Tensor, state: list[torch.Tensor],
                    prev_state: list[torch.Tensor]) -> None:
    """``patch_rows`` in torch ops over all C rows (static shapes: a sorted search of
    every id in ``prev_ids`` with its first ``prev_count`` valid)."""
    capacity = ids.numel()
    positions = torch.arange(capacity, device=ids.device)
    last_ids = torch.where(positions < prev_count, prev_ids, torch.iinfo(torch.int64).max)  # sorted
    at = torch.searchsorted(last_ids, ids).clamp_(max=capacity - 1)
    hit = (last_ids.index_select(0, at) == ids) & (at < prev_count) & (positions < count)
    for now, last in zip([rows, *state], [prev_rows, *prev_state], strict=True):
        mask = hit.view(-1, *([1] * (now.dim() - 1)))
        now.copy_(torch.where(mask, last.index_select(0, at), now))


def keep_reference(ids: torch.Tensor, count: torch.Tensor, prev_ids: torch.Tensor, prev_count: torch.Tensor,
                   rows: torch.Tensor, prev_rows: torch.Tensor, state: list[torch.Tensor],
                   prev_state: list[torch.Tensor]) -> None:
    """``keep_rows`` in torch ops over all C rows (rows past ``count`` copied too)."""
    prev_ids.copy_(ids)
    for now, last in zip([rows, *state], [prev_rows, *prev_state], strict=True):
        last.copy_(now)
    prev_count.copy_(count)
