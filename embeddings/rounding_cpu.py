"""Stochastic rounding on the CPU in one compiled pass (numba), bit-equal to rounding.py.

The torch recipe (embeddings/rounding.py) spends ~30 passes over the touched rows:
every shift, mask and multiply of the hash is one tensor op, and the int32 stage
still moves [U, D] ints through memory each time. Half tables then trained slower
than fp32 on the CPU (bf16 2,038 against fp32 17,837 samples/s): the rounding cost
more than the halved bytes saved. Here each element is hashed and rounded in
registers, rows in parallel:

    rows [U, D] fp32 ──(seed, step, table key, full row, first column per row)──┐
                                                                               ▼
    per row:      h_r = fmix(fmix(fmix(fmix(seed + 0x9E3779B9) ^ step) ^ table) ^ row)
    per element:  h   = fmix(h_r ^ column);  out = round(x, h)   (one loop, no temporaries)
                                                                               │
    out [U, D] as uint16 (the fp16/bf16 bits) ◄────────────────────────────────┘

Same bits as ``rounding.stochastic_round`` for every input (tests/test_rounding_cpu.py
compares the two on random, tiny, huge, subnormal and non-finite values). numba is
an ordinary dependency on CPU machines; where it is missing (the GPU machine's
image), ``available()`` is False and callers keep the torch recipe.

A kernel compiles at its first call (0.3-2 s each; the update kernel ~1-2 s), and
numba's on-disk cache (``cache=True``) keeps only the kernels without closures
(pool_bags, widen_rows): the rounding kernels close over the inlined helpers, whose
pickled dispatchers carry a per-process id, so their cache key never matches (a miss
in every process). A first call in the middle of training stalls that step: a Hotline
host tier updates no row until its first cold one. ``compile_for`` compiles what a
CPU table will call when it is built (``LocalEmbeddingCollection``), each kernel once
per process, on a tiny input through the same wrapper as a step, so with the same
argument types; the wrappers pass ids and coordinates as contiguous int64, so no
caller brings a type that was not compiled then.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import cache

import numpy as np
import torch

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9


@cache
def available() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


@cache
def _elementwise(to_bf16: bool):
    """Per-element helpers (inlined into the kernels) for one half type: ``to_bf16``
    is a compile-time constant, so each element's loop has no type branch."""
    import numba

    @numba.njit(inline="always")
    def fmix(h):  # h: uint64 holding a uint32
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & M32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & M32
        return h ^ (h >> 16)

    @numba.njit(inline="always")
    def fp16_bits(x, xbits, h):
        exp = (xbits >> 23) & 0xFF
        if exp == 0xFF:  # inf keeps its sign; nan stays nan
            if xbits & 0x7FFFFF:
                return 0x7E00
            return 0xFC00 if x < 0 else 0x7C00
        if exp >= 113:  # |x| >= 2^-14: y = m * 2^-13 with m the 24-bit significand
            m = (xbits & 0x7FFFFF) | 0x800000
            u = np.int64(exp) - 127
            # r < f  <=>  (h >> 8) * 2^-24 < (m mod 2^13) * 2^-13, in integers
            n = np.int64(m >> 13) + (1 if (h >> 8) < ((m & 0x1FFF) << 11) else 0)
        else:  # tiny: |x| * 2^24 is exact in float64, and so are its floor and fraction
            u = -14
            y = abs(np.float64(x)) * 2.0**24
            whole = math.floor(y)
            n = np.int64(whole) + (1 if np.float64(h >> 8) * 2.0**-24 < y - whole else 0)
        if u == -14:  # subnormal binade and the first normal one: the bits are n
            mag = n
        else:  # n in [1024, 2048]: exponent u, mantissa n - 1024 (2048 carries)
            mag = min(((u + 15) << 10) + n - 1024, 0x7C00)
        return mag | 0x8000 if x < 0 else mag

    @numba.njit(inline="always")
    def half_bits(x, xbits, h):  # fp32 x (and its bits) → the rounded half's bits
        if to_bf16:  # the top half of bits(x) + (h & 0xFFFF), wrapping
            return ((xbits + (h & 0xFFFF)) & M32) >> 16
        return fp16_bits(x, xbits, h)

    @numba.njit(inline="always")
    def row_hash(seed_step, table, row):
        return fmix(fmix(seed_step ^ np.uint64(table & M32)) ^ np.uint64(row & M32))

    return fmix, half_bits, row_hash


@cache
def _kernels(to_bf16: bool):
    """The kernels for one half type (the bf16 ones vectorise: no branch per element)."""
    import numba

    fmix, half_bits, row_hash = _elementwise(to_bf16)

    @numba.njit(parallel=True, cache=True)
    def round_rows(x, xbits, out, seed_step, tables, rows, col0):
        count, dim = x.shape
        for i in numba.prange(count):
            h_row = row_hash(seed_step, tables[i], rows[i])
            for c in range(dim):
                out[i, c] = half_bits(x[i, c], np.uint64(xbits[i, c]),
                                      fmix(h_row ^ np.uint64((col0[i] + c) & M32)))

    @numba.njit(parallel=True, cache=True)
    def add_round_rows(weight, ids, old_rows, grad, alpha, seed_step, tables, rows, col0, overflow,
                       threads):
        count, dim = grad.shape
        chunks = min(threads, count)
        for chunk in numba.prange(chunks):
            # fp32 scratch rows, seen as floats and as their bits (numba has no scalar bit cast)
            old_bits = np.empty(dim, dtype=np.uint32)
            new = np.empty(dim, dtype=np.float32)
            old, new_bits = old_bits.view(np.float32), new.view(np.uint32)
            for i in range(chunk * count // chunks, (chunk + 1) * count // chunks):
                row = weight[ids[i]]
                if to_bf16:  # a bf16 is the top half of its fp32
                    for c in range(dim):
                        old_bits[c] = np.uint32(row[c]) << 16
                else:  # fp16 rows arrive widened (torch's vectorised conversion)
                    for c in range(dim):
                        old[c] = old_rows[i, c]
                # torch's add_(alpha=) is one fused multiply-add in fp32: the exact
                # product and sum in float64, then one rounding to fp32, give its bits
                for c in range(dim):
                    new[c] = np.float32(np.float64(old[c]) + np.float64(alpha) * np.float64(grad[i, c]))
                h_row = row_hash(seed_step, tables[i], rows[i])
                for c in range(dim):
                    row[c] = half_bits(new[c], np.uint64(new_bits[c]),
                                       fmix(h_row ^ np.uint64((col0[i] + c) & M32)))
                if not to_bf16:  # (no scalar accumulator here: prange would take it for a reduction)
                    for c in range(dim):
                        if (row[c] & 0x7FFF) == 0x7C00 and math.isfinite(new[c]):
                            overflow[i] = True

    @numba.njit(parallel=True, cache=True)
    def pool_bags(weight, ids, offsets, scale, out, threads):  # bf16 weights
        bags, dim = out.shape
        chunks = min(threads, bags)
        for chunk in numba.prange(chunks):
            bits = np.empty(dim, dtype=np.uint32)
            value = bits.view(np.float32)
            for b in range(chunk * bags // chunks, (chunk + 1) * bags // chunks):
                for c in range(dim):
                    out[b, c] = 0.0
                for j in range(offsets[b], offsets[b + 1]):
                    row = weight[ids[j]]
                    for c in range(dim):
                        bits[c] = np.uint32(row[c]) << 16
                    w = scale[j] if scale.size else np.float32(1.0)
                    for c in range(dim):
                        out[b, c] += value[c] * w

    @numba.njit(parallel=True, cache=True)
    def widen_rows(weight, ids, out_bits):  # bf16 rows → their fp32 bits: a shift, no float math
        count, dim = out_bits.shape
        for i in numba.prange(count):
            row = weight[ids[i]]
            for c in range(dim):
                out_bits[i, c] = np.uint32(row[c]) << 16

    return round_rows, add_round_rows, pool_bags, widen_rows


def _seed_step_hash(seed: int, step: int) -> int:
    """fmix(fmix(seed + GOLDEN) ^ step): the part of the hash shared by every element."""
    def fmix(h: int) -> int:
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & M32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & M32
        return h ^ (h >> 16)

    return fmix(fmix((seed + GOLDEN) & M32) ^ (step & M32))


def stochastic_round_cpu(
    x: torch.Tensor, dtype: torch.dtype, seed: int, step: int,
    tables: torch.Tensor, rows: torch.Tensor, col0: torch.Tensor,
) -> torch.Tensor:
    """``rounding.stochastic_round`` for CPU tensors, compiled: [U, D] fp32 → ``dtype``."""
    round_rows, _, _, _ = _kernels(dtype == torch.bfloat16)
    _match_torch_threads()
    x = x.float().contiguous()
    xs = x.numpy()
    out = np.empty(xs.shape, dtype=np.uint16)
    if xs.size:
        round_rows(xs, xs.view(np.uint32), out, np.uint64(_seed_step_hash(seed, step)),
                   _int64(tables), _int64(rows), _int64(col0))
    return torch.from_numpy(out).view(dtype)


def add_rows_rounded(
    weight: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor, alpha: float,
    seed: int, step: int, tables: torch.Tensor, rows: torch.Tensor, col0: torch.Tensor,
) -> torch.Tensor:
    """``weight[ids] = round(float(weight[ids]) + alpha * grad)`` in place, for a fp16/bf16
    CPU ``weight`` and UNIQUE ``ids``: one pass that reads the half rows, adds, rounds
    and writes them back (the torch path widens, adds, rounds and scatters in ~35 ops).
    Returns [U] bool: rows where a finite fp16 value became inf."""
    bf16 = weight.dtype == torch.bfloat16
    _, add_round_rows, _, _ = _kernels(bf16)
    threads = _match_torch_threads()
    grad = grad.float().contiguous()
    # fp16 → fp32 in the kernel is a branchy bit shuffle or a table gather per element;
    # torch's gather + conversion (F16C) is vectorised, so fp16 rows arrive widened
    old = np.empty((0, 0), np.float32) if bf16 else weight.index_select(0, ids).float().numpy()
    overflow = np.zeros(ids.numel(), dtype=np.bool_)
    if ids.numel():
        add_round_rows(weight.view(torch.uint16).numpy(), _int64(ids), old, grad.numpy(),
                       np.float32(alpha), np.uint64(_seed_step_hash(seed, step)),
                       _int64(tables), _int64(rows), _int64(col0), overflow, threads)
    return torch.from_numpy(overflow)


def pool_bf16_bags(weight: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                   scale: torch.Tensor | None) -> torch.Tensor:
    """[S, D] fp32 sums of the bags ``offsets`` over rows ``ids`` of a bf16 CPU ``weight``
    (times ``scale`` [N] per id if given): the rows widened in registers (a shift) and
    summed in fp32, bag by bag, with no [N, D] fp32 copy of the gathered rows."""
    _, _, pool_bags, _ = _kernels(True)
    threads = _match_torch_threads()
    out = np.empty((offsets.numel() - 1, weight.shape[1]), dtype=np.float32)
    weights = (scale.float().contiguous().numpy() if scale is not None
               else np.empty(0, dtype=np.float32))
    if out.size:
        pool_bags(weight.view(torch.uint16).numpy(), _int64(ids), _int64(offsets), weights, out, threads)
    return torch.from_numpy(out)


def widen_bf16_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``weight[ids].float()`` for a bf16 CPU ``weight`` in one pass (torch gathers, then
    converts through a second [N, D] buffer)."""
    _, _, _, widen_rows = _kernels(True)
    _match_torch_threads()
    out = torch.empty(ids.numel(), weight.shape[1], dtype=torch.float32)
    if out.numel():
        widen_rows(weight.view(torch.uint16).numpy(), _int64(ids), out.view(torch.int32).numpy().view(np.uint32))
    return out


def _int64(index: torch.Tensor) -> np.ndarray:
    """Ids and coordinates as the kernels were compiled for: contiguous int64 (no copy
    when they already are; another type or a strided view would compile anew)."""
    return index.to(torch.int64).contiguous().numpy()


def compile_for(device: torch.device, weight: torch.dtype, states: Iterable[torch.dtype] = ()) -> None:
    """Compile now the kernels a table on ``device`` with ``weight`` rows and optimizer
    state of ``states`` calls in training (lookup, update, half state's rounding), so
    that no step compiles one. Once per process and type; nothing off the CPU or
    without numba."""
    if device.type != "cpu" or not available():
        return
    if weight in (torch.bfloat16, torch.float16):
        _compile_weight(weight)
    for dtype in set(states) & {torch.bfloat16, torch.float16}:
        _compile_state(dtype)


@cache
def _compile_weight(dtype: torch.dtype) -> None:
    """The update of ``dtype`` rows, and for bf16 the lookups (pooled bags, single ids)."""
    weight = torch.zeros(2, 1, dtype=dtype)
    one = torch.zeros(1, dtype=torch.int64)
    add_rows_rounded(weight, one, torch.zeros(1, 1), 1.0, 0, 1, one, one, one)
    if dtype == torch.bfloat16:
        pool_bf16_bags(weight, one, torch.tensor([0, 1]), None)
        widen_bf16_rows(weight, one)


@cache
def _compile_state(dtype: torch.dtype) -> None:
    """The rounding of fp32 rows into a ``dtype`` state tensor (optim.put_state)."""
    one = torch.zeros(1, dtype=torch.int64)
    stochastic_round_cpu(torch.zeros(1, 1), dtype, 0, 1, one, one, one)


def _match_torch_threads() -> int:
    """As many threads as torch's ops use: under torchrun (OMP_NUM_THREADS=1 a rank)
    the ranks sharing the cores do not oversubscribe them."""
    import numba

    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(threads)
    return threads
