"""Stochastic rounding of fp32 values to fp16 / bf16, from a counter-based hash.

A half-precision table's update is computed in fp32 and written back rounded up or
down at random, with P(up) = the distance to the lower neighbour / the spacing, so
the stored value equals the fp32 value in expectation (round-to-nearest would drop
every update smaller than half a spacing: small learning rates stop bf16 weights).

The random bits of element (row, column) of a table at an update step are a pure
function of (seed, step, table, row, column), with row and column those of the FULL
table (a shard adds its first row / column): 1, 2 or 3 ranks round alike.

Hash (all values unsigned 32-bit; in torch int64 masked with 0xFFFFFFFF; a Triton
kernel uses uint32 with wrapping multiplies and gets the same bits):

    fmix(h):  h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13; h *= 0xC2B2AE35; h ^= h >> 16
    h = fmix(seed + 0x9E3779B9)        (seed mod 2^32)
    h = fmix(h ^ step)                 (the table's update count, from 1)
    h = fmix(h ^ table)                (table_key(name): zlib.crc32 of the name)
    h = fmix(h ^ row)                  (row mod 2^32)
    h = fmix(h ^ column)

Rounding with those bits h, x an fp32 value:

    bf16:  bits(x) + (h & 0xFFFF), then clear the low 16 bits (bf16 is the top half
           of fp32, so this is exact everywhere, subnormals and the carry into the
           next exponent included).
    fp16:  u = max(exponent(x), -14); q = 2^(u - 10) (the fp16 spacing at x);
           y = |x| / q (exact, power of two); f = y - floor(y) (exact);
           r = (h >> 8) * 2^-24 (exact); |out| = (floor(y) + (r < f)) * q;
           out = sign(x) * |out| cast to fp16 (exact; beyond 65504 it is inf, as
           round-to-nearest gives for such values).

q and 1/q are built from their exponent bits ((e + 127) << 23), never with pow.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from embeddings import rounding_cpu

MASK32 = 0xFFFFFFFF
HALF_TYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def weight_dtype(name: str) -> torch.dtype:
    """``fp32`` / ``fp16`` / ``bf16`` (fbgemm's SparseType names) → torch dtype."""
    return HALF_TYPES[name]


def table_key(name: str) -> int:
    return zlib.crc32(name.encode())


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2^32 for a in [0, 2^32): two products below 2^48, no int64 overflow."""
    lo = a * (c & 0xFFFF)
    hi = ((a * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser on int64 tensors holding unsigned 32-bit values."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _signed32(c: int) -> int:
    """The int32 holding the bits of unsigned ``c``."""
    return c - (1 << 32) if c >= 1 << 31 else c


def fmix32_int32(h: torch.Tensor) -> torch.Tensor:
    """``fmix32`` on int32 tensors holding the bits of uint32 values: multiplies wrap,
    right shifts are made logical by a mask. Same bits, half the bytes of int64."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _signed32(0x85EBCA6B)
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * _signed32(0xC2B2AE35)
    return h ^ ((h >> 16) & 0xFFFF)


def random_bits(seed: int, step: int, tables: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """[U, D] hash values, int64 in [0, 2^32): ``tables`` and ``rows`` [U] (keys,
    full-table rows), ``cols`` [U, D] or [D]."""
    return element_bits(seed, step, tables, rows, cols).to(torch.int64) & MASK32


def element_bits(seed: int, step: int, tables: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``random_bits`` as int32 tensors holding the uint32 bits (the per-element stage
    in int32: the bulk of the work)."""
    h = fmix32(torch.tensor((seed + 0x9E3779B9) & MASK32, dtype=torch.int64))
    h = fmix32(h ^ (step & MASK32))
    h = fmix32(h ^ (tables & MASK32))
    h = fmix32(h ^ (rows & MASK32))
    h32 = (h - ((h >> 31) << 32)).to(torch.int32)
    c32 = cols & MASK32
    c32 = (c32 - ((c32 >> 31) << 32)).to(torch.int32)
    return fmix32_int32(h32.unsqueeze(-1) ^ c32)


def _exp_bits(e: torch.Tensor) -> torch.Tensor:
    """2.0 ** e for integer tensors e in [-126, 127], exactly (from the bits)."""
    return ((e + 127) << 23).to(torch.int32).view(torch.float32)


def round_with(x: torch.Tensor, bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``x`` rounded stochastically to ``dtype`` with hash values ``bits`` (see above;
    int32 or int64 tensors holding the uint32 bits)."""
    if dtype == torch.float32:
        return x
    x = x.float().contiguous()
    if dtype == torch.bfloat16:
        # int32 add wraps; the mask keeps the top 16 bits (-65536 is 0xFFFF0000)
        out = (x.view(torch.int32) + (bits & 0xFFFF).to(torch.int32)) & -65536
        return out.view(torch.float32).to(torch.bfloat16)
    if dtype != torch.float16:
        raise ValueError(f"no stochastic rounding to {dtype}")
    u = (((x.view(torch.int32) >> 23) & 0xFF) - 127).clamp(min=-14)
    y = x.abs() * _exp_bits(10 - u)
    whole = y.floor()
    r = ((bits >> 8) & 0xFFFFFF).to(torch.float32) * 2.0**-24
    mag = (whole + (r < y - whole).to(torch.float32)) * _exp_bits(u - 10)
    return torch.where(x < 0, -mag, mag).to(torch.float16)


def stochastic_round(
    x: torch.Tensor, dtype: torch.dtype, seed: int, step: int,
    tables: torch.Tensor, rows: torch.Tensor, col0: torch.Tensor, compiled: bool = True,
) -> torch.Tensor:
    """[U, D] fp32 rows → ``dtype``; row i is row ``rows[i]`` of table ``tables[i]`` (keys),
    its columns start at ``col0[i]`` of the full table. On the CPU the same bits come
    from one compiled pass (embeddings/rounding_cpu.py) unless ``compiled=False``."""
    if dtype == torch.float32:
        return x
    if compiled and x.device.type == "cpu" and rounding_cpu.available():
        return rounding_cpu.stochastic_round_cpu(x, dtype, seed, step, tables, rows, col0)
    cols = col0.unsqueeze(1) + torch.arange(x.shape[1], device=x.device)
    return round_with(x, element_bits(seed, step, tables, rows, cols), dtype)


@dataclass
class RowRounding:
    """Where the rows an update writes sit in their full tables: the hash's coordinates
    (``tables`` keys, full-table ``rows``, first column ``col0``; each [U]) and the
    update step. ``overflow`` is filled by a fp16 write: [U] bool, the rows where a
    finite value became inf."""

    dtype: torch.dtype
    seed: int
    step: int
    tables: torch.Tensor
    rows: torch.Tensor
    col0: torch.Tensor
    overflow: torch.Tensor | None = None


def add_rows_rounded(weight: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, alpha: float,
                     at: RowRounding) -> None:
    """``weight[ids] += alpha * rows`` for a fp16/bf16 ``weight`` and UNIQUE ``ids``: the
    sum in fp32, written back stochastically rounded. On the CPU one compiled pass
    (rounding_cpu.add_rows_rounded); elsewhere gather, add, round, scatter (same bits)."""
    if weight.device.type == "cpu" and rounding_cpu.available():
        at.overflow = rounding_cpu.add_rows_rounded(weight, ids, rows, alpha, at.seed, at.step,
                                                    at.tables, at.rows, at.col0)
        return
    new = weight.index_select(0, ids).float().add_(rows, alpha=alpha)
    out = stochastic_round(new, weight.dtype, at.seed, at.step, at.tables, at.rows, at.col0,
                           compiled=False)
    if weight.dtype == torch.float16:
        at.overflow = (torch.isinf(out) & torch.isfinite(new)).any(dim=1)
    weight.index_copy_(0, ids, out)
