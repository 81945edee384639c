"""A static Hotline step's staged cold rows carried from one step to the next (the
patch and the keep of embeddings/hotline/cold_stage.py), each one launch that touches
only the U rows staged, not the C the buffers hold.

    ids       [C]  this step's staged ids, ascending, first ``count`` valid
    prev_ids  [C]  the last step's, first ``prev_count`` valid
    rows      [C, D], state: up to two tensors [C] or [C, D] (the optimizer's, per row)

    patch  row i < count: j = the place of ids[i] in prev_ids[:prev_count] (a binary
           search); where prev_ids[j] == ids[i]: rows[i], state[i] = prev_rows[j], prev_state[j]
    keep   row i < count: prev_*[i] = this step's; prev_count = count

A program takes ROWS (16) rows, a [ROWS, D] tile. Every size is the buffers' (C / ROWS
programs; those past ``count`` return at once), so both
run inside a CUDA graph; ``count`` and ``prev_count`` are read on the device. The torch
references (``patch_reference``, ``keep_reference``) do the same over all C rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from embeddings.kernels.pooled import block_d

NO_STATE, PER_ROW, PER_ELEMENT = 0, 1, 2  # a state tensor's width: none, [C], [C, D]


# Staged rows a program carries: C / ROWS programs, not C. A program per row, most of
# them past ``count`` (a static step's C is every lookup of the batch, ~23x its cold
# rows on bench_gpu), spent its time being scheduled, not copying.
ROWS = 16


@triton.jit
def _copy_rows(dst_ptr, src_ptr, to, at, dim, cols, live, WIDTH: tl.constexpr):
    """dst rows ``to`` = src rows ``at`` ([ROWS] each) where ``live``: whole rows of
    ``dim`` (PER_ELEMENT) or one value each."""
    if WIDTH == 2:
        in_tile = live[:, None] & (cols[None, :] < dim)
        value = tl.load(src_ptr + at[:, None] * dim + cols[None, :], mask=in_tile)
        tl.store(dst_ptr + to[:, None] * dim + cols[None, :], value, mask=in_tile)
    elif WIDTH == 1:
        tl.store(dst_ptr + to, tl.load(src_ptr + at, mask=live), mask=live)


@triton.jit
def _patch_kernel(ids_ptr, count_ptr, prev_ids_ptr, prev_count_ptr, rows_ptr, prev_rows_ptr,
                  s1_ptr, p1_ptr, s2_ptr, p2_ptr, dim,
                  W1: tl.constexpr, W2: tl.constexpr, STEPS: tl.constexpr, BLOCK_D: tl.constexpr,
                  ROWS: tl.constexpr):
    first = tl.program_id(0).to(tl.int64) * ROWS
    count = tl.load(count_ptr)
    if first < count:
        i = first + tl.arange(0, ROWS)
        live = i < count
        target = tl.load(ids_ptr + i, mask=live, other=0)
        n = tl.load(prev_count_ptr)
        lo = tl.zeros([ROWS], dtype=tl.int64)
        hi = lo + n
        for _ in range(STEPS):  # each row's first place whose id is not below its target
            mid = (lo + hi) // 2
            open_range = live & (lo < hi)
            below = tl.load(prev_ids_ptr + mid, mask=open_range, other=0) < target
            lo = tl.where(open_range & below, mid + 1, lo)
            hi = tl.where(open_range & (below == 0), mid, hi)
        inside = live & (lo < n)
        hit = inside & (tl.load(prev_ids_ptr + lo, mask=inside, other=-1) == target)  # ids are >= 0
        cols = tl.arange(0, BLOCK_D)
        _copy_rows(rows_ptr, prev_rows_ptr, i, lo, dim, cols, hit, 2)
        _copy_rows(s1_ptr, p1_ptr, i, lo, dim, cols, hit, W1)
        _copy_rows(s2_ptr, p2_ptr, i, lo, dim, cols, hit, W2)


@triton.jit
def _keep_kernel(ids_ptr, count_ptr, prev_ids_ptr, rows_ptr, prev_rows_ptr, s1_ptr, p1_ptr, s2_ptr, p2_ptr,
                 dim, W1: tl.constexpr, W2: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    first = tl.program_id(0).to(tl.int64) * ROWS
    count = tl.load(count_ptr)
    if first < count:
        i = first + tl.arange(0, ROWS)
        live = i < count
        cols = tl.arange(0, BLOCK_D)
        tl.store(prev_ids_ptr + i, tl.load(ids_ptr + i, mask=live), mask=live)
        _copy_rows(prev_rows_ptr, rows_ptr, i, i, dim, cols, live, 2)
        _copy_rows(p1_ptr, s1_ptr, i, i, dim, cols, live, W1)
        _copy_rows(p2_ptr, s2_ptr, i, i, dim, cols, live, W2)


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


def _tile_warps(dim: int) -> int:
    """Warps for a [ROWS, BLOCK_D] tile: one per 512 values, 1 to 4."""
    return min(4, max(1, ROWS * block_d(dim) // 512))


def patch_rows(ids: torch.Tensor, count: torch.Tensor, prev_ids: torch.Tensor, prev_count: torch.Tensor,
               rows: torch.Tensor, prev_rows: torch.Tensor, state: list[torch.Tensor],
               prev_state: list[torch.Tensor]) -> None:
    """Each of the first ``count`` staged rows that ``prev_ids[:prev_count]`` holds takes
    the last step's row and state (module docstring), in place."""
    capacity, dim = rows.shape
    pairs, (w1, w2) = _states(state, prev_state, rows)
    steps = max(1, int(capacity).bit_length())  # halvings of [0, C] down to one place
    _patch_kernel[(triton.cdiv(capacity, ROWS),)](ids, count, prev_ids, prev_count, rows, prev_rows, *pairs, dim,
                                                  W1=w1, W2=w2, STEPS=steps, BLOCK_D=block_d(dim), ROWS=ROWS,
                                                  num_warps=_tile_warps(dim))


def keep_rows(ids: torch.Tensor, count: torch.Tensor, prev_ids: torch.Tensor, prev_count: torch.Tensor,
              rows: torch.Tensor, prev_rows: torch.Tensor, state: list[torch.Tensor],
              prev_state: list[torch.Tensor]) -> None:
    """The first ``count`` staged ids, rows and state become the last step's."""
    capacity, dim = rows.shape
    pairs, (w1, w2) = _states(state, prev_state, rows)
    _keep_kernel[(triton.cdiv(capacity, ROWS),)](ids, count, prev_ids, rows, prev_rows, *pairs, dim,
                                                 W1=w1, W2=w2, BLOCK_D=block_d(dim), ROWS=ROWS,
                                                 num_warps=_tile_warps(dim))
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
