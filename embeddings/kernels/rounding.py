"""Stochastic rounding of fp32 rows to fp16 / bf16 inside a Triton kernel.

The recipe is embeddings/rounding.py's, bit for bit (its docstring gives it), in
uint32 arithmetic, which wraps and shifts logically as the recipe wants:

    h_seed_step = fmix(fmix(seed + 0x9E3779B9) ^ step)     host part, then step read
                                                            from the device (graphs)
    h_row       = fmix(fmix(h_seed_step ^ table) ^ row)     per run (one table row)
    h           = fmix(h_row ^ column)                      per element, in registers

    bf16:  (bits(x) + (h & 0xFFFF)) >> 16
    fp16:  |x| >= 2^-14:  m = 24-bit significand; n = (m >> 13) + ((h >> 8) < (m & 0x1FFF) << 11)
                          bits = min(((exponent + 15) << 10) + n - 1024, 0x7C00)
           |x| <  2^-14:  y = |x| * 2^24 (exact); n = floor(y) + ((h >> 8) * 2^-24 < y - floor(y))
                          bits = n
           inf / nan kept; the sign bit set when x < 0

The rounded values are written as int16 bits (through an int16 view of the weight),
so no kernel needs a bf16 store. ``stochastic_round_triton`` runs the recipe alone
over [U, D] rows: the tests hold it against the torch recipe, bits equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from embeddings.kernels.pooled import block_d, warps

NONE, BF16, FP16 = 0, 1, 2  # the HALF constexpr of a kernel that writes rounded rows


def half_code(dtype: torch.dtype) -> int:
    return {torch.float32: NONE, torch.bfloat16: BF16, torch.float16: FP16}[dtype]


def seed_hash(seed: int) -> int:
    """fmix(seed + 0x9E3779B9) on the host: the part of the hash a run never changes."""
    h = (seed + 0x9E3779B9) & 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


@dataclass
class KernelRounding:
    """What a fused update needs to round a half weight's rows: the seed's hash, the
    update count on the device ([1] int64, incremented before the launch) and, per
    feature of the batch, its table's key, the shift from stacked row to full-table
    row, and the table's first column (all [F] int64 on the device).

    ``overflow`` ([F] int32, optional): an fp16 weight's update adds there, per feature,
    the finite values it rounded to inf (the host reads it where it waits anyway).
    ``row_map`` [rows] int64 (a Hotline hot tier): the full-table row of each row of the
    weight, used instead of ``row_shift``; a hot slot's row is ``ids[slot]`` minus its
    table's start, no per-feature shift of the slot."""

    seed: int
    step: torch.Tensor
    keys: torch.Tensor
    row_shift: torch.Tensor
    col0: torch.Tensor
    # keyword-only: two optional tensors of one type, never confused by position
    overflow: torch.Tensor | None = field(default=None, kw_only=True)
    row_map: torch.Tensor | None = field(default=None, kw_only=True)


@triton.jit
def fmix32(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def row_hash(seed_h, step, key, row):
    """The hash of (seed, step, table key, full-table row) as uint32."""
    h = fmix32(seed_h.to(tl.uint32) ^ step.to(tl.uint32))
    h = fmix32(h ^ key.to(tl.uint32))
    return fmix32(h ^ row.to(tl.uint32))


@triton.jit
def rounded_bits(x, h, HALF: tl.constexpr):
    """fp32 ``x`` and per-element hashes ``h`` (uint32) → the rounded value's int16 bits."""
    xb = x.to(tl.uint32, bitcast=True)
    if HALF == 1:
        out = (xb + (h & 0xFFFF)) >> 16
    else:
        exp = ((xb >> 23) & 0xFF).to(tl.int32)
        m = (xb & 0x7FFFFF) | 0x800000
        n_big = ((m >> 13) + ((h >> 8) < ((m & 0x1FFF) << 11)).to(tl.uint32)).to(tl.int32)
        big = tl.minimum(((exp - 112) << 10) + n_big - 1024, 0x7C00)
        y = tl.where(exp < 113, tl.abs(x), 0.0) * 16777216.0  # (0: no inf/nan in the unused lanes)
        whole = tl.floor(y)
        r = (h >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2^-24
        tiny = whole.to(tl.int32) + (r < y - whole).to(tl.int32)
        mag = tl.where(exp >= 113, big, tiny)
        special = tl.where((xb & 0x7FFFFF) != 0, 0x7E00, 0x7C00)
        mag = tl.where(exp == 255, special, mag)
        out = tl.where(x < 0, mag | 0x8000, mag).to(tl.uint32)
    return out.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _round_kernel(x_ptr, out_ptr, keys_ptr, rows_ptr, col0_ptr, step_ptr, seed_h, dim,
                  HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    in_row = cols < dim
    x = tl.load(x_ptr + i.to(tl.int64) * dim + cols, mask=in_row, other=0.0)
    h_row = row_hash(seed_h, tl.load(step_ptr), tl.load(keys_ptr + i), tl.load(rows_ptr + i))
    h = fmix32(h_row ^ (tl.load(col0_ptr + i) + cols).to(tl.uint32))
    tl.store(out_ptr + i.to(tl.int64) * dim + cols, rounded_bits(x, h, HALF), mask=in_row)


def stochastic_round_triton(
    x: torch.Tensor, dtype: torch.dtype, seed: int, step: int,
    tables: torch.Tensor, rows: torch.Tensor, col0: torch.Tensor,
) -> torch.Tensor:
    """``embeddings.rounding.stochastic_round`` by the Triton recipe: [U, D] → ``dtype``."""
    x = x.float().contiguous()
    count, dim = x.shape
    out = torch.empty(count, dim, dtype=torch.int16, device=x.device)
    if count:
        step_t = torch.tensor([step], dtype=torch.int64, device=x.device)
        _round_kernel[(count,)](x, out, tables, rows, col0, step_t, seed_hash(seed), dim,
                                HALF=half_code(dtype), BLOCK_D=block_d(dim), num_warps=warps(dim))
    return out.view(dtype)
