"""Hotline's cold gather alone: random rows of a host table into page-locked memory.

    python -m dlrm.bench.host_gather --config configs/bench_gpu.yaml [--lookups 4500]
                                     [--threads 1,4,16] [--rows N]

A captured Hotline step of ``configs/bench_gpu.yaml`` gathers about 4,500 distinct cold
rows of its host tier: 33.8M rows x 64 fp32, 8.6 GB. On the 2026-11-27 H200 that took
1.3 ms a step (0.67 GB/s), where this project's 2-core machine takes about 0.3 ms for the
same rows of a table of the same size. This times the gather outside the step, to tell
the gather's own speed from what the step does around it:

    pages     huge: the table advised onto 2 MiB pages before its first write, as the
              host tier is (embeddings/huge_pages.py); small: not advised. Each line
              says the share of the table the kernel put on huge pages.
    threads   torch's intra-op threads for the one ``index_select`` (the host tier's
              gather with hotline.gather_threads=0, the default)

Ids are distinct and sorted, as the host tier's are; the rows go into page-locked
memory where CUDA is present (as the gather's do), else into ordinary memory. One table
at a time is allocated. Prints one JSON line per (pages, threads).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import torch

from dlrm.bench.kernels import table_rows
from dlrm.config import load_config
from embeddings.huge_pages import advise_huge_pages, huge_page_bytes


def gather_rates(rows: int, dim: int, lookups: int, threads: list[int], repeat: int = 100,
                 seed: int = 0) -> list[dict[str, Any]]:
    """Median milliseconds of ``index_select`` of ``lookups`` distinct sorted random rows of
    a [rows, dim] fp32 table, per pages (huge, small) and thread count."""
    lookups = min(lookups, rows)  # distinct rows: a small table has fewer
    out_rows = torch.empty(lookups, dim, pin_memory=torch.cuda.is_available())
    gen = torch.Generator().manual_seed(seed)
    before = torch.get_num_threads()
    records = []
    try:
        for pages in ("huge", "small"):
            table = torch.empty(rows, dim)
            if pages == "huge":
                advise_huge_pages(table)
            table.fill_(0.5)  # the first write: pages faulted in now, huge where advised
            found = huge_page_bytes([table])
            share = found[0] / table.untyped_storage().nbytes() if found else None
            for n in threads:
                torch.set_num_threads(n)
                ms = []
                for _ in range(repeat):
                    ids = _distinct(rows, lookups, gen)
                    begin = time.perf_counter()
                    torch.index_select(table, 0, ids, out=out_rows)
                    ms.append(1e3 * (time.perf_counter() - begin))
                median = float(np.median(ms))
                records.append({"pages": pages, "huge_page_share": share, "threads": n,
                                "rows": rows, "dim": dim, "lookups": lookups, "ms": median,
                                "gb_per_s": lookups * dim * 4 / median / 1e6})
            del table
    finally:
        torch.set_num_threads(before)
    return records


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
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    rows = args.rows or sum(table_rows(cfg))
    cores = torch.get_num_threads()
    threads = ([int(t) for t in args.threads.split(",")] if args.threads
               else sorted({1, min(4, cores), cores}))
    for record in gather_rates(rows, cfg.model.embedding_dim, args.lookups, threads, args.repeat):
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
