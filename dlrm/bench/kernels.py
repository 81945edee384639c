"""The embedding kernels alone: bytes moved per second, beside the device's copy rate.

    python -m dlrm.bench.kernels --config configs/bench_gpu.yaml [--kernels triton,torch]

Builds the config's tables (generate.table_rows x model.embedding_dim, fp32) in one
LocalEmbeddingCollection, draws single-hot Zipf ids (generate.zipf) for a batch of
data.batch_size, and times with CUDA events (perf_counter on the CPU), per kernel path:

    forward          the pooled lookup
    backward+update  the backward with the sparse optimizer fused (SGD unless the
                     config says otherwise), from the pooled gradient to the
                     updated rows

Bytes counted are the ones the work cannot avoid, at 4 B a float and 8 B an id:

    forward          N ids + N rows read + B*F*D pooled written
    backward+update  N ids (twice: linearize, sort) + N gradient rows read
                     + U rows read and written (+ the optimizer's state rows)

N lookups, U distinct rows. GB/s over the device's own copy rate (a 512 MB
device-to-device copy, read + write) is the share of bandwidth reached. On CUDA also
``forward_graph_ms`` and ``backward_update_graph_ms``: the same calls captured in a
CUDA graph and replayed, the kernels' GPU time without the host's launches (the eager
figures are the host's wherever it is the slower side). Prints one JSON line per path.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np
import torch

from data.generate import generator_schema
from data.jagged import JaggedFeatures
from dlrm.config import Config, load_config
from embeddings.collection import LocalEmbeddingCollection
from embeddings.optim import make_sparse_optimizer
from embeddings.table import TableSpec


def _seconds(fn: Callable[[], object], device: torch.device, calls: int) -> float:
    """Seconds per call: CUDA events on a GPU (dlrm/bench/limits.py), else wall time."""
    if device.type == "cuda":
        from dlrm.bench.limits import cuda_seconds

        return cuda_seconds(fn)
    for _ in range(3):
        fn()
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - begin) / calls


def _graph_seconds(fn: Callable[[], object], device: torch.device) -> float | None:
    """Seconds a replay of ``fn`` captured in a CUDA graph: its kernels' GPU time alone.
    Eager calls back to back time the host's launches instead once those are the slower
    side (each call here is a few kernels and the autograd around them). None where the
    capture fails (then the eager figure is all there is)."""
    from dlrm.bench.limits import cuda_seconds

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the capture's stream, as torch asks
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception:  # noqa: BLE001 - any capture error: report the eager figure only
        torch.cuda.synchronize(device)
        return None
    return cuda_seconds(graph.replay)


def zipf_batch(cfg: Config, batch: int, device: torch.device, seed: int = 0) -> JaggedFeatures:
    """Single-hot ids, feature-major, Zipf(generate.zipf) over each table's rows."""
    rng = np.random.default_rng(seed)
    rows = table_rows(cfg)
    ids = [(rng.zipf(cfg.generate.zipf, batch) - 1) % r for r in rows]
    values = torch.from_numpy(np.concatenate(ids).astype(np.int64))
    keys = [f"C{i + 1}" for i in range(len(rows))]
    lengths = torch.ones(len(rows) * batch, dtype=torch.int64)
    return JaggedFeatures(keys, values, lengths, stride=batch).to(device)


def table_rows(cfg: Config) -> list[int]:
    """The generator's table sizes, one per sparse feature."""
    return [feature.rows for feature in generator_schema(cfg.generate).sparse]


def _run_segment(collection: LocalEmbeddingCollection) -> int | None:
    """Lookups of one id a program of the Triton backward sums (None: the torch path)."""
    if not collection.on_triton():
        return None
    from embeddings.kernels.sparse_update import SEGMENT  # imports triton

    return SEGMENT


def measure(cfg: Config, kernels: str, device: torch.device, calls: int) -> dict:
    dim, batch = cfg.model.embedding_dim, cfg.data.batch_size
    tables = [TableSpec(f"t{i}", rows=r, dim=dim, features=(f"C{i + 1}",))
              for i, r in enumerate(table_rows(cfg))]
    optimizer = make_sparse_optimizer(cfg.optim.sparse, cfg.optim.eps, cfg.embeddings.state_dtype)
    collection = LocalEmbeddingCollection(tables, optimizer, seed=None, device=device, kernels=kernels)
    torch.nn.init.uniform_(collection.weight.data, -0.01, 0.01)
    collection.set_lr(1e-6)
    sparse = zipf_batch(cfg, batch, device)
    grad = torch.randn(batch, len(tables) * dim, device=device)
    forward_s = _seconds(lambda: collection(sparse).detach(), device, calls)
    both_s = _seconds(lambda: collection(sparse).backward(grad), device, calls)
    lookups = sparse.values().numel()
    stacked = sparse.values() + collection.feature_offsets.repeat_interleave(batch)
    counts = torch.unique(stacked, return_counts=True)[1]
    distinct = int(counts.numel())
    row = dim * 4
    state_row = optimizer.state_bytes_per_row(dim)
    forward_bytes = lookups * (8 + row) + batch * len(tables) * row
    backward_bytes = lookups * (16 + row) + distinct * 2 * (row + state_row)
    backward_s = max(both_s - forward_s, 1e-12)
    graphed = {}
    if device.type == "cuda":  # the same work replayed from graphs: GPU time, no host launches
        forward_g = _graph_seconds(lambda: collection(sparse).detach(), device)
        both_g = _graph_seconds(lambda: collection(sparse).backward(grad), device)
        if forward_g is not None and both_g is not None:
            graphed = {"forward_graph_ms": forward_g * 1e3,
                       "backward_update_graph_ms": max(both_g - forward_g, 1e-12) * 1e3}
    return {
        "kernels": kernels, "device": str(device), "tables": len(tables),
        "rows": collection.total_rows, "table_bytes": collection.total_rows * row, "dim": dim,
        "batch": batch, "lookups": lookups, "distinct_rows": distinct,
        # the Triton backward's serial part: a program walks a segment of a run of one id
        "longest_run": int(counts.max()), "run_segment": _run_segment(collection),
        "optimizer": cfg.optim.sparse,
        "forward_ms": forward_s * 1e3, "backward_update_ms": backward_s * 1e3,
        "forward_gbps": forward_bytes / forward_s / 1e9, "backward_update_gbps": backward_bytes / backward_s / 1e9,
        **graphed,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dlrm.bench.kernels", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/bench_gpu.yaml")
    p.add_argument("--kernels", default=None, help="comma-separated: triton,torch (default: both on CUDA)")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    paths = (args.kernels or ("triton,torch" if device.type == "cuda" else "torch")).split(",")
    hbm = None
    if device.type == "cuda":
        from dlrm.bench.limits import cuda_copy_rates

        hbm = cuda_copy_rates()["hbm"]
    for kernels in paths:
        result = measure(cfg, kernels, device, args.calls)
        if hbm:
            result["hbm_gbps"] = hbm / 1e9
            result["forward_share_of_hbm"] = result["forward_gbps"] * 1e9 / hbm
            result["backward_update_share_of_hbm"] = result["backward_update_gbps"] * 1e9 / hbm
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
