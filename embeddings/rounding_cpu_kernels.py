"""The numba kernels behind rounding_cpu.py: half rows rounded, updated, pooled, widened.

Everything a kernel calls is a module global, and each rounding kernel's closure holds
only the bool ``to_bf16``, because numba's disk cache (``cache=True``) keys a kernel by
its bytecode and, for a closure, the pickle of what the closure holds: a jitted helper
held there pickles with a per-process id, so such a kernel missed the cache in every
process and compiled anew (1-3 s a type). A bool pickles alike in every process, so a
second process with the same cache dir (``NUMBA_CACHE_DIR``, else ``__pycache__`` here)
loads every kernel (tests/test_rounding_cpu.py checks it). The helpers are inlined when
a kernel compiles, so the cache would not see an edit to them from the kernel's bytecode;
it sees it from the stamp of this file (mtime and size), which drops every kernel's
entry: keep the helpers in this file.

Importing this module does not need numba (an image without it): then the
functions stay plain Python, and nothing calls them (``rounding_cpu.available()``).
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np

try:
    import numba
except ImportError:  # rounding_cpu.available() is False: callers take the torch recipe
    numba = None

M32 = 0xFFFFFFFF


def _njit(**options):
    """``numba.njit(**options)``; without numba, the function as it is (never called)."""
    if numba is None:
        return lambda function: function
    return numba.njit(**options)


@_njit(inline="always")
def fmix(h):  # h: uint64 holding a uint32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


@_njit(inline="always")
def row_hash(seed_step, table, row):
    return fmix(fmix(seed_step ^ np.uint64(table & M32)) ^ np.uint64(row & M32))


@_njit(inline="always")
def bf16_bits(xbits, h):  # the top half of bits(x) + (h & 0xFFFF), wrapping
    return ((xbits + (h & 0xFFFF)) & M32) >> 16


@_njit(inline="always")
def fp16_bits(x, xbits, h):  # fp32 x (and its bits) → the rounded fp16's bits
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


@cache
def rounding_kernels(to_bf16: bool):
    """round_rows and add_round_rows for one half type: ``to_bf16`` is a compile-time
    constant (a closure variable), so each element's loop has no type branch and the
    bf16 ones vectorise."""

    @_njit(parallel=True, cache=True)
    def round_rows(x, xbits, out, seed_step, tables, rows, col0):
        count, dim = x.shape
        for i in numba.prange(count):
            h_row = row_hash(seed_step, tables[i], rows[i])
            for c in range(dim):
                h = fmix(h_row ^ np.uint64((col0[i] + c) & M32))
                if to_bf16:
                    out[i, c] = bf16_bits(np.uint64(xbits[i, c]), h)
                else:
                    out[i, c] = fp16_bits(x[i, c], np.uint64(xbits[i, c]), h)

    @_njit(parallel=True, cache=True)
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
                    h = fmix(h_row ^ np.uint64((col0[i] + c) & M32))
                    if to_bf16:
                        row[c] = bf16_bits(np.uint64(new_bits[c]), h)
                    else:
                        row[c] = fp16_bits(new[c], np.uint64(new_bits[c]), h)
                if not to_bf16:  # (no scalar accumulator here: prange would take it for a reduction)
                    for c in range(dim):
                        if (row[c] & 0x7FFF) == 0x7C00 and math.isfinite(new[c]):
                            overflow[i] = True

    return round_rows, add_round_rows


@_njit(parallel=True, cache=True)
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


@_njit(parallel=True, cache=True)
def widen_rows(weight, ids, out_bits):  # bf16 rows → their fp32 bits: a shift, no float math
    count, dim = out_bits.shape
    for i in numba.prange(count):
        row = weight[ids[i]]
        for c in range(dim):
            out_bits[i, c] = np.uint32(row[c]) << 16
