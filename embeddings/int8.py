"""Int8 row-wise tables: each row its own scale and bias (fbgemm's fused 8-bit rowwise).

    row r of a rows x dim table  ─►  q[r] uint8 [dim], scale[r], bias[r]
    value ≈ q * scale + bias,  scale = (max - min) / 255,  bias = min of the row

q = round((value - bias) / scale) (nearest, ties to even); a constant row has
scale 0 (its q are 0, its value the bias). The error of a value is at most
scale / 2. Storage: dim bytes + 8 bytes (fp32 scale and bias) a row: 0.25x fp32 + 8.

Layout: q is uint8 [rows, dim]; scale_bias is float32 [rows, 2] (column 0 scale,
column 1 bias): what fbgemm's FloatOrHalfToFused8BitRowwiseQuantized appends to
each row, kept as a separate tensor here.

Tables near the memory size: every function here works CHUNK_ROWS rows at a time, so
its fp32 temporaries are bounded. :func:`round_trip_` gives a table its int8 values in
place (``dlrm eval --tables int8``: no second table), and :func:`quantize_rows` calls
``after_chunk`` with each chunk done (``dlrm export`` gives back its pages: its model is
dropped after), so the peak is the table, not the table and its int8 copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CHUNK_ROWS = 1 << 16


def quantize_rows(weight: torch.Tensor, after_chunk: Callable[[torch.Tensor], object] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q uint8 [rows, dim], scale_bias float32 [rows, 2]) of ``weight`` (any float type),
    ``after_chunk`` called with each chunk of ``weight`` once it is quantised."""
    rows = weight.shape[0]
    q = torch.empty(weight.shape, dtype=torch.uint8, device=weight.device)
    scale_bias = torch.empty(rows, 2, dtype=torch.float32, device=weight.device)
    for start in range(0, rows, CHUNK_ROWS):
        chunk = weight[start : start + CHUNK_ROWS]
        q[start : start + CHUNK_ROWS], scale_bias[start : start + CHUNK_ROWS] = _quantize(chunk.float())
        if after_chunk is not None:
            after_chunk(chunk)
    return q, scale_bias


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = w.min(dim=1).values, w.max(dim=1).values
    scale = (hi - lo) / 255.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((w - lo[:, None]) / safe[:, None]).round_().clamp_(0, 255).to(torch.uint8)
    return q, torch.stack([scale, lo], dim=1)


def dequantize_rows(q: torch.Tensor, scale_bias: torch.Tensor) -> torch.Tensor:
    """float32 [rows, dim] values of an int8 row-wise table."""
    return q.float() * scale_bias[:, :1] + scale_bias[:, 1:]


def dequantize_into(out: torch.Tensor, q: torch.Tensor, scale_bias: torch.Tensor,
                    after_chunk: Callable[[torch.Tensor], object] | None = None) -> None:
    """``out`` [rows, dim] (any float type, any device) := the int8 rows' values, a chunk
    at a time: no fp32 copy of the whole table. ``after_chunk`` is called with each
    chunk of ``q`` and of ``scale_bias`` once it is read."""
    for start in range(0, q.shape[0], CHUNK_ROWS):
        rows = slice(start, start + CHUNK_ROWS)
        out[rows] = dequantize_rows(q[rows], scale_bias[rows])
        if after_chunk is not None:
            after_chunk(q[rows])
            after_chunk(scale_bias[rows])


def round_trip_(weight: torch.Tensor) -> None:
    """``weight`` := the values its int8 row-wise copy gives back, in place, a chunk at
    a time (a half table: rounded to its type, as a copy into it rounds)."""
    for start in range(0, weight.shape[0], CHUNK_ROWS):
        chunk = weight[start : start + CHUNK_ROWS]
        chunk.copy_(dequantize_rows(*_quantize(chunk.float())))


def int8_bytes(rows: int, dim: int) -> int:
    """Bytes of a rows x dim table stored int8 row-wise."""
    return rows * (dim + 8)
