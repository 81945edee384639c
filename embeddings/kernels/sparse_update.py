"""Backward of the pooled lookup: one sort, one program per run of equal ids.

    values [N] (feature-major bags)        grad_pooled (the forward's layout)
        │ _linearize: one program per 128 bags
        ▼
    linear [N] = row_base[f] + values[j]   bag_of [N] = the bag lookup j sits in
        │ torch.sort(stable): the step's only sort, static size N
        ▼
    sorted  [3 3 7 7 7 9]    order [4 0 1 2 5 3]   (positions of the lookups)
             ^   ^     ^     a run starts where sorted[i] != sorted[i-1]
        │ _segments: a run longer than SEGMENT (32) lookups is cut, from its head,
        │ into segments of 32; one program per 32 sorted positions finds the later
        │ segment starting among them (at most one) and sums it into partial[i // 32]
        │ _runs: program i returns unless a run starts at i; else it sums the run's
        │ first segment, grad_pooled[bag_of[order[k]]] (x 1/len for mean) in lookup
        │ order, adds the later segments' partials in order, and applies the
        │ optimizer to that one row, or writes (id, row) at slot i; an update with
        │ ``rows_by_id`` (first, out) applies the ids below first and writes each
        │ other run's row at out[id - first] (a static Hotline step: both tiers, one sort)
        ▼
    weight and optimizer state updated in place     |   KV gradient (ids, rows)

Why segments: a hot id's run is long (Zipf ids, a 3-row table: 1,444 of bench_gpu's
4,096-sample batch), and one program walking it serially, a chain of dependent
loads per lookup, was the step's longest kernel (the 2026-11-26 H200 profile of
configs/bench_gpu.yaml: 1.4 ms of a Hotline step's 3.1 ms of GPU time). Segmented,
its program sums 32 lookups and about len/32 partials; since 2026-11-28 a segment's
32 gradient rows (and 32 partials) are loaded at once, a tile, and added from it one
at a time, so a segment costs three dependent loads, not three a lookup. A run of at
most 32 lookups is summed exactly as before, bit for bit; a longer one in a fixed
order too (the segments start at its head, not at absolute positions, so a run sums
the same wherever it sits in the sort: one table alone or stacked with others).

A feature whose row_base is -1 belongs to another stack (one process, tables of
several dtypes: embeddings/dtype_stacks.py): its lookups linearize to OTHER_STACK,
sort after every row and no program applies them.

Every shape is N (the partials N / 32), known before the step: no unique, no host
sync. Each row is written by exactly one program (its run's head), so no atomics are
needed, and a run of at most 32 lookups is summed in the same order as
``KVGradient.from_lookups`` (a longer one in its segments' order, above). (One atomic add, rare:
an fp16 row whose write made finite values inf counts them in a per-feature counter,
``KernelRounding.overflow``, for the one-line warning of embeddings/narrow.py.)

The optimizers are those of ``embeddings/optim.py``, with the same formulas:

    SGD               w -= lr * g
    row-wise Adagrad  s += mean(g²);  w -= lr * g / (sqrt(s) + eps)
    Adagrad           s += g²;        w -= lr * g / (sqrt(s) + eps)
    Adam (lazy)       m += (1-b1)(g - m);  v += (1-b2)(g² - v)
                      w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)

``lr`` and Adam's step count ``t`` are read from device tensors, not passed as
numbers, so a captured CUDA graph replays with the current values.

Every fp32 division and square root here (and the mean's in the lookups) is IEEE's,
rounded to nearest (``tl.div_rn``, ``tl.sqrt_rn``), as torch's and the CPU's are: on a
GPU Triton's ``/`` is ``div.full.f32`` and ``tl.sqrt`` ``sqrt.approx``, a few ulp off.
Adam turns such an ulp into a whole step where a gradient nearly cancels (m / sqrt(v)
is about ±1 whatever its size): the 2026-11-27 H200 run of tests/test_gpu.py's
``test_cuda_equals_cpu[adam-true-mean]`` (mean pooling divides each gradient by its
bag's length) ended 2.7e-2 from the CPU on the top MLP, while the torch path on the
same GPU (``fused=false``) and sum pooling stayed within 3e-4. The interpreter
computes both exactly, so the CPU tests cannot tell them apart; the PTX can
(tests/test_kernels_compile.py).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from embeddings.kernels.pooled import block_d, warps
from embeddings.kernels.rounding import (
    FP16,
    NONE,
    KernelRounding,
    fmix32,
    half_code,
    rounded_bits,
    row_hash,
    seed_hash,
)
from embeddings.kv import KVGradient
from embeddings.optim import RowWiseAdagrad, SparseAdagrad, SparseAdam, SparseOptimizer, SparseSGD
from embeddings.rounding import table_key

KV, SGD, ROWWISE_ADAGRAD, ADAGRAD, ADAM = 0, 1, 2, 3, 4


# The stacked id of a lookup of another stack's feature (row_base -1): sorted after
# every row, and no run of it is applied (one process, several dtypes: each stack's
# update passes over the whole batch and takes its own features' lookups).
OTHER_STACK = tl.constexpr(1 << 62)


# Bags one program of ``_linearize_kernel`` takes (their lookups a column at a time):
# a program per bag, 106,496 of them for bench_gpu's batch, each one scheduled to move
# 16 bytes, spent its time being scheduled.
BAGS = 128


@triton.jit
def _linearize_kernel(values_ptr, offsets_ptr, row_base_ptr, linear_ptr, bag_of_ptr, batch, bags,
                      BAGS: tl.constexpr):
    bag = tl.program_id(0).to(tl.int64) * BAGS + tl.arange(0, BAGS)
    inside = bag < bags
    start = tl.load(offsets_ptr + bag, mask=inside, other=0)
    length = tl.load(offsets_ptr + bag + 1, mask=inside, other=0) - start
    base = tl.load(row_base_ptr + bag // batch, mask=inside, other=0)
    for k in range(tl.max(length, axis=0)):  # the k-th lookup of every bag that has one
        live = k < length
        j = start + k
        linear = tl.load(values_ptr + j, mask=live, other=0).to(tl.int64) + base
        tl.store(linear_ptr + j, tl.where(base < 0, OTHER_STACK, linear), mask=live)
        tl.store(bag_of_ptr + j, bag, mask=live)


# Lookups one program sums; a run's later segments are summed by programs of their own.
# DLRM_KERNEL_RUN_SEGMENT (read at import; a developer's A/B, not a setting; a power of
# two): one above any batch's lookups, 2**30, is the kernel before segments, one
# program walking each whole run (scripts/gpu_session.sh bench times both in one run).
SEGMENT = int(os.environ.get("DLRM_KERNEL_RUN_SEGMENT", "32"))
if SEGMENT < 1 or SEGMENT & (SEGMENT - 1):
    raise ValueError(f"DLRM_KERNEL_RUN_SEGMENT={SEGMENT} is not a power of two")
_SEGMENT = tl.constexpr(SEGMENT)  # the kernels' view of it (a global they may read)


@triton.jit
def _segment_gradient(sorted_ptr, order_ptr, bag_of_ptr, offsets_ptr, grad_ptr, i, row, n,
                      batch, stride_b, stride_f, cols, in_row,
                      MEAN: tl.constexpr, BLOCK_D: tl.constexpr):
    """Sum of the gradient rows of ``row``'s lookups at sorted positions i, i+1, ...:
    at most SEGMENT of them, up to the run's end, added one at a time in that order.

    The rows are loaded at once, a [SEGMENT, BLOCK_D] tile (three dependent loads for
    the whole segment, where a walk lookup by lookup made three per lookup: a hot id's
    32-lookup segment was a chain of ~100 loads), then added row by row
    (``_add_in_order``)."""
    ks = i + tl.arange(0, _SEGMENT)
    inside = ks < n
    live = inside & (tl.load(sorted_ptr + ks, mask=inside, other=-1) == row)  # the run's prefix from i
    bags = tl.load(bag_of_ptr + tl.load(order_ptr + ks, mask=live, other=0), mask=live, other=0)
    src = grad_ptr + (bags % batch)[:, None] * stride_b + (bags // batch)[:, None] * stride_f + cols[None, :]
    g = tl.load(src, mask=live[:, None] & in_row[None, :], other=0.0).to(tl.float32)
    if MEAN:
        length = (tl.load(offsets_ptr + bags + 1, mask=live, other=1)
                  - tl.load(offsets_ptr + bags, mask=live, other=0))
        g = tl.div_rn(g, tl.maximum(length, 1).to(tl.float32)[:, None])
    return _add_in_order(tl.zeros([BLOCK_D], dtype=tl.float32), g, tl.sum(live.to(tl.int32), axis=0))


@triton.jit
def _add_in_order(acc, tile, count):
    """``acc`` + the first ``count`` rows of ``tile`` [SEGMENT, BLOCK_D], one at a time
    in row order: row s picked by a masked sum whose other terms are +0.0, which adds
    nothing (nor changes a -0.0 row's effect: an accumulator from +0.0 is never -0.0)."""
    at = tl.arange(0, _SEGMENT)
    for s in range(count):
        acc += tl.sum(tl.where((at == s)[:, None], tile, 0.0), axis=0)
    return acc


@triton.jit
def _segments_kernel(sorted_ptr, order_ptr, bag_of_ptr, offsets_ptr, grad_ptr, head_of_ptr, partial_ptr,
                     n, batch, dim, stride_b, stride_f, MEAN: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program k, over sorted positions [k * SEGMENT, (k + 1) * SEGMENT): where a run's
    second, third, ... segment starts there (SEGMENT, 2 x SEGMENT, ... after its head),
    that segment's gradient sum into partial[k]. At most one starts in a window: two
    such starts are more than SEGMENT apart (each follows SEGMENT lookups of its run)."""
    k = tl.program_id(0)
    positions = k * _SEGMENT + tl.arange(0, _SEGMENT)
    inside = positions < n
    heads = tl.load(head_of_ptr + positions, mask=inside, other=0)
    rows = tl.load(sorted_ptr + positions, mask=inside, other=OTHER_STACK)
    starts = inside & (positions != heads) & ((positions - heads) % _SEGMENT == 0) & (rows != OTHER_STACK)
    i = tl.max(tl.where(starts, positions, -1), axis=0)
    if i >= 0:
        cols = tl.arange(0, BLOCK_D)
        in_row = cols < dim
        g = _segment_gradient(sorted_ptr, order_ptr, bag_of_ptr, offsets_ptr, grad_ptr, i, tl.load(sorted_ptr + i),
                              n, batch, stride_b.to(tl.int64), stride_f.to(tl.int64), cols, in_row,
                              MEAN, BLOCK_D)
        tl.store(partial_ptr + k.to(tl.int64) * dim + cols, g, mask=in_row)


@triton.jit
def _run_gradient(sorted_ptr, order_ptr, bag_of_ptr, offsets_ptr, grad_ptr, partial_ptr, i, row, n,
                  batch, dim, stride_b, stride_f, cols, in_row,
                  MEAN: tl.constexpr, BLOCK_D: tl.constexpr):
    """Sum of the gradient rows of the run of ``row`` that starts at sorted position i:
    its first segment, then the later segments' partials in order, SEGMENT of them
    loaded at once and added one at a time (as ``_segment_gradient`` adds its rows)."""
    acc = _segment_gradient(sorted_ptr, order_ptr, bag_of_ptr, offsets_ptr, grad_ptr, i, row, n,
                            batch, stride_b, stride_f, cols, in_row, MEAN, BLOCK_D)
    j = i + _SEGMENT  # the next later segment's start
    more = (j < n) & (tl.load(sorted_ptr + j, mask=j < n, other=-1) == row)
    while more:
        starts = j + tl.arange(0, _SEGMENT) * _SEGMENT
        inside = starts < n
        live = inside & (tl.load(sorted_ptr + starts, mask=inside, other=-1) == row)  # a prefix: the run's
        partials = tl.load(partial_ptr + (starts // _SEGMENT).to(tl.int64)[:, None] * dim + cols[None, :],
                           mask=live[:, None] & in_row[None, :], other=0.0)
        count = tl.sum(live.to(tl.int32), axis=0)
        acc = _add_in_order(acc, partials, count)
        j += _SEGMENT * _SEGMENT
        more = (count == _SEGMENT) & (j < n) & (tl.load(sorted_ptr + j, mask=j < n, other=-1) == row)
    return acc


@triton.jit
def _full_row(row, feature, row_shift_ptr, row_map_ptr, ROUNDS: tl.constexpr, ROW_MAP: tl.constexpr):
    """The row of the full table that stacked row ``row`` (of ``feature``'s table) is,
    the rounding hash's row: ``row + row_shift[feature]``, or with ``ROW_MAP`` (a
    Hotline hot tier, whose slots are no shift of their rows) ``row_map[row]``. Read
    only where something is rounded (else the pointers may be placeholders)."""
    full = row
    if ROUNDS:
        if ROW_MAP:
            full = tl.load(row_map_ptr + row)
        else:
            full = row + tl.load(row_shift_ptr + feature)
    return full


@triton.jit
def _store_rounded(ptr, bits_ptr, at, x, in_row, feature, full_row, cols, key_xor,
                   seed_h, rstep_ptr, keys_ptr, col0_ptr, HALF: tl.constexpr):
    """Write the fp32 row ``x`` at ``at``: as the tensor's type, or (HALF) stochastically
    rounded at its full-table coordinates (kernels/rounding.py; ``full_row`` from
    ``_full_row``), through int16 bits. The hash's table key is the table's xor
    ``key_xor``: 0 for the weight, crc32 of a state's name for that state's own stream
    (as embeddings/optim.py's put_state)."""
    if HALF == 0:
        out = x.to(ptr.dtype.element_ty)
        tl.store(ptr + at, out, mask=in_row)
    else:
        key = tl.load(keys_ptr + feature) ^ key_xor
        h_row = row_hash(seed_h, tl.load(rstep_ptr), key, full_row)
        h = fmix32(h_row ^ (tl.load(col0_ptr + feature) + cols).to(tl.uint32))
        out = rounded_bits(x, h, HALF)
        tl.store(bits_ptr + at, out, mask=in_row)
    return out  # what was written (HALF: the int16 bits)


@triton.jit
def _count_overflow(overflow_ptr, feature, x, bits, in_row):
    """Add to ``overflow_ptr[feature]`` the finite values of fp32 ``x`` whose fp16 ``bits``
    are inf (the fp16 overflow warning, read by the host where it waits anyway). The
    atomic runs only for a row that overflowed: the other rows touch no counter."""
    finite = ((x.to(tl.uint32, bitcast=True) >> 23) & 0xFF) != 255
    count = tl.sum((((bits & 0x7FFF) == 0x7C00) & finite & in_row).to(tl.int32), axis=0)
    tl.atomic_add(overflow_ptr + feature, count, mask=count > 0)


@triton.jit
def _updated_row(g, w, at, in_row, row, dim, lr, state_ptr, state2_ptr, step_ptr,
                 eps, mix1, mix2, log_beta1, log_beta2, sbits_ptr, s2bits_ptr, skey, s2key,
                 feature, full_row, cols, seed_h, rstep_ptr, keys_ptr, col0_ptr,
                 OPT: tl.constexpr, SHALF: tl.constexpr):
    """The row ``w`` after one optimizer step with gradient ``g``; its state updated in
    place, element-wise state (Adagrad's sum, Adam's moments) read in its type, computed
    in fp32 and written back as _store_rounded writes (SHALF: fp16/bf16 state)."""
    if OPT == 1:
        w = w - lr * g
    elif OPT == 2:  # row-wise Adagrad: one fp32 value per row
        s = tl.load(state_ptr + row) + tl.div_rn(tl.sum(g * g, axis=0), dim * 1.0)
        tl.store(state_ptr + row, s)
        w = w - g * tl.div_rn(lr, tl.sqrt_rn(s) + eps)
    elif OPT == 3:
        s = tl.load(state_ptr + at, mask=in_row, other=0.0).to(tl.float32) + g * g
        _store_rounded(state_ptr, sbits_ptr, at, s, in_row, feature, full_row, cols, skey,
                       seed_h, rstep_ptr, keys_ptr, col0_ptr, SHALF)
        w = w - lr * tl.div_rn(g, tl.sqrt_rn(s) + eps)
    else:
        m = tl.load(state_ptr + at, mask=in_row, other=0.0).to(tl.float32)
        v = tl.load(state2_ptr + at, mask=in_row, other=0.0).to(tl.float32)
        # mix = 1 - beta, made on the host in fp64: the launch rounds a float argument
        # to fp32, and 1 - fp32(0.999) is 1.3e-5 off (torch's lerp weight is 1 - 0.999)
        m = m + mix1 * (g - m)
        v = v + mix2 * (g * g - v)
        _store_rounded(state_ptr, sbits_ptr, at, m, in_row, feature, full_row, cols, skey,
                       seed_h, rstep_ptr, keys_ptr, col0_ptr, SHALF)
        _store_rounded(state2_ptr, s2bits_ptr, at, v, in_row, feature, full_row, cols, s2key,
                       seed_h, rstep_ptr, keys_ptr, col0_ptr, SHALF)
        t = tl.load(step_ptr).to(tl.float64)
        bias2 = 1.0 - tl.exp(t * log_beta2)  # 1 - beta2^t
        bias1 = 1.0 - tl.exp(t * log_beta1)
        step_size = (lr.to(tl.float64) * tl.sqrt(bias2) / bias1).to(tl.float32)
        w = w - step_size * tl.div_rn(m, tl.sqrt_rn(v) + eps)
    return w


@triton.jit
def _runs_kernel(
    sorted_ptr, order_ptr, bag_of_ptr, offsets_ptr, grad_ptr, partial_ptr,
    weight_ptr, state_ptr, state2_ptr, lr_ptr, step_ptr, out_ids_ptr, out_rows_ptr,
    n, batch, dim, stride_b, stride_f, eps, mix1, mix2, log_beta1, log_beta2,
    wbits_ptr, seed_h, rstep_ptr, keys_ptr, row_shift_ptr, col0_ptr, row_map_ptr,
    sbits_ptr, s2bits_ptr, skey, s2key, overflow_ptr, rows_from,
    OPT: tl.constexpr, MEAN: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr,
    SHALF: tl.constexpr, ROW_MAP: tl.constexpr, OVERFLOW: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(sorted_ptr + i)
    prev = tl.load(sorted_ptr + i - 1, mask=i > 0, other=-1)
    if ((i == 0) | (row != prev)) & (row != OTHER_STACK):
        cols = tl.arange(0, BLOCK_D)
        in_row = cols < dim
        g = _run_gradient(sorted_ptr, order_ptr, bag_of_ptr, offsets_ptr, grad_ptr, partial_ptr, i, row, n,
                          batch, dim, stride_b.to(tl.int64), stride_f.to(tl.int64), cols, in_row,
                          MEAN, BLOCK_D)
        at = row * dim + cols
        if OPT == 0:  # KV gradient: (id, summed row) at the run's head
            tl.store(out_ids_ptr + i, row)
            tl.store(out_rows_ptr + i.to(tl.int64) * dim + cols, g, mask=in_row)
        elif row >= rows_from:  # not applied: the summed row at out_rows[id - rows_from]
            tl.store(out_rows_ptr + (row - rows_from) * dim + cols, g, mask=in_row)
        else:
            feature = tl.load(bag_of_ptr + tl.load(order_ptr + i)) // batch
            full_row = _full_row(row, feature, row_shift_ptr, row_map_ptr, HALF + SHALF > 0, ROW_MAP)
            w = tl.load(weight_ptr + at, mask=in_row, other=0.0).to(tl.float32)
            w = _updated_row(g, w, at, in_row, row, dim, tl.load(lr_ptr), state_ptr, state2_ptr, step_ptr,
                             eps, mix1, mix2, log_beta1, log_beta2, sbits_ptr, s2bits_ptr, skey, s2key,
                             feature, full_row, cols, seed_h, rstep_ptr, keys_ptr, col0_ptr, OPT, SHALF)
            bits = _store_rounded(weight_ptr, wbits_ptr, at, w, in_row, feature, full_row, cols, 0,
                                  seed_h, rstep_ptr, keys_ptr, col0_ptr, HALF)
            if OVERFLOW:  # fp16 weight with a counter: finite values made inf, per feature
                _count_overflow(overflow_ptr, feature, w, bits, in_row)


def optimizer_code(optimizer: SparseOptimizer) -> int:
    """The ``OPT`` of ``_runs_kernel`` for an optimizer of embeddings/optim.py."""
    for kind, code in ((SparseSGD, SGD), (RowWiseAdagrad, ROWWISE_ADAGRAD),
                       (SparseAdagrad, ADAGRAD), (SparseAdam, ADAM)):
        if type(optimizer) is kind:
            return code
    raise TypeError(f"no fused Triton update for {type(optimizer).__name__}")


def _sorted_runs(
    values: torch.Tensor, offsets: torch.Tensor, row_base: torch.Tensor, batch: int, presorted: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted stacked ids, their lookup positions, the bag of each lookup), all [N].
    ``presorted``: the stacked ids in lookup order are ascending and distinct already
    (unreached lookups last): no sort."""
    n = values.numel()
    # OTHER_STACK where no bag reaches: a captured Hotline step's lookups past this
    # batch's (static_step.py: buffers of a multi-hot batch's capacity) are never applied
    linear = torch.full((n,), OTHER_STACK.value, dtype=torch.int64, device=values.device)
    bag_of = torch.empty(n, dtype=torch.int64, device=values.device)
    bags = row_base.numel() * batch
    if bags:
        _linearize_kernel[(triton.cdiv(bags, BAGS),)](values, offsets, row_base, linear, bag_of, batch, bags,
                                                      BAGS=BAGS, num_warps=4)
    if presorted:
        return linear, torch.arange(n, device=values.device), bag_of
    sorted_ids, order = torch.sort(linear, stable=True)
    return sorted_ids, order, bag_of


def _run_heads(sorted_ids: torch.Tensor) -> torch.Tensor:
    """[N]: the sorted position where each position's run starts: the first place of
    its id in the sorted ids, one binary search per position (static shapes, no host
    sync). Not a running maximum of the starts' positions (torch.cummax, as before):
    on CUDA a scan with indices of one row is one thread block walking the row 1,024
    values at a time, ~100 dependent rounds for a 106k-lookup batch, on one SM while
    the others idle; the searches run on all of them."""
    return torch.searchsorted(sorted_ids, sorted_ids)


def _segment_partials(sorted_ids, order, bag_of, offsets, grad_pooled, n, batch, dim, stride_b, stride_f,
                      mean) -> torch.Tensor:
    """[ceil(N / SEGMENT), dim]: the later segments' sums of the long runs, one program
    per SEGMENT positions, row k for the segment starting in window k (the rest of the
    buffer is never read). No run is longer than a segment when N is not: nothing to
    launch."""
    windows = -(-n // SEGMENT)
    partial = torch.empty(max(windows, 1), dim, dtype=torch.float32, device=grad_pooled.device)
    if n > SEGMENT:
        _segments_kernel[(windows,)](sorted_ids, order, bag_of, offsets, grad_pooled, _run_heads(sorted_ids),
                                     partial, n, batch, dim, stride_b, stride_f, MEAN=mean, BLOCK_D=block_d(dim),
                                     num_warps=warps(dim))
    return partial


def _launch_runs(grad_pooled, values, offsets, row_base, batch, mean, feature_major,
                 opt, weight, states, lr, step, out_ids, out_rows, eps=0.0, betas=(0.0, 0.0),
                 rounding: KernelRounding | None = None, state_keys=(0, 0), rows_from: int = OTHER_STACK.value,
                 presorted: bool = False):
    """``states``: the optimizer's state tensors the kernel updates; fp16/bf16 ones are
    rounded with ``rounding``, in the streams of ``state_keys`` (crc32 of their names).
    ``rows_from`` (an update): ids from it on are not applied, each one's summed row is
    written at ``out_rows[id - rows_from]``."""
    n = values.numel()
    num_features = row_base.numel()
    dim = grad_pooled.shape[-1] if feature_major else grad_pooled.shape[1] // num_features
    stride_b, stride_f = (dim, batch * dim) if feature_major else (num_features * dim, dim)
    sorted_ids, order, bag_of = _sorted_runs(values, offsets, row_base, batch, presorted)
    grad_pooled = grad_pooled.contiguous()
    if presorted:  # distinct ids, every run one lookup: no later segment, no partial is read
        partial = grad_pooled.new_empty(1, dim, dtype=torch.float32)
    else:
        partial = _segment_partials(sorted_ids, order, bag_of, offsets, grad_pooled, n, batch, dim, stride_b,
                                    stride_f, mean)
    dummy = sorted_ids  # an unused pointer argument (its OPT never reads it)
    state, state2 = (list(states) + [dummy, dummy])[:2]
    half = NONE if rounding is None else half_code(weight.dtype)
    half_state = NONE if rounding is None or not states else half_code(states[0].dtype)
    row_map = None if rounding is None else rounding.row_map
    rounds = ((weight.view(torch.int16) if half else dummy, seed_hash(rounding.seed), rounding.step,
               rounding.keys, rounding.row_shift, rounding.col0, dummy if row_map is None else row_map)
              if rounding is not None else (dummy, 0, dummy, dummy, dummy, dummy, dummy))
    state_bits = [t.view(torch.int16) if half_state else dummy for t in (state, state2)]
    overflow = rounding.overflow if rounding is not None and half == FP16 else None
    _runs_kernel[(n,)](
        sorted_ids, order, bag_of, offsets, grad_pooled, partial,
        dummy if weight is None else weight, state, state2,
        dummy if lr is None else lr, dummy if step is None else step,
        dummy if out_ids is None else out_ids, dummy if out_rows is None else out_rows,
        n, batch, dim, stride_b, stride_f, eps, 1.0 - betas[0], 1.0 - betas[1],
        math.log(betas[0]) if betas[0] > 0 else 0.0, math.log(betas[1]) if betas[1] > 0 else 0.0,
        *rounds, *state_bits, *state_keys, dummy if overflow is None else overflow, rows_from,
        OPT=opt, MEAN=mean, BLOCK_D=block_d(dim), HALF=half, SHALF=half_state, ROW_MAP=row_map is not None,
        OVERFLOW=overflow is not None,
        num_warps=warps(dim),
    )


def backward_update(
    grad_pooled: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    row_base: torch.Tensor,
    batch: int,
    mean: bool,
    feature_major: bool,
    weight: torch.Tensor,
    optimizer: SparseOptimizer,
    state: dict[str, torch.Tensor],
    lr: torch.Tensor,
    rounding: KernelRounding | None = None,
    rows_by_id: tuple[int, torch.Tensor] | None = None,
    presorted: bool = False,
    count: bool = True,
) -> None:
    """Apply ``optimizer`` to the rows the lookup touched, in place (fused backward).

    ``lr`` [1] and Adam's ``state["step"]`` [1] live on ``weight``'s device. A fp16/bf16
    ``weight`` or element-wise state with ``rounding``: written stochastically rounded
    (its ``step`` already counts this update; each state in its own stream, the table
    key xor crc32 of its name, as the torch path); without: round-to-nearest.

    ``rows_by_id`` (first, out_rows): ids >= first are rows of another store (a static
    Hotline step's staged cold rows, ids H + cold row, static_step.py), sorted with the
    rest (one sort) but not applied: each one's summed gradient is written, fp32, at
    ``out_rows[id - first]``. ``presorted``: the lookups' stacked ids, in lookup order,
    ascending and distinct already (a static Hotline step's staged rows, one each): no
    sort, and no run longer than a segment (no partials).
    ``count`` False: Adam's ``state["step"]`` counted this step already (the staged rows'
    update reads the hot tier's, cold_stage.py)."""
    if values.numel() == 0:
        if isinstance(optimizer, SparseAdam) and count:
            state["step"] += 1  # an empty step still counts, as in the torch path
        return
    opt = optimizer_code(optimizer)
    step = None
    if opt == ADAM:
        if count:
            state["step"] += 1
        step = state["step"]
        names = ["exp_avg", "exp_avg_sq"]
        betas = optimizer.betas
    else:
        names = ["sum"] if opt in (ROWWISE_ADAGRAD, ADAGRAD) else []
        betas = (0.0, 0.0)
    keys = tuple(table_key(name) for name in names) + (0,) * (2 - len(names))
    rows_from, out_rows = rows_by_id if rows_by_id is not None else (OTHER_STACK.value, None)
    _launch_runs(grad_pooled, values, offsets, row_base, batch, mean, feature_major,
                 opt, weight, [state[name] for name in names], lr, step, None, out_rows, optimizer.eps, betas,
                 rounding, keys, rows_from=rows_from, presorted=presorted)


def backward_kv(
    grad_pooled: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    row_base: torch.Tensor,
    batch: int,
    mean: bool,
    feature_major: bool,
) -> KVGradient:
    """The KV gradient of the stacked weight (ids ascending, one row each).

    The kernel writes each run's (id, row) at its head's sorted position, in a
    buffer of N; dropping the other slots is a boolean select, the one host sync of
    this path (the unfused path: replicated tables and gradient accumulation)."""
    n = values.numel()
    dim = grad_pooled.shape[-1] if feature_major else grad_pooled.shape[1] // row_base.numel()
    out_ids = torch.full((n,), -1, dtype=torch.int64, device=values.device)
    out_rows = torch.empty(n, dim, dtype=torch.float32, device=values.device)
    if n:
        _launch_runs(grad_pooled, values, offsets, row_base, batch, mean, feature_major,
                     KV, None, [], None, None, out_ids, out_rows)
    keep = out_ids >= 0
    return KVGradient(out_ids[keep], out_rows[keep])
