"""``dlrm bench --fit-only``: the vocabulary pass's rate by ranks and workers, and its
peak memory per distinct value, on generated data at Criteo Kaggle's cardinalities.

    26 int columns, column i drawing ids in [0, CARD[i]) skewed to small ids
    (id = CARD * u^4, u uniform), + 2^32 so every column is fitted as a vocabulary;
    ROWS rows over 4 files (row groups of 64k): scaled in rows, not in cardinality
    fit at ranks x workers (gloo process group, spawned ranks)  ──► rows/s of the pass
    fit in a fresh process: (ru_maxrss after - before) / distinct values, with
    min_frequency 1, and 2 with the sketch off and on

Each measurement is one fresh process (spawned), so peaks do not carry over.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import numpy as np

# Criteo Kaggle (display advertising challenge) distinct values per categorical column
CARD = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
        27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]


def make_data(root: Path, rows: int, seed: int = 0) -> list[str]:
    """4 Parquet files of ``rows`` rows in all (label, 26 int columns)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    rng, files = np.random.default_rng(seed), []
    for k in range(4):
        n = rows // 4
        cols = {"label": rng.random(n).astype(np.float32)}
        for i, c in enumerate(CARD):
            cols[f"C{i + 1}"] = (c * rng.random(n) ** 4).astype(np.int64) + (1 << 32)
        path = root / f"part-{k}.parquet"
        if not path.is_file():
            pq.write_table(pa.table(cols), path, row_group_size=1 << 16)
        files.append(str(path))
    return files


def _fit(rank: int, world: int, files: list[str], workers: int, min_frequency: int,
         sketch: bool, port: int, out: str) -> None:
    """One rank (or the single process): fit, write 'seconds rss_delta_kb counted'
    (counted: the values counted exactly, the sketch's survivors when it is on)."""
    import torch.distributed as dist

    from data import preprocess
    from data.schema import infer_schema

    gather = None
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)

        def gather(obj: object) -> list[object]:
            got: list[object] = [None] * world
            dist.all_gather_object(got, obj)
            return got

    schema = infer_schema(files)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    prep = preprocess.fit(files, schema, preprocess.Options(
        encoding="vocabulary", min_frequency=min_frequency, workers=workers, sketch=sketch,
        rank=rank, world=world, gather=gather))
    seconds = time.perf_counter() - start
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    distinct = sum(v.distinct for v in prep.vocabularies.values())
    if rank == 0:
        Path(out).write_text(f"{seconds} {grown} {distinct}")
    if world > 1:
        dist.destroy_process_group()


def _measure(files: list[str], world: int, workers: int, min_frequency: int = 1,
             sketch: bool = True) -> tuple[float, int, int]:
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "r")
        mp.start_processes(_fit, (world, files, workers, min_frequency, sketch, port, out),
                           nprocs=world, start_method="spawn")
        seconds, grown, distinct = Path(out).read_text().split()
    return float(seconds), int(grown), int(distinct)


def fit_bench(root: Path, rows: int, ranks: list[int], workers: list[int]) -> dict:
    """The figures (see the module docstring) as a dict for bench.json."""
    files = make_data(root, rows)
    rates = []
    for w in ranks:
        for n in workers:
            seconds, _, _ = _measure(files, w, n)
            rates.append({"ranks": w, "workers": n, "rows_per_s": rows / seconds})
    memory, distinct = [], 0
    for mf, sk in ((1, False), (2, False), (2, True)):
        seconds, grown, counted = _measure(files, 1, 0, mf, sk)
        distinct = distinct or counted  # the first, unfiltered: every distinct value
        memory.append({"min_frequency": mf, "sketch": sk, "peak_growth_mb": grown / 1024,
                       "distinct": distinct, "counted": counted,
                       "bytes_per_distinct": grown * 1024 / distinct,
                       "rows_per_s": rows / seconds})
    return {"rows": rows, "columns": len(CARD), "rates": rates, "memory": memory}


def format_fit(result: dict) -> str:
    lines = [(f"fit: {result['rows']:,} rows x {result['columns']} int columns "
              f"(Criteo Kaggle cardinalities)")]
    for r in result["rates"]:
        lines.append(f"  ranks {r['ranks']} workers {r['workers']}: {r['rows_per_s']:,.0f} rows/s")
    for m in result["memory"]:
        lines.append(f"  min_frequency {m['min_frequency']} sketch {'on' if m['sketch'] else 'off'}:"
                     f" peak +{m['peak_growth_mb']:.0f} MB over {m['distinct']:,} distinct = "
                     f"{m['bytes_per_distinct']:.0f} B/distinct ({m['counted']:,} counted "
                     f"exactly; {m['rows_per_s']:,.0f} rows/s)")
    return "\n".join(lines)
