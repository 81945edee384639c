"""The numba kernels behind rounding_cpu.py: half rows rounded, updated, pooled, widened.

Rows are read at random (a step's ids over millions of rows), so a kernel waits on
memory, not arithmetic: each asks for the row ``AHEAD`` lookups on before it works on
this one (``prefetch_row``, LLVM's prefetch), so several misses are in flight at once.
Reading, adding to and writing back a bench step's 27k distinct fp16 rows (of 5.2M; no
rounding) took 4.4 ms on one core without it, 1.8 with it. fp16 rows are widened in
registers too (``half_to_float``: exact for all 65,536 values, in integer and float
operations that vectorise), so no kernel takes a torch-widened [N, D] fp32 copy of them.
The per-element hash and rounding are LLVM IR (numba ``intrinsic``s) in 32-bit lanes.

Everything a kernel calls (helpers, intrinsics) is a module global, and each kernel's
closure holds only the bool ``to_bf16``, because numba's disk cache (``cache=True``)
keys a kernel by its bytecode and, for a closure, the pickle of what the closure holds:
a jitted helper held there pickles with a per-process id, so such a kernel missed the
cache in every process and compiled anew (1-3 s a type). A bool pickles alike in every
process, so a second process with the same cache dir (``NUMBA_CACHE_DIR``, else
``__pycache__`` here) loads every kernel (tests/test_rounding_cpu.py checks it). The helpers are inlined when
a kernel compiles, so the cache would not see an edit to them from the kernel's bytecode;
it sees it from the stamp of this file (mtime and size), which drops every kernel's
entry: keep the helpers in this file.

Importing this module does not need numba (an image without it): then the
functions stay plain Python, and nothing calls them (``rounding_cpu.available()``).
"""

from __future__ import annotations

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
# lookups ahead whose rows are asked for: 4 and 16 took the same time (a bench step's
# rows: 27k distinct of 5.2M), 0 took 2.4x as long
AHEAD = 8
LINE = 64  # bytes of a cache line


def _njit(**options):
    """``numba.njit(**options)``; without numba, the function as it is (never called)."""
    if numba is None:
        return lambda function: function
    return numba.njit(**options)


if numba is not None:
    I32 = ir.IntType(32)

    def _u32(value: int) -> ir.Constant:
        return ir.Constant(I32, value)

    def _fmix_ir(builder, h):
        """murmur3's fmix32 as 32-bit LLVM operations."""
        h = builder.xor(h, builder.lshr(h, _u32(16)))
        h = builder.mul(h, _u32(0x85EBCA6B))
        h = builder.xor(h, builder.lshr(h, _u32(13)))
        h = builder.mul(h, _u32(0xC2B2AE35))
        return builder.xor(h, builder.lshr(h, _u32(16)))

    # The per-element hash and rounding are written as LLVM IR: numba widens every
    # uint32 operation to 64 bits, so its loops ran 8 lanes of 64-bit multiplies where
    # these run 16 of 32 (an fp16 rounding of 27k x 64 values: 2.1 ms on one core in
    # numba's integers, 1.0 here; the same bits: tests/test_rounding_cpu.py).
    @intrinsic
    def element_hash(typingctx, h_row, col):
        """fmix32(h_row ^ col): an element's 32 random bits from its row's and column's
        (and a row's from its table's and row number: ``row_hash``)."""
        def codegen(context, builder, signature, args):
            return _fmix_ir(builder, builder.xor(args[0], args[1]))

        return numba.types.uint32(numba.types.uint32, numba.types.uint32), codegen

    @intrinsic
    def bf16_round(typingctx, xbits, h):
        """The bf16 bits of fp32 ``xbits`` rounded with hash ``h``: the top half of
        xbits + (h & 0xFFFF), wrapping (an infinity stays one, a NaN a NaN)."""
        def codegen(context, builder, signature, args):
            xbits, h = args
            summed = builder.add(xbits, builder.and_(h, _u32(0xFFFF)))
            return builder.trunc(builder.lshr(summed, _u32(16)), ir.IntType(16))

        return numba.types.uint16(numba.types.uint32, numba.types.uint32), codegen

    @intrinsic
    def fp16_round(typingctx, xbits, h):
        """The fp16 bits of fp32 ``xbits`` rounded with hash ``h``, as rounding.round_with:

            |x| >= 2^-14: m = the 24-bit significand; up iff (h >> 8) * 2^-24 < (m mod 2^13)
                          * 2^-13, i.e. iff (h >> 19) < m mod 2^13: adding 0x1FFF - (h >> 19)
                          below the 13 dropped bits carries exactly then (into the exponent
                          too: a carry out of the significand is the next binade's first
                          value), and past 65504 the result is an infinity
            |x| <  2^-14: y = |x| * 2^24 (exact, < 1024): floor(y) + ((h >> 8) * 2^-24 <
                          y - floor(y)), all exact in fp32; the bits are that count
            infinities keep their sign, NaNs are 0x7E00; a sign only where x < 0
        """
        def codegen(context, builder, signature, args):
            xbits, h = args
            f32 = ir.FloatType()
            magnitude = builder.and_(xbits, _u32(0x7FFFFFFF))
            carried = builder.add(magnitude, builder.sub(_u32(0x1FFF), builder.lshr(h, _u32(19))))
            normal = builder.sub(builder.lshr(carried, _u32(13)), _u32(112 << 10))
            normal = builder.select(builder.icmp_unsigned("<", normal, _u32(0x7C00)), normal, _u32(0x7C00))
            y = builder.fmul(builder.bitcast(magnitude, f32), ir.Constant(f32, 2.0**24))
            whole = builder.call(builder.module.declare_intrinsic("llvm.floor", [f32]), [y])
            r = builder.fmul(builder.uitofp(builder.lshr(h, _u32(8)), f32), ir.Constant(f32, 2.0**-24))
            up = builder.fcmp_ordered("<", r, builder.fsub(y, whole))
            tiny = builder.add(builder.fptoui(whole, I32), builder.zext(up, I32))
            small = builder.icmp_unsigned("<", magnitude, _u32(113 << 23))
            bits = builder.select(small, tiny, normal)
            negative = builder.and_(builder.icmp_unsigned(">=", xbits, _u32(0x80000000)),
                                    builder.icmp_unsigned("!=", magnitude, _u32(0)))
            bits = builder.or_(bits, builder.select(negative, _u32(0x8000), _u32(0)))
            infinite = builder.icmp_unsigned("==", magnitude, _u32(0x7F800000))
            bits = builder.select(infinite, builder.select(negative, _u32(0xFC00), _u32(0x7C00)), bits)
            bits = builder.select(builder.icmp_unsigned(">", magnitude, _u32(0x7F800000)), _u32(0x7E00), bits)
            return builder.trunc(bits, ir.IntType(16))

        return numba.types.uint16(numba.types.uint32, numba.types.uint32), codegen

    @intrinsic
    def fused_multiply_add(typingctx, a, b, c):
        """a * b + c in fp32 with one rounding (``llvm.fma``: the FMA instruction where
        the CPU has one, as torch's vectorised ``add_(alpha=)`` uses)."""
        def codegen(context, builder, signature, args):
            fma = builder.module.declare_intrinsic("llvm.fma", [ir.FloatType()] * 3)
            return builder.call(fma, list(args))

        f32 = numba.types.float32
        return f32(f32, f32, f32), codegen

    @intrinsic
    def float_bits(typingctx, value):
        """The bits of an fp32 as a uint32 (a bit cast, no conversion)."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], I32)

        return numba.types.uint32(numba.types.float32), codegen

    @intrinsic
    def bits_float(typingctx, bits):
        """The fp32 whose bits are uint32 ``bits``."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())

        return numba.types.float32(numba.types.uint32), codegen

    @intrinsic
    def prefetch_line(typingctx, array, row, col):
        """``llvm.prefetch`` of ``&array[row, col]`` (a read, kept in every cache level):
        a hint, nothing waits for it."""
        def codegen(context, builder, signature, args):
            array_type = signature.args[0]
            view = context.make_array(array_type)(context, builder, args[0])
            pointer = cgutils.get_item_pointer(context, builder, array_type, view, [args[1], args[2]],
                                               wraparound=False)
            byte = ir.IntType(8).as_pointer()
            function = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [byte, I32, I32, I32]), "llvm.prefetch.p0i8")
            builder.call(function, [builder.bitcast(pointer, byte), _u32(0), _u32(3), _u32(1)])
            return context.get_dummy_value()

        return numba.types.void(array, row, col), codegen
else:  # never called without numba (rounding_cpu.available() is False)
    element_hash = bf16_round = fp16_round = fused_multiply_add = float_bits = bits_float = prefetch_line = None


@_njit(inline="always")
def row_hash(seed_step, table, row):
    """fmix(fmix(seed_step ^ table) ^ row), each mod 2^32: the bits a row's elements
    start from (``element_hash`` twice; ``seed_step`` holds a uint32)."""
    return element_hash(element_hash(np.uint32(seed_step), np.uint32(table & M32)), np.uint32(row & M32))


@_njit(inline="always")
def prefetch_row(weight, row):
    """Ask for every cache line of ``weight[row]``."""
    step = max(1, LINE // weight.itemsize)
    for c in range(0, weight.shape[1], step):
        prefetch_line(weight, row, c)


@_njit(inline="always")
def row_ahead(weight, ids, i, end):
    """``weight[ids[i]]``, the row of ``ids[i + AHEAD]`` asked for first (below ``end``)."""
    if i + AHEAD < end:
        prefetch_row(weight, ids[i + AHEAD])
    return weight[ids[i]]


@_njit(inline="always")
def chunk_bounds(chunk, chunks, count):
    """Items [start, end) of ``chunk`` of ``chunks`` near-equal parts of ``count``."""
    return chunk * count // chunks, (chunk + 1) * count // chunks


@_njit(inline="always")
def half_to_float(bits, to_bf16):
    """The fp32 value of half ``bits`` (uint16), exactly (a NaN stays a NaN). A bf16 is
    the top half of its fp32. An fp16's normal values, infinities and NaNs move the
    exponent (bits shifted, bias added); zeros and subnormals (m x 2^-24) are made in
    floats. Selects on values, no branch: the element loops vectorise."""
    h = np.uint32(bits)
    if to_bf16:
        return bits_float(np.uint32(h << 16))
    magnitude = np.uint32(h & 0x7FFF)
    bias = np.uint32(0x70000000) if magnitude >= 0x7C00 else np.uint32(0x38000000)  # (255-31), (127-15) << 23
    sign = np.uint32((h & 0x8000) << 16)
    normal = bits_float(np.uint32(np.uint32(np.uint32(magnitude << 13) + bias) | sign))
    tiny = np.float32(np.int32(magnitude)) * np.float32(2.0**-24)
    tiny = -tiny if sign else tiny
    return tiny if magnitude < 0x400 else normal


@cache
def rounding_kernels(to_bf16: bool):
    """round_rows, add_round_rows, pool_bags and widen_rows for one half type: ``to_bf16``
    is a compile-time constant (a closure variable), so each element's loop has no type
    branch and vectorises."""

    @_njit(parallel=True, cache=True)
    def round_rows(xbits, out, seed_step, tables, rows, col0):
        count, dim = xbits.shape
        for i in numba.prange(count):
            h_row, c0 = row_hash(seed_step, tables[i], rows[i]), col0[i]
            for c in range(dim):
                h = element_hash(h_row, np.uint32((c0 + c) & M32))
                out[i, c] = bf16_round(xbits[i, c], h) if to_bf16 else fp16_round(xbits[i, c], h)

    @_njit(parallel=True, cache=True)
    def add_round_rows(weight, ids, grad, alpha, seed_step, tables, rows, col0, overflow, threads):
        count, dim = grad.shape
        chunks = min(threads, count)
        for chunk in numba.prange(chunks):
            start, end = chunk_bounds(chunk, chunks, count)
            for i in range(start, end):
                row = row_ahead(weight, ids, i, end)
                h_row, c0 = row_hash(seed_step, tables[i], rows[i]), col0[i]
                made_inf = 0  # fp16: values finite in fp32 that rounded to an infinity
                for c in range(dim):
                    # torch's add_(alpha=) is one fused multiply-add in fp32
                    value = fused_multiply_add(alpha, grad[i, c], half_to_float(row[c], to_bf16))
                    h = element_hash(h_row, np.uint32((c0 + c) & M32))
                    if to_bf16:
                        row[c] = bf16_round(float_bits(value), h)
                    else:
                        rounded = fp16_round(float_bits(value), h)
                        row[c] = rounded
                        made_inf |= ((rounded & 0x7FFF) == 0x7C00) & (abs(value) < np.inf)
                if made_inf:
                    overflow[i] = True

    @_njit(parallel=True, cache=True)
    def pool_bags(weight, ids, offsets, scale, out, threads):
        bags, dim = out.shape
        chunks = min(threads, bags)
        for chunk in numba.prange(chunks):
            first, end = chunk_bounds(chunk, chunks, bags)
            last = offsets[end]  # the chunk's lookups: ids[offsets[first]:last]
            for b in range(first, end):
                for c in range(dim):
                    out[b, c] = 0.0
                for j in range(offsets[b], offsets[b + 1]):
                    row = row_ahead(weight, ids, j, last)
                    w = scale[j] if scale.size else np.float32(1.0)
                    for c in range(dim):
                        out[b, c] += half_to_float(row[c], to_bf16) * w

    @_njit(parallel=True, cache=True)
    def widen_rows(weight, ids, out, threads):
        count, dim = out.shape
        chunks = min(threads, count)
        for chunk in numba.prange(chunks):
            start, end = chunk_bounds(chunk, chunks, count)
            for i in range(start, end):
                row = row_ahead(weight, ids, i, end)
                for c in range(dim):
                    out[i, c] = half_to_float(row[c], to_bf16)

    return round_rows, add_round_rows, pool_bags, widen_rows
