"""Hotline's cold gather alone: random rows of a host table into page-locked memory.

    python -m dlrm.bench.host_gather --config configs/bench_gpu.yaml [--lookups 4500]
                                     [--threads 1,4,16] [--rows N] [--busy N]

A captured Hotline step of ``configs/bench_gpu.yaml`` gathers about 4,500 distinct cold
rows of its host tier: 33.8M rows x 64 fp32, 8.6 GB. On the 2026-11-27 H200 that took
1.3 ms a step (0.67 GB/s), where this project's 2-core machine takes about 0.3 ms for the
same rows of a table of the same size. This times the gather outside the step, to tell
the gather's own speed from what the step does around it:

    pages     huge: the table advised onto 2 MiB pages before its first write, as the
              host tier is (embeddings/huge_pages.py); small: not advised. Each line
              says the share of the table the kernel put on huge pages.
    way       torch: one ``index_select`` over ``threads`` intra-op threads (the host
              tier's gather with hotline.gather_threads=0); ours: embeddings/host_rows.py
              on ``threads`` threads of ours (hotline.gather_threads=threads, the default 1)
    busy      processes spinning beside the gather, as decode workers hold the cores of
              a GPU run (data.workers=auto: all but one): a parallel region waits for its
              slowest thread, so the mean (``mean_ms``) and the 90th percentile say what
              the median does not

Ids are distinct and sorted, as the host tier's are; the rows go into page-locked
memory where CUDA is present (as the gather's do), else into ordinary memory. One table
at a time is allocated. Prints one JSON line per (pages, way, threads).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from dlrm.bench.kernels import table_rows
from dlrm.config import load_config
from embeddings.host_rows import gather_rows
from embeddings.huge_pages import advise_huge_pages, huge_page_bytes


def gather_rates(rows: int, dim: int, lookups: int, threads: list[int], repeat: int = 100,
                 seed: int = 0, ways: tuple[str, ...] = ("torch", "ours"), busy: int = 0
                 ) -> list[dict[str, Any]]:
    """Milliseconds (median, mean, 90th percentile) of a gather of ``lookups`` distinct
    sorted random rows of a [rows, dim] fp32 table, per pages (huge, small), way (torch,
    ours) and thread count, ``busy`` spinning processes beside it."""
    lookups = min(lookups, rows)  # distinct rows: a small table has fewer
    out_rows = torch.empty(lookups, dim, pin_memory=torch.cuda.is_available())
    gen = torch.Generator().manual_seed(seed)
    before = torch.get_num_threads()
    records = []
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        for pages in ("huge", "small"):
            table = torch.empty(rows, dim)
            if pages == "huge":
                advise_huge_pages(table)
            table.fill_(0.5)  # the first write: pages faulted in now, huge where advised
            found = huge_page_bytes([table])
            share = found[0] / table.untyped_storage().nbytes() if found else None
            for way in ways:
                for n in threads:
                    ms = _times(table, out_rows, way, n, lookups, repeat, gen)
                    median = float(np.median(ms))
                    records.append({"pages": pages, "huge_page_share": share, "way": way, "threads": n,
                                    "busy": busy, "rows": rows, "dim": dim, "lookups": lookups, "ms": median,
                                    "mean_ms": float(np.mean(ms)), "p90_ms": float(np.percentile(ms, 90)),
                                    "gb_per_s": lookups * dim * 4 / median / 1e6})
            del table
    finally:
        torch.set_num_threads(before)
        for p in spinning:
            p.kill()
            p.wait()
    return records


def _times(table: torch.Tensor, out: torch.Tensor, way: str, threads: int, lookups: int,
           repeat: int, gen: torch.Generator) -> list[float]:
    """Milliseconds of ``repeat`` gathers of fresh ids, ``way`` on ``threads``."""
    rows = table.shape[0]
    pool = ThreadPoolExecutor(threads) if way == "ours" and threads > 1 else None
    torch.set_num_threads(threads if way == "torch" else 1)
    try:
        if way == "ours":
            gather_rows(table, _distinct(rows, lookups, gen), out, pool, threads)  # compiled (or loaded) first
        ms = []
        for _ in range(repeat):
            ids = _distinct(rows, lookups, gen)
            begin = time.perf_counter()
            if way == "torch":
                torch.index_select(table, 0, ids, out=out)
            else:
                gather_rows(table, ids, out, pool, threads)
            ms.append(1e3 * (time.perf_counter() - begin))
        return ms
    finally:
        if pool is not None:
            pool.shutdown()


def _distinct(rows: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` distinct row ids of ``rows``, sorted, at random."""
    if 4 * n >= rows:
        return torch.randperm(rows, generator=gen)[:n].sort().values
    while True:  # a few collisions among n draws of many rows: draw an eighth more
        ids = torch.randint(0, rows, (n + n // 8 + 8,), generator=gen).unique()
        if ids.numel() >= n:
            keep = torch.randperm(ids.numel(), generator=gen)[:n]
            return ids[keep].sort().values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dlrm.bench.host_gather", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--rows", type=int, default=None, help="table rows (default: the config's tables together)")
    parser.add_argument("--lookups", type=int, default=4500)
    parser.add_argument("--threads", default=None, help="comma-separated (default: 1, 4 and every core)")
    parser.add_argument("--repeat", type=int, default=100)
    parser.add_argument("--ways", default="torch,ours", help="torch, ours or both (comma-separated)")
    parser.add_argument("--busy", type=int, default=0, help="processes spinning beside the gather")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    rows = args.rows or sum(table_rows(cfg))
    cores = torch.get_num_threads()
    threads = ([int(t) for t in args.threads.split(",")] if args.threads
               else sorted({1, min(4, cores), cores}))
    ways = tuple(w for w in args.ways.split(",") if w)
    if not ways or set(ways) - {"torch", "ours"}:
        parser.error(f"--ways {args.ways}: torch, ours or both")
    for record in gather_rates(rows, cfg.model.embedding_dim, args.lookups, threads, args.repeat,
                               ways=ways, busy=args.busy):
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
