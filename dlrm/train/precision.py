"""``train.precision=bf16`` only where bf16 matmuls are fast.

bf16 autocast is a speed-up where the hardware multiplies bf16 natively (GPUs since
Ampere, CPUs with AMX or AVX512-BF16). Elsewhere torch emulates it, and a bf16
``mm`` can run tens of times slower than fp32, so a run asked for bf16 would train
that much slower and differ from fp32 by rounding for nothing. At start, off a GPU
with native bf16, both rates are measured on a small product (a few ms) and, when
bf16 is clearly slower, ``train.precision_fallback`` decides:

    fp32   train in fp32, with one warning line naming the rates (the default)
    error  stop with one line (exit 2): a run that must be bf16 or nothing
    none   keep bf16 anyway (benchmarks and tests of bf16 itself)

Every rank measures; if any finds bf16 slow, all fall back, so the ranks of a job
run one precision.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from data.errors import UserError
from dlrm.config import TrainConfig
from dlrm.parallel.distributed import DistInfo, all_reduce_sum

SIZE = 128  # [128, 128] x [128, 128]: a few ms in emulated bf16, 0.1 ms in fp32
# bf16 counts as slow below this share of the fp32 rate. Emulated bf16 measured
# far below it (tens of times slower); native bf16 is at or above fp32, so noise on
# a busy machine crosses neither way.
SLOW_SHARE = 0.5


class PrecisionError(UserError):
    """train.precision=bf16 with train.precision_fallback=error where bf16 is slow."""


def matmul_rates(device: torch.device, size: int = SIZE, calls: int = 5) -> tuple[float, float]:
    """(bf16, fp32) FLOP/s of ``torch.mm`` on [size, size] matrices on ``device``:
    the best of ``calls`` timed calls after two warm-up ones. On a CPU on one thread:
    the ratio is what counts, and a product this small on every thread stalls
    whenever another process holds a core (the fp32 rate would then read 100x low)."""
    def rate(dtype: torch.dtype) -> float:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        best = float("inf")
        for i in range(calls + 2):
            _sync(device)
            t0 = time.perf_counter()
            torch.mm(a, b)
            _sync(device)
            if i >= 2:
                best = min(best, time.perf_counter() - t0)
        return 2.0 * size**3 / max(best, 1e-9)

    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        return rate(torch.bfloat16), rate(torch.float32)
    finally:
        torch.set_num_threads(threads)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def native_bf16(device: torch.device) -> bool:
    """A GPU that multiplies bf16 itself: nothing to measure."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)


def decide_precision(
    train: TrainConfig,
    device: torch.device,
    info: DistInfo,
    say: Callable[[str], None],
) -> str:
    """The precision this run trains in: ``train.precision``, or fp32 where bf16 was
    asked for, measured slow and ``train.precision_fallback`` allows the fallback."""
    if train.precision != "bf16" or train.precision_fallback == "none" or native_bf16(device):
        return train.precision
    bf16, fp32 = matmul_rates(device)
    slow_here = bf16 < SLOW_SHARE * fp32
    if not all_reduce_sum([float(slow_here)], info)[0]:
        return "bf16"
    where = f"this {device.type}" + (" (one thread)" if device.type == "cpu" else "")
    measured = (f"bf16 matmuls run at {bf16 / 1e9:.1f} GFLOP/s against {fp32 / 1e9:.1f} in fp32 "
                f"on {where}" if slow_here else "bf16 matmuls measured slow on another rank")
    if train.precision_fallback == "error":
        raise PrecisionError(f"config key train.precision=bf16: {measured}; use train.precision=fp32, "
                             "or train.precision_fallback=none to run bf16 anyway")
    say(f"warning: train.precision=bf16: {measured}; training in fp32 instead "
        "(train.precision_fallback=none keeps bf16, =error stops)")
    return "fp32"
