"""Stochastic rounding on the CPU in one compiled pass (numba), bit-equal to rounding.py.

The torch recipe (embeddings/rounding.py) spends ~30 passes over the touched rows:
every shift, mask and multiply of the hash is one tensor op, and the int32 stage
still moves [U, D] ints through memory each time. Half tables then trained slower
than fp32 on the CPU (bf16 2,038 against fp32 17,837 samples/s): the rounding cost
more than the halved bytes saved. Here each element is hashed and rounded in
registers, rows in parallel:

    rows [U, D] fp32 ──(seed, step, table key, full row, first column per row)──┐
                                                                               ▼
    per row:      h_r = fmix(fmix(fmix(fmix(seed + 0x9E3779B9) ^ step) ^ table) ^ row)
    per element:  h   = fmix(h_r ^ column);  out = round(x, h)   (one loop, no temporaries)
                                                                               │
    out [U, D] as uint16 (the fp16/bf16 bits) ◄────────────────────────────────┘

Same bits as ``rounding.stochastic_round`` for every input (tests/test_rounding_cpu.py
compares the two on random, tiny, huge, subnormal and non-finite values). numba is
an ordinary dependency on CPU machines (the GPU machine's image has it too); where
it is missing, ``available()`` is False and callers keep the torch recipe.

The kernels themselves live in rounding_cpu_kernels.py, imported (with numba) at the
first compiled call. A kernel compiles at its first call in a process (0.3-2 s each;
the update kernel ~1-2 s) unless numba's on-disk cache (``cache=True``) holds it: the
first process compiles and saves every kernel, later ones with the same cache dir
(tests, torchrun ranks, the next run) load them. A compile in the middle of training
stalls that step: a Hotline host tier updates no row until its first cold one.
``compile_for`` compiles (or loads) what a CPU table will call when it is built
(``LocalEmbeddingCollection``), each kernel once per process, on a tiny input through
the same wrapper as a step, so with the same argument types; the wrappers pass ids and
coordinates as contiguous int64, so no caller brings a type that was not compiled then.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

import numpy as np
import torch

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9


@cache
def available() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


@cache
def _kernels(to_bf16: bool):
    """round_rows, add_round_rows, pool_bags, widen_rows for one half type: numba is
    imported here, at the first compiled call, not with this module."""
    from embeddings import rounding_cpu_kernels as kernels

    return kernels.rounding_kernels(to_bf16)


def _seed_step_hash(seed: int, step: int) -> int:
    """fmix(fmix(seed + GOLDEN) ^ step): the part of the hash shared by every element."""
    def fmix(h: int) -> int:
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & M32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & M32
        return h ^ (h >> 16)

    return fmix(fmix((seed + GOLDEN) & M32) ^ (step & M32))


def stochastic_round_cpu(
    x: torch.Tensor, dtype: torch.dtype, seed: int, step: int,
    tables: torch.Tensor, rows: torch.Tensor, col0: torch.Tensor,
) -> torch.Tensor:
    """``rounding.stochastic_round`` for CPU tensors, compiled: [U, D] fp32 → ``dtype``."""
    round_rows, _, _, _ = _kernels(dtype == torch.bfloat16)
    _match_torch_threads()
    x = x.float().contiguous()
    xs = x.numpy()
    out = np.empty(xs.shape, dtype=np.uint16)
    if xs.size:
        round_rows(xs.view(np.uint32), out, np.uint64(_seed_step_hash(seed, step)),
                   _int64(tables), _int64(rows), _int64(col0))
    return torch.from_numpy(out).view(dtype)


def add_rows_rounded(
    weight: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor, alpha: float,
    seed: int, step: int, tables: torch.Tensor, rows: torch.Tensor, col0: torch.Tensor,
) -> torch.Tensor:
    """``weight[ids] = round(float(weight[ids]) + alpha * grad)`` in place, for a fp16/bf16
    CPU ``weight`` and UNIQUE ``ids``: one pass that reads the half rows, adds, rounds
    and writes them back (the torch path widens, adds, rounds and scatters in ~35 ops).
    Returns [U] bool: rows where a finite fp16 value became inf."""
    _, add_round_rows, _, _ = _kernels(weight.dtype == torch.bfloat16)
    threads = _match_torch_threads()
    grad = grad.float().contiguous()
    overflow = np.zeros(ids.numel(), dtype=np.bool_)
    if ids.numel():
        add_round_rows(weight.view(torch.uint16).numpy(), _int64(ids), grad.numpy(), np.float32(alpha),
                       np.uint64(_seed_step_hash(seed, step)), _int64(tables), _int64(rows), _int64(col0),
                       overflow, threads)
    return torch.from_numpy(overflow)


def pool_half_bags(weight: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                   scale: torch.Tensor | None) -> torch.Tensor:
    """[S, D] fp32 sums of the bags ``offsets`` over rows ``ids`` of a fp16/bf16 CPU
    ``weight`` (times ``scale`` [N] per id if given): the rows widened in registers and
    summed in fp32, bag by bag, with no [N, D] fp32 copy of the gathered rows."""
    _, _, pool_bags, _ = _kernels(weight.dtype == torch.bfloat16)
    threads = _match_torch_threads()
    out = np.empty((offsets.numel() - 1, weight.shape[1]), dtype=np.float32)
    weights = (scale.float().contiguous().numpy() if scale is not None
               else np.empty(0, dtype=np.float32))
    if out.size:
        pool_bags(weight.view(torch.uint16).numpy(), _int64(ids), _int64(offsets), weights, out, threads)
    return torch.from_numpy(out)


def widen_half_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``weight[ids].float()`` for a fp16/bf16 CPU ``weight`` in one pass (torch gathers,
    then converts through a second [N, D] buffer)."""
    _, _, _, widen_rows = _kernels(weight.dtype == torch.bfloat16)
    threads = _match_torch_threads()
    out = torch.empty(ids.numel(), weight.shape[1], dtype=torch.float32)
    if out.numel():
        widen_rows(weight.view(torch.uint16).numpy(), _int64(ids), out.numpy(), threads)
    return out


def _int64(index: torch.Tensor) -> np.ndarray:
    """Ids and coordinates as the kernels were compiled for: contiguous int64 (no copy
    when they already are; another type or a strided view would compile anew)."""
    return index.to(torch.int64).contiguous().numpy()


def compile_for(device: torch.device, weight: torch.dtype, states: Iterable[torch.dtype] = ()) -> None:
    """Compile now (or load from numba's disk cache) the kernels a table on ``device``
    with ``weight`` rows and optimizer state of ``states`` calls in training (lookup,
    update, half state's rounding), so that no step compiles one. Once per process and
    type; nothing off the CPU or without numba. fp32 weights and state compile nothing
    and do not import numba (its import, with the scipy it pulls in, held about 50 MiB
    of every fp32 CPU process for nothing)."""
    half = {torch.bfloat16, torch.float16}
    half_states = set(states) & half
    if device.type != "cpu" or (weight not in half and not half_states) or not available():
        return
    if weight in half:
        _compile_weight(weight)
    for dtype in half_states:
        _compile_state(dtype)


@cache
def _compile_weight(dtype: torch.dtype) -> None:
    """The update of ``dtype`` rows and their lookups (pooled bags, single ids)."""
    weight = torch.zeros(2, 1, dtype=dtype)
    one = torch.zeros(1, dtype=torch.int64)
    add_rows_rounded(weight, one, torch.zeros(1, 1), 1.0, 0, 1, one, one, one)
    pool_half_bags(weight, one, torch.tensor([0, 1]), None)
    widen_half_rows(weight, one)


@cache
def _compile_state(dtype: torch.dtype) -> None:
    """The rounding of fp32 rows into a ``dtype`` state tensor (optim.put_state)."""
    one = torch.zeros(1, dtype=torch.int64)
    stochastic_round_cpu(torch.zeros(1, 1), dtype, 0, 1, one, one, one)


def _match_torch_threads() -> int:
    """As many threads as torch's ops use: under torchrun (OMP_NUM_THREADS=1 a rank)
    the ranks sharing the cores do not oversubscribe them."""
    import numba

    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(threads)
    return threads
