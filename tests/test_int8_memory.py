"""Int8 row-wise tables near the memory size (embeddings/int8.py): evaluating with int8
values and exporting them hold the table once, not twice, and the chunked functions
give exactly what the whole-table ones give."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from embeddings import int8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_int8_equals_the_whole_table(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(300, 16, generator=gen) * torch.logspace(-3, 1, 300).unsqueeze(1)).to(dtype)
    whole_q, whole_sb = int8.quantize_rows(w)  # 300 rows: one chunk
    reference = int8.dequantize_rows(whole_q, whole_sb)
    monkeypatch.setattr(int8, "CHUNK_ROWS", 64)
    seen: list[tuple[int, int]] = []
    q, sb = int8.quantize_rows(w, after_chunk=lambda c: seen.append((c.data_ptr(), c.shape[0])))
    assert torch.equal(q, whole_q) and torch.equal(sb, whole_sb)
    step = w.element_size() * 16
    assert seen == [(w.data_ptr() + r * step, min(64, 300 - r)) for r in range(0, 300, 64)]
    out = torch.full((300, 16), 9.0, dtype=dtype)
    read: list[int] = []
    int8.dequantize_into(out, q, sb, after_chunk=lambda c: read.append(c.shape[0]))
    assert torch.equal(out, reference.to(dtype))
    assert read == [n for r in range(0, 300, 64) for n in [min(64, 300 - r)] * 2]  # q's, then scale_bias
    in_place = w.clone()
    int8.round_trip_(in_place)
    assert torch.equal(in_place, reference.to(dtype))


_PEAK = """
import pathlib, sys, torch
from dlrm.checkpoint.mapped import release
from embeddings import int8
from embeddings.int8 import quantize_rows, round_trip_

int8.CHUNK_ROWS = 8192  # temporaries of 2 MB: what is left to see is what grows with the table

def status(key):
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

w = torch.empty(800_000, 64).uniform_(-1, 1, generator=torch.Generator().manual_seed(0))
table = w.numel() * 4
round_trip_(w[:10]); quantize_rows(w[:10])  # first-call allocations
for name, step in (("round_trip", lambda: round_trip_(w)),
                   ("quantize_release", lambda: quantize_rows(w, after_chunk=release)),
                   ("quantize_keep", lambda: quantize_rows(torch.ones(800_000, 64)))):
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS")
    kept = step()
    print(name, (status("VmHWM") - before) / table)
    del kept
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset")
def test_int8_steps_hold_no_second_table() -> None:
    """Peak RSS growth over a 205 MB fp32 table: ``dlrm eval --tables int8``'s round trip
    in place adds next to nothing (it once held the dequantised copy too, 1x more);
    ``dlrm export``'s quantising with each chunk's pages given back stays under the int8
    copy's 0.25x that quantising a kept table costs (the reference row here)."""
    out = subprocess.run([sys.executable, "-c", _PEAK], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1])
    growth = {name: float(v) for name, v in (line.split() for line in out.stdout.splitlines())}
    assert growth["round_trip"] < 0.15, growth
    assert growth["quantize_keep"] > 0.25 + 0.25, growth  # the ones table, then its int8 copy
    assert growth["quantize_release"] < 0.15, growth
