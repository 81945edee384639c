"""One-line warnings for a narrow table type: fp16 overflow, bf16 updates below its spacing.

    fp16  holds |x| <= 65504: a table whose values (loaded, or grown by training) pass
          that becomes inf there.
    bf16  keeps 8 significant bits: round-to-nearest drops an update smaller than half
          a spacing, |w| * 2^-9 .. 2^-8. Stochastic rounding still moves the weight in
          expectation, but through noise of a whole spacing per step.
"""

from __future__ import annotations

import math
import sys
from typing import Protocol, runtime_checkable

import torch

FP16_MAX = 65504.0
_said: set[str] = set()


def warn_once(text: str) -> None:
    """``warning: text`` on stderr, once per process per text."""
    if text not in _said:
        _said.add(text)
        print(f"warning: {text}", file=sys.stderr)


def fp16_overflow(table: str, values: torch.Tensor) -> str | None:
    """The warning for ``values`` of ``table`` stored as fp16 (fp16 ones: infs; wider
    ones: finite values past fp16's range), or None."""
    if values.dtype == torch.float16:
        over = int(torch.isinf(values).sum())
    else:
        over = int(((values.abs() > FP16_MAX) & torch.isfinite(values)).sum())
    return fp16_overflow_line(table, over) if over else None


def fp16_overflow_line(table: str, count: int) -> str:
    """The fp16 overflow warning for ``count`` values of ``table`` stored as inf (the
    Triton update counts them on the device; the torch path counts the infs)."""
    return (f"table {table}: {count:,} values overflow fp16 (|x| > {FP16_MAX:g}) and are stored as inf; "
            f"use embeddings.dtype=bf16 or fp32")


def say_fp16_overflow(counts: list[int], feature_tables: list[str], said: set[str]) -> None:
    """One ``fp16_overflow_line`` per table among ``feature_tables`` (a feature's table,
    one per count) whose features' ``counts`` (finite values rounded to inf) are not all
    zero, summed over its features; each table said once (``said``: those said already,
    updated)."""
    per_table: dict[str, int] = {}
    for table, count in zip(feature_tables, counts, strict=True):
        if count:
            per_table[table] = per_table.get(table, 0) + count
    for table, count in per_table.items():
        if table not in said:
            said.add(table)
            warn_once(fp16_overflow_line(table, count))


@runtime_checkable
class Fp16OverflowCounter(Protocol):
    """A module that counts its fp16 tables' overflow where it updates them (on the
    device, on the Triton path) and says it, one line per table, when asked: a host
    read, done where the host waits anyway (the trainer's log, checkpoint and end)."""

    def warn_fp16_overflow(self) -> None: ...


def bf16_small_lr(lr: float, rows: dict[str, int], optimizer: str) -> str | None:
    """The warning when a bf16 table's step is under half a spacing of its initial values.

    Initial values are uniform(+-sqrt(1/rows)); a typical one is half that bound. The
    step of an Adagrad-family or Adam optimizer is about ``lr``; plain SGD's is lr x |g|,
    smaller still (the warning is then conservative: it uses lr)."""
    if lr <= 0 or not rows:
        return None
    small = [(name, math.sqrt(1.0 / n) / 2) for name, n in rows.items()]
    below = [name for name, w in small if lr < w * 2.0**-8 / 2]
    if not below:
        return None
    name, w = max(small, key=lambda s: s[1])
    return (f"embeddings.dtype=bf16 with optim.sparse_lr={lr:g} ({optimizer}): steps are below half a bf16 "
            f"spacing of {len(below)} table(s) (e.g. {name}, values ~{w:.3g}); round-to-nearest would not move "
            f"them and stochastic rounding moves them only in expectation: raise the rate or use fp16/fp32")
