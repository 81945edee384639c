"""Int8 row-wise tables: each row its own scale and bias (fbgemm's fused 8-bit rowwise).

    row r of a rows x dim table  ─►  q[r] uint8 [dim], scale[r], bias[r]
    value ≈ q * scale + bias,  scale = (max - min) / 255,  bias = min of the row

q = round((value - bias) / scale) (nearest, ties to even); a constant row has
scale 0 (its q are 0, its value the bias). The error of a value is at most
scale / 2. Storage: dim bytes + 8 bytes (fp32 scale and bias) a row: 0.25x fp32 + 8.

Layout: q is uint8 [rows, dim]; scale_bias is float32 [rows, 2] (column 0 scale,
column 1 bias): what fbgemm's FloatOrHalfToFused8BitRowwiseQuantized appends to
each row, kept as a separate tensor here.
"""

from __future__ import annotations

import torch

CHUNK_ROWS = 1 << 16


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q uint8 [rows, dim], scale_bias float32 [rows, 2]) of ``weight`` (any float type)."""
    rows = weight.shape[0]
    q = torch.empty(weight.shape, dtype=torch.uint8, device=weight.device)
    scale_bias = torch.empty(rows, 2, dtype=torch.float32, device=weight.device)
    for start in range(0, rows, CHUNK_ROWS):  # bounded fp32 temporaries for big tables
        w = weight[start : start + CHUNK_ROWS].float()
        lo, hi = w.min(dim=1).values, w.max(dim=1).values
        scale = (hi - lo) / 255.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q[start : start + CHUNK_ROWS] = ((w - lo[:, None]) / safe[:, None]).round_().clamp_(0, 255).to(torch.uint8)
        scale_bias[start : start + CHUNK_ROWS, 0] = scale
        scale_bias[start : start + CHUNK_ROWS, 1] = lo
    return q, scale_bias


def dequantize_rows(q: torch.Tensor, scale_bias: torch.Tensor) -> torch.Tensor:
    """float32 [rows, dim] values of an int8 row-wise table."""
    return q.float() * scale_bias[:, :1] + scale_bias[:, 1:]


def int8_bytes(rows: int, dim: int) -> int:
    """Bytes of a rows x dim table stored int8 row-wise."""
    return rows * (dim + 8)
