"""What this machine could do at best for a model: a roofline-style upper bound.

    samples/s  <=  1 / (flops_per_sample / matmul_rate + bytes_per_sample / bandwidth)

The rates are measured here (torch.mm on MLP-sized matrices, a large tensor copy);
the per-sample costs are counted from the config:

    FLOPs   forward: each Linear in→out of the bottom and top MLP   2·in·out
                     dot interaction: X Xᵀ with X [F+1, D]          2·(F+1)²·D
                     (DCNv2: each cross layer as its Linear layers)
            training ≈ 3 x forward (backward = two matmuls per forward one)
    bytes   per embedding lookup: read the row, D·4 bytes, and about 3x that again
            for the gradient write and the row's read-modify-write in the update

With CUDA (``torch.cuda.is_available()``) the rates are the GPU's, timed with CUDA
events: fp32/bf16 ``torch.mm``, a device-to-device copy (HBM) and pinned host-to-
device and device-to-host copies (PCIe or NVLink-C2C). Each engine then has its own
bytes per sample (``engine_traffic``): the same HBM traffic, and over PCIe its
input batch plus, for every lookup that misses the device (Hotline's cold rows, every
row of host_embedding), the row in and its gradient out. Its bound assumes copies
overlap compute, as Hotline's pipeline tries to, so it stays an upper bound:

    samples/s  <=  1 / max(flops / matmul_rate + hbm_bytes / hbm_bandwidth,
                           pcie_bytes / pcie_bandwidth)
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from data.generate import GenerateConfig
from dlrm.config import Config

BYTES_PER_FLOAT = 4
UPDATE_FACTOR = 3  # gradient write + update read/write, in units of one row read
BACKWARD_FACTOR = 3  # forward + backward ≈ 3 x forward


@dataclass(frozen=True)
class ModelCost:
    """Work of one training sample (forward + backward + update)."""

    flops: float
    embedding_bytes: float
    lookups: float  # embedding rows read per sample (bags: mean length)


def linear_flops(sizes: list[int]) -> int:
    """Forward FLOPs of a chain of Linear layers with widths ``sizes`` (in first)."""
    return sum(2 * a * b for a, b in itertools.pairwise(sizes))


def interaction_flops(cfg: Config, num_sparse: int) -> tuple[int, int]:
    """(forward FLOPs of the interaction, width of the top MLP's input)."""
    dim, n = cfg.model.embedding_dim, num_sparse + 1
    if cfg.model.interaction == "dot":
        return 2 * n * n * dim, dim + n * (n - 1) // 2
    width = n * dim
    per_layer = 2 * width * (cfg.model.dcn_rank * 2 if cfg.model.dcn_rank else width)
    return cfg.model.dcn_layers * per_layer, width


def lookups_per_sample(gen: GenerateConfig) -> float:
    """Ids per sample: one per one-hot feature, a mean bag of max_bag/2 per multi-hot one."""
    return (gen.sparse - gen.multi_hot) + gen.multi_hot * gen.max_bag / 2


def model_cost(cfg: Config) -> ModelCost:
    """FLOPs and embedding bytes per training sample of ``cfg`` on its generated data."""
    gen = cfg.generate
    inter, top_in = interaction_flops(cfg, gen.sparse)
    forward = (
        linear_flops([gen.dense, *cfg.model.bottom_mlp])
        + inter
        + linear_flops([top_in, *cfg.model.top_mlp])
    )
    lookups = lookups_per_sample(gen)
    row_bytes = cfg.model.embedding_dim * BYTES_PER_FLOAT
    return ModelCost(
        flops=float(BACKWARD_FACTOR * forward),
        embedding_bytes=lookups * row_bytes * (1 + UPDATE_FACTOR),
        lookups=lookups,
    )


def _best_seconds(fn: Callable[[], object], rounds: int = 7, min_round_s: float = 0.02) -> float:
    """Seconds per call of ``fn``: the best of ``rounds`` rounds of calls, each at
    least ``min_round_s`` long. Best, not median: this is an upper bound, and
    other processes on the machine only ever slow a round down."""
    for _ in range(3):  # warm-up: thread pools, oneDNN kernels for this shape
        fn()
    t0 = time.perf_counter()
    fn()
    calls = max(1, int(min_round_s / max(time.perf_counter() - t0, 1e-9)))
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def matmul_rate(m: int, k: int, n: int, dtype: torch.dtype = torch.float32, rounds: int = 7) -> float:
    """FLOP/s of torch.mm [m, k] x [k, n] in ``dtype`` on this machine's CPU cores.

    The larger of: all intra-op threads together, and one thread times the thread
    count. Small products on all threads stall whenever another process holds one
    core (every parallel region waits for the descheduled thread), so the
    one-thread figure scaled up keeps the bound an upper bound on a busy machine.
    """
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    threads = torch.get_num_threads()
    together = 2.0 * m * k * n / _best_seconds(lambda: torch.mm(a, b), rounds)
    torch.set_num_threads(1)
    try:
        single = 2.0 * m * k * n / _best_seconds(lambda: torch.mm(a, b), rounds)
    finally:
        torch.set_num_threads(threads)
    return max(together, single * threads)


def copy_bandwidth(mbytes: int = 256, rounds: int = 5) -> float:
    """Bytes/s of a large tensor copy (each byte read once and written once)."""
    src = torch.ones(mbytes * (1 << 20) // BYTES_PER_FLOAT)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), rounds)
    return 2.0 * src.numel() * BYTES_PER_FLOAT / seconds


def mlp_matmul_shape(cfg: Config) -> tuple[int, int, int]:
    """An MLP-sized product: the global batch times the widest layer, square."""
    width = max([*cfg.model.bottom_mlp, *cfg.model.top_mlp])
    return cfg.data.batch_size, width, width


def machine_limit(cfg: Config) -> dict[str, Any]:
    """Measured rates, the model's per-sample cost and the samples/s upper bound
    (of the GPU's rates where CUDA is available, see ``cuda_limit``)."""
    if torch.cuda.is_available():
        return cuda_limit(cfg)
    m, k, n = mlp_matmul_shape(cfg)
    fp32 = matmul_rate(m, k, n)
    bf16 = matmul_rate(m, k, n, torch.bfloat16, rounds=3)
    bandwidth = copy_bandwidth()
    cost = model_cost(cfg)
    bound = 1.0 / (cost.flops / fp32 + cost.embedding_bytes / bandwidth)
    bound_bf16 = 1.0 / (cost.flops / bf16 + cost.embedding_bytes / bandwidth)
    return {
        "matmul_fp32_gflops": fp32 / 1e9,
        "matmul_bf16_gflops": bf16 / 1e9,
        "bandwidth_gb_s": bandwidth / 1e9,
        "flops_per_sample": cost.flops,
        "embedding_bytes_per_sample": cost.embedding_bytes,
        "lookups_per_sample": cost.lookups,
        "samples_per_s_bound": bound,
        "samples_per_s_bound_bf16": bound_bf16,  # for runs with train.precision=bf16
    }


# --------------------------------------------------------------------------- CUDA


def cuda_seconds(fn: Callable[[], object], rounds: int = 5, min_round_s: float = 0.02) -> float:
    """Seconds per call of ``fn`` on the current CUDA stream, timed by CUDA events:
    the best of ``rounds`` rounds of calls, each at least ``min_round_s`` long."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(calls: int) -> float:
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000 / calls

    for _ in range(3):  # warm-up: cuBLAS handles and heuristics, the caching allocator
        fn()
    calls = max(1, int(min_round_s / max(timed(1), 1e-9)))
    return min(timed(calls) for _ in range(rounds))


def cuda_matmul_rate(m: int, k: int, n: int, dtype: torch.dtype = torch.float32,
                     tf32: bool = False) -> float:
    """FLOP/s of torch.mm [m, k] x [k, n] in ``dtype`` on the current GPU; fp32 with
    TF32 products where ``tf32`` (as training runs with train.tf32, the default: the
    first H200 bench timed IEEE fp32, 49 TFLOP/s, and native's row passed 100%)."""
    a = torch.randn(m, k, device="cuda").to(dtype)
    b = torch.randn(k, n, device="cuda").to(dtype)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        return 2.0 * m * k * n / cuda_seconds(lambda: torch.mm(a, b))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def cuda_copy_rates(mbytes: int = 512) -> dict[str, float]:
    """Bytes/s of the GPU's copies: device to device (each byte read and written in
    HBM, counted twice), host to device and device to host from pinned memory."""
    def measure(numel: int) -> dict[str, float]:
        src = torch.ones(numel, device="cuda")
        dst = torch.empty_like(src)
        host = torch.ones(numel, pin_memory=True)
        nbytes = numel * BYTES_PER_FLOAT
        return {
            "hbm": 2.0 * nbytes / cuda_seconds(lambda: dst.copy_(src)),
            "h2d": nbytes / cuda_seconds(lambda: dst.copy_(host, non_blocking=True)),
            "d2h": nbytes / cuda_seconds(lambda: host.copy_(src, non_blocking=True)),
        }

    rates = measure(mbytes * (1 << 20) // BYTES_PER_FLOAT)
    torch.cuda.empty_cache()  # the buffers' GPU memory back (they are gone with measure)
    return rates


def input_bytes_per_sample(cfg: Config) -> float:
    """Host-to-device bytes of one sample's input: dense floats, label, int64 ids and
    one int64 length per sparse feature."""
    gen = cfg.generate
    return BYTES_PER_FLOAT * (gen.dense + 1) + 8 * (lookups_per_sample(gen) + gen.sparse)


def engine_traffic(cfg: Config, device_hit_rate: float) -> dict[str, float]:
    """HBM and PCIe bytes per training sample when ``device_hit_rate`` of the lookups
    find their row in GPU memory (1 for tables all on the GPU, 0 for host_embedding).

    HBM: every lookup reads its row, writes its gradient and has it read again (the
    update, or the copy home), ~4 row sizes; a cold row also lands by copy, about
    what the hot row's update writes. PCIe: the input batch, and per missed lookup
    its row in and its gradient out (rows a batch shares travel once: an upper bound)."""
    cost = model_cost(cfg)
    row = cfg.model.embedding_dim * BYTES_PER_FLOAT
    missed = cost.lookups * (1.0 - device_hit_rate)
    return {
        "hbm_bytes_per_sample": cost.embedding_bytes,
        "pcie_bytes_per_sample": input_bytes_per_sample(cfg) + 2 * missed * row,
    }


def engine_bound(cfg: Config, limit: dict[str, Any], device_hit_rate: float, bf16: bool) -> dict[str, float]:
    """The samples/s bound of one engine on the GPU of ``limit`` (module docstring)."""
    traffic = engine_traffic(cfg, device_hit_rate)
    rate = 1e9 * limit["matmul_bf16_gflops" if bf16 else "matmul_fp32_gflops"]
    compute = model_cost(cfg).flops / rate + traffic["hbm_bytes_per_sample"] / (1e9 * limit["hbm_gb_s"])
    pcie = traffic["pcie_bytes_per_sample"] / (1e9 * min(limit["h2d_pinned_gb_s"], limit["d2h_pinned_gb_s"]))
    return {**traffic, "samples_per_s_bound": 1.0 / max(compute, pcie)}


def cuda_limit(cfg: Config) -> dict[str, Any]:
    """``machine_limit`` on a GPU: its measured rates; the bound of an engine with
    every table on the GPU (``engine_bound`` gives the others')."""
    m, k, n = mlp_matmul_shape(cfg)
    copies = cuda_copy_rates()
    limit: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "matmul_fp32_gflops": cuda_matmul_rate(m, k, n, tf32=cfg.train.tf32) / 1e9,
        "tf32": cfg.train.tf32,
        "matmul_bf16_gflops": cuda_matmul_rate(m, k, n, torch.bfloat16) / 1e9,
        "hbm_gb_s": copies["hbm"] / 1e9,
        "h2d_pinned_gb_s": copies["h2d"] / 1e9,
        "d2h_pinned_gb_s": copies["d2h"] / 1e9,
    }
    limit["bandwidth_gb_s"] = limit["hbm_gb_s"]  # the key the CPU report uses
    cost = model_cost(cfg)
    limit.update(flops_per_sample=cost.flops, embedding_bytes_per_sample=cost.embedding_bytes,
                 lookups_per_sample=cost.lookups, input_bytes_per_sample=input_bytes_per_sample(cfg))
    limit["samples_per_s_bound"] = engine_bound(cfg, limit, 1.0, bf16=False)["samples_per_s_bound"]
    limit["samples_per_s_bound_bf16"] = engine_bound(cfg, limit, 1.0, bf16=True)["samples_per_s_bound"]
    return limit
