"""The numba kernels behind rounding_cpu.py: half rows rounded, updated, pooled, widened.

Rows are read at random (a step's ids over millions of rows), so a kernel waits on
memory, not arithmetic: each asks for the row ``AHEAD`` lookups on before it works on
this one (``prefetch_row``, LLVM's prefetch), so several misses are in flight at once.
A bf16 update of a bench step's 27k distinct rows took 4.4 ms on one core without it,
1.8 with it. fp16 rows are widened in registers too (``widen_fp16``: exact for all
65,536 values, in integer and float operations that vectorise), so no kernel takes a
torch-widened [N, D] fp32 copy of them.

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
    from llvmlite import ir
    from numba.core import cgutils
    from numba.extending import intrinsic
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


# lookups ahead whose rows are asked for: 4 and 16 took the same time (a bench step's
# rows: 27k distinct of 5.2M), 0 took 2.4x as long
AHEAD = 8
LINE = 64  # bytes of a cache line


if numba is not None:
    @intrinsic
    def _prefetch(typingctx, array, row, col):
        """``llvm.prefetch`` of ``&array[row, col]`` (a read, kept in every cache level):
        a hint, nothing waits for it."""
        def codegen(context, builder, signature, args):
            array_type = signature.args[0]
            view = context.make_array(array_type)(context, builder, args[0])
            pointer = cgutils.get_item_pointer(context, builder, array_type, view, [args[1], args[2]],
                                               wraparound=False)
            byte = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            function = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [byte, i32, i32, i32]), "llvm.prefetch.p0i8")
            builder.call(function, [builder.bitcast(pointer, byte), ir.Constant(i32, 0), ir.Constant(i32, 3),
                                    ir.Constant(i32, 1)])
            return context.get_dummy_value()

        return numba.types.void(array, row, col), codegen
else:
    def _prefetch(array, row, col):  # never called without numba
        pass


@_njit(inline="always")
def prefetch_row(weight, row):
    """Ask for every cache line of ``weight[row]``."""
    step = max(1, LINE // weight.itemsize)
    for c in range(0, weight.shape[1], step):
        _prefetch(weight, row, c)


@_njit(inline="always")
def widen_fp16(row, out_bits, out):
    """fp16 bits ``row`` → fp32 in ``out`` (``out_bits`` its bits), exactly (NaNs stay
    NaNs, their payload kept). Normal values, infinities and NaNs move the exponent:
    the bits shifted, the bias added. Zeros and subnormals (m x 2^-24) are made in
    floats, exactly. Both loops branch per element on values alone: they vectorise."""
    for c in range(row.shape[0]):
        h = np.uint32(row[c])
        magnitude = h & 0x7FFF
        bias = 0x70000000 if magnitude >= 0x7C00 else 0x38000000  # (255 - 31) or (127 - 15) << 23
        out_bits[c] = np.uint32(((magnitude << 13) + bias) | ((h & 0x8000) << 16))
    for c in range(row.shape[0]):
        h = row[c]
        magnitude = h & 0x7FFF
        if magnitude < 0x400:
            value = np.float32(magnitude) * np.float32(2.0**-24)
            out[c] = -value if h & 0x8000 else value


@_njit(inline="always")
def widen(row, out_bits, out, to_bf16):
    """Half bits ``row`` → fp32 ``out`` (``out_bits`` its bits): a bf16 is the top half
    of its fp32; fp16 through ``widen_fp16``."""
    if to_bf16:
        for c in range(row.shape[0]):
            out_bits[c] = np.uint32(row[c]) << 16
    else:
        widen_fp16(row, out_bits, out)


@cache
def rounding_kernels(to_bf16: bool):
    """round_rows, add_round_rows, pool_bags and widen_rows for one half type: ``to_bf16``
    is a compile-time constant (a closure variable), so each element's loop has no type
    branch and the bf16 ones vectorise."""

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
    def add_round_rows(weight, ids, grad, alpha, seed_step, tables, rows, col0, overflow, threads):
        count, dim = grad.shape
        chunks = min(threads, count)
        for chunk in numba.prange(chunks):
            # fp32 scratch rows, seen as floats and as their bits (numba has no scalar bit cast)
            old_bits = np.empty(dim, dtype=np.uint32)
            new = np.empty(dim, dtype=np.float32)
            old, new_bits = old_bits.view(np.float32), new.view(np.uint32)
            end = (chunk + 1) * count // chunks
            for i in range(chunk * count // chunks, end):
                if i + AHEAD < end:
                    prefetch_row(weight, ids[i + AHEAD])
                row = weight[ids[i]]
                widen(row, old_bits, old, to_bf16)
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

    @_njit(parallel=True, cache=True)
    def pool_bags(weight, ids, offsets, scale, out, threads):
        bags, dim = out.shape
        chunks = min(threads, bags)
        for chunk in numba.prange(chunks):
            bits = np.empty(dim, dtype=np.uint32)
            value = bits.view(np.float32)
            first, end = chunk * bags // chunks, (chunk + 1) * bags // chunks
            last = offsets[end]  # the chunk's lookups: ids[offsets[first]:last]
            for b in range(first, end):
                for c in range(dim):
                    out[b, c] = 0.0
                for j in range(offsets[b], offsets[b + 1]):
                    if j + AHEAD < last:
                        prefetch_row(weight, ids[j + AHEAD])
                    widen(weight[ids[j]], bits, value, to_bf16)
                    w = scale[j] if scale.size else np.float32(1.0)
                    for c in range(dim):
                        out[b, c] += value[c] * w

    @_njit(parallel=True, cache=True)
    def widen_rows(weight, ids, out, threads):
        count = out.shape[0]
        out_bits = out.view(np.uint32)
        chunks = min(threads, count)
        for chunk in numba.prange(chunks):
            end = (chunk + 1) * count // chunks
            for i in range(chunk * count // chunks, end):
                if i + AHEAD < end:
                    prefetch_row(weight, ids[i + AHEAD])
                widen(weight[ids[i]], out_bits[i], out[i], to_bf16)

    return round_rows, add_round_rows, pool_bags, widen_rows
