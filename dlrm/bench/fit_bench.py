"""``dlrm bench --fit-only``: the vocabulary pass's rate by ranks and workers, and its
peak memory per distinct value.

    rates   the config's generate: section (configs/bench_gpu.yaml: Criteo Kaggle's 26
            table sizes, Zipf ids, 13 dense), ROWS rows; vocabulary for the tables over
            2^20 rows (bench_gpu: the five big ones; all tables if none is), identity
            for the rest, as the pass runs in `dlrm train`
            fit at ranks x workers (gloo process group, spawned ranks, one pyarrow
            thread each) ──► rows/s of the pass (wall), rows per CPU second of the
            one-process fit (what one idle core would give), and each
            split's rate over W x max(N, 1) x the one-process rate (the issue's 0.8),
            also with the workers' start-up taken out (N spawned processes importing
            pyarrow, timed alone: a fixed cost per pass, which a pass of a few
            seconds feels and one over a real data set does not)
    memory  26 int columns, column i drawing ids in [0, CARD[i]) skewed to small ids
            (id = CARD * u^4, u uniform), + 2^32 so every column is fitted as a
            vocabulary; ROWS rows over 4 files (row groups of 64k)
            fit in a fresh process: (peak RSS - RSS before, Linux VmHWM reset at the
            start) / distinct values, with min_frequency 1, and 2 with the sketch off
            and on, and max_rows 2^12 with the sketch; and the marginal cost:
            the peaks of fits over 2 and over 4 of the files, their difference over
            the difference of their distinct values (the fixed cost of imports,
            reading buffers and the allocator cancels)

Each measurement is one fresh process (spawned), so peaks do not carry over.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import resource
import shutil
import time
from pathlib import Path

import numpy as np

from data.generate import GenerateConfig

MAX_ROWS = 1 << 12  # the memory row with data.max_rows (data/fit_cap.py)
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
         sketch: bool, encodings: dict[str, str] | None, max_rows: int, port: int,
         out: str) -> None:
    """One rank (or the single process): fit, write 'seconds rss_delta_kb counted
    cpu_seconds' (counted: the values counted exactly, the sketch's survivors when it is
    on; cpu: this process's and its reaped workers')."""
    import pyarrow as pa

    from data import preprocess
    from data.schema import infer_schema

    pa.set_cpu_count(1)  # one core per rank: no decode threads beside it
    gather, exchange = None, None
    if world > 1:
        import torch.distributed as dist

        from dlrm.parallel.distributed import all_to_all_arrays as exchange

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)

        def gather(obj: object) -> list[object]:
            got: list[object] = [None] * world
            dist.all_gather_object(got, obj)
            return got

    schema = infer_schema(files)
    before = _peak_reset()
    start, cpu = time.perf_counter(), _cpu()
    prep = preprocess.fit(files, schema, preprocess.Options(
        encoding="vocabulary" if encodings is None else "identity",
        encodings=encodings or {}, min_frequency=min_frequency, max_rows=max_rows,
        workers=workers,
        sketch=sketch, rank=rank, world=world, gather=gather, exchange=exchange))
    seconds, cpu = time.perf_counter() - start, _cpu() - cpu
    grown = _peak_kb() - before
    distinct = sum(v.distinct for v in prep.vocabularies.values())
    if rank == 0:
        Path(out).write_text(f"{seconds} {grown} {distinct} {cpu}")
    if world > 1:
        dist.destroy_process_group()


def _status_kb(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _peak_reset() -> int:
    """This process's RSS in kB with its peak (VmHWM) reset to it (Linux: ``5`` to
    /proc/self/clear_refs). ru_maxrss would not do: it survives exec, so a spawned
    child starts with its parent's peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return _status_kb("VmRSS") or 0


def _peak_kb() -> int:
    """Peak RSS in kB since :func:`_peak_reset` (ru_maxrss where /proc has none)."""
    return _status_kb("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _measure(files: list[str], world: int, workers: int, min_frequency: int = 1,
             sketch: bool = True, encodings: dict[str, str] | None = None, max_rows: int = 0
             ) -> tuple[float, int, int, float]:
    import multiprocessing
    import socket
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "r")
        args = (world, files, workers, min_frequency, sketch, encodings, max_rows, port, out)
        if world == 1:  # a bare spawned process: no torch in its memory or its start
            p = multiprocessing.get_context("spawn").Process(target=_fit, args=(0, *args))
            p.start()
            p.join()
            if p.exitcode != 0:
                raise RuntimeError(f"fit bench process exited with {p.exitcode}")
        else:
            import torch.multiprocessing as mp

            mp.start_processes(_fit, args, nprocs=world, start_method="spawn")
        seconds, grown, distinct, cpu = Path(out).read_text().split()
    return float(seconds), int(grown), int(distinct), float(cpu)


def big_tables(files: list[str], table_rows: list[int]) -> dict[str, str]:
    """data.encodings of the rate runs: vocabulary for the columns of the tables over
    2^20 rows (all of them if none is), identity for the rest."""
    from data.schema import infer_schema

    names = [f.name for f in infer_schema(files).sparse]
    rows = (list(table_rows) * len(names))[:len(names)] if len(table_rows) == 1 else table_rows
    big = {n for n, r in zip(names, rows) if r > 1 << 20} or set(names)
    return {n: "vocabulary" if n in big else "identity" for n in names}


def fit_rates(files: list[str], rows: int, encodings: dict[str, str], ranks: list[int],
              workers: list[int]) -> list[dict]:
    """rows/s of the pass at each ranks x workers; the first (1 rank, no workers when
    asked) is the one-process rate the others are scaled against."""
    rates = []
    for w in ranks:
        for n in workers:
            seconds, _, _, cpu = _measure(files, w, n, encodings=encodings)
            start = startup_seconds(n) if n > 1 else 0.0  # 0 or 1: no worker spawned
            rates.append({"ranks": w, "workers": n, "rows_per_s": rows / seconds,
                          "rows_per_cpu_s": rows / cpu if w == 1 else None,
                          "startup_s": start,
                          "rows_per_s_after_startup": rows / max(seconds - start, 1e-9)})
    one = next((r["rows_per_s"] for r in rates if r["ranks"] == 1 and r["workers"] == 0), None)
    for r in rates:
        cores = r["ranks"] * max(r["workers"], 1)
        r["of_one_core_x_cores"] = r["rows_per_s"] / (one * cores) if one else None
        r["of_one_core_x_cores_after_startup"] = (
            r["rows_per_s_after_startup"] / (one * cores) if one else None)
    return rates


def startup_seconds(workers: int) -> float:
    """The split's fixed cost: ``workers`` spawned processes started, each importing
    what a counting task imports, and shut down (the pool of data/fit_split.py, with
    no rows to count). Paid once a pass: nil at dataset scale, not at a few seconds."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    start = time.perf_counter()
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_import_counting, range(workers)))
    return time.perf_counter() - start


def _import_counting(_: int) -> None:
    import importlib

    for module in ("data.files", "data.fit_split"):  # what a counting task imports
        importlib.import_module(module)


def fit_memory(root: Path, rows: int) -> tuple[list[dict], dict]:
    """The memory rows (min_frequency 1; 2 without and with the sketch) and the marginal
    bytes per distinct value (fits over 2 and over 4 of the files)."""
    files = make_data(root, rows)
    memory, distinct = [], 0
    for mf, sk, cap in ((1, False, 0), (2, False, 0), (2, True, 0), (1, True, MAX_ROWS)):
        seconds, grown, counted, _ = _measure(files, 1, 0, mf, sk, max_rows=cap)
        distinct = distinct or counted  # the first, unfiltered: every distinct value
        memory.append({"min_frequency": mf, "sketch": sk, "max_rows": cap,
                       "peak_growth_mb": grown / 1024,
                       "distinct": distinct, "counted": counted,
                       "bytes_per_distinct": grown * 1024 / distinct,
                       "rows_per_s": rows / seconds})
    _, half_grown, half_distinct, _ = _measure(files[:2], 1, 0, 1, False)
    full_grown = memory[0]["peak_growth_mb"] * 1024
    marginal = {"distinct": [half_distinct, distinct],
                "peak_growth_mb": [half_grown / 1024, full_grown / 1024],
                "bytes_per_distinct": (full_grown - half_grown) * 1024
                / max(distinct - half_distinct, 1)}
    return memory, marginal


def fit_bench(root: Path, rows: int, ranks: list[int], workers: list[int],
              cfg: GenerateConfig | None = None, seed: int = 0, memory: bool = True) -> dict:
    """The figures (see the module docstring) as a dict for bench.json; ``cfg`` None:
    the rates too on the memory runs' data (26 vocabulary columns); ``memory`` False:
    the rates alone."""
    if cfg is not None:
        from data.generate import generate_dataset

        key = json.dumps([dataclasses.asdict(cfg), seed, rows], sort_keys=True)
        rate_dir = root / f"rates-{rows}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
        files = sorted(str(p) for p in rate_dir.glob("*.parquet"))
        if not files:  # written to a side folder, then renamed: never half a set
            tmp = rate_dir.with_suffix(".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            generate_dataset(str(tmp), dataclasses.replace(cfg, rows=rows), seed=seed)
            tmp.rename(rate_dir)
            files = sorted(str(p) for p in rate_dir.glob("*.parquet"))
        encodings = big_tables(files, cfg.table_rows)
    else:
        files = make_data(root / "memory", rows)
        encodings = {f"C{i + 1}": "vocabulary" for i in range(len(CARD))}
    rates = fit_rates(files, rows, encodings, ranks, workers)
    peaks, marginal = fit_memory(root / "memory", rows) if memory else ([], None)
    counted = sorted(n for n, e in encodings.items() if e == "vocabulary")
    return {"rows": rows, "vocabulary_columns": counted, "rates": rates, "memory": peaks,
            "marginal": marginal, "memory_columns": len(CARD)}


def format_fit(result: dict) -> str:
    cols = result["vocabulary_columns"]
    lines = [f"fit: {result['rows']:,} rows, vocabulary for {len(cols)} columns ({', '.join(cols)})"]
    for r in result["rates"]:
        cpu = f", {r['rows_per_cpu_s']:,.0f} rows per CPU second" if r["rows_per_cpu_s"] else ""
        scale = (f", {r['of_one_core_x_cores']:.2f} x (ranks x workers x one process)"
                 if r["of_one_core_x_cores"] and (r["ranks"] > 1 or r["workers"] > 0) else "")
        if r.get("startup_s"):
            scale += (f"; {r['of_one_core_x_cores_after_startup']:.2f} x after the workers' "
                      f"{r['startup_s']:.2f} s start-up")
        lines.append(f"  ranks {r['ranks']} workers {r['workers']}: {r['rows_per_s']:,.0f} rows/s"
                     f"{cpu}{scale}")
    if not result["memory"]:
        return "\n".join(lines)
    lines.append(f"memory: {result['rows']:,} rows x {result['memory_columns']} int columns "
                 "(Criteo Kaggle cardinalities), one process")
    for m in result["memory"]:
        cap = f" max_rows {m['max_rows']}" if m.get("max_rows") else ""
        lines.append(f"  min_frequency {m['min_frequency']}{cap} sketch {'on' if m['sketch'] else 'off'}:"
                     f" peak +{m['peak_growth_mb']:.0f} MB over {m['distinct']:,} distinct = "
                     f"{m['bytes_per_distinct']:.0f} B/distinct ({m['counted']:,} counted "
                     f"exactly; {m['rows_per_s']:,.0f} rows/s)")
    mg = result["marginal"]
    lines.append(f"  marginal: peak +{mg['peak_growth_mb'][0]:.0f} MB over {mg['distinct'][0]:,} "
                 f"distinct (2 files), +{mg['peak_growth_mb'][1]:.0f} MB over "
                 f"{mg['distinct'][1]:,} (4 files): {mg['bytes_per_distinct']:.0f} B per "
                 "further distinct value")
    return "\n".join(lines)
