"""``dlrm bench --reader-only --workers 0,1,2``: reader rows/s per data.workers count.

    schema          bench      the bench set (cfg.generate: dense, int64 ids), shuffled, identity ids
                    avazu      Avazu-shaped: label and 22 string columns (generated from the
                               bench set's ids, 8-12 characters), shuffled, through vocabularies
    per count       rows_per_s the reader's first epoch: its rows over its seconds, start-up included
                    startup_s  seconds to that epoch's first batch (worker processes starting,
                               the first window decoded)
                    steady     rows/s of the later epochs (median of STEADY_EPOCHS), the workers
                               already running, as they are for every epoch after a run's first

Workers split an epoch by shuffle windows (data.shuffle_buffer rows each, the config's;
``auto``, the default: 4 row groups, data/shuffle_window.py): a set of fewer windows
than workers leaves some idle, so sweep on sets of many windows; a row group that
straddles two windows is decoded by both their workers, so windows of several row
groups waste less. Each count's rates carry the window used (``window_rows``,
``shuffle_buffer``, ``windows`` per epoch), printed under the counts.

An epoch of one window a worker measures the workers' start, not their rate: every
epoch begins with each worker decoding its first window while the consumer waits, and
the workers stop at the epoch's end (the 2026-11-26 H200 sweep: 16 windows, 16 workers,
3.81x). So each count N >= 1 reads the set copied (whole files: the reader reads a
linked file once) until an epoch holds at least ``WINDOWS_PER_WORKER`` windows a worker
(``copies`` in its rates; at most ``MAX_COPIES``); 0 workers reads the set once.

Each count starts a fresh reader after a warm-up epoch (page cache, imports, the
forkserver); vocabularies are fitted once, untimed. pyarrow is held to one thread, as in
each worker, so 0 workers is the one-core rate. The counts run one after the other in
this process, so their ratios come from one run of one machine.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

AVAZU_COLUMNS = 22  # Avazu's categorical columns (C1, banner_pos, site_id, ... C21)
STEADY_EPOCHS = 3  # epochs timed per count once its workers run (median: a shared machine)
WINDOWS_PER_WORKER = 8  # an epoch's windows a worker, at least (the set copied to get them)
MAX_COPIES = 16  # copies of the set at most (16 x bench_gpu's 1M-row set: 1 GB of page cache)


def reader_sweep(files: list[str], schema: Any, batch_size: int, workers: list[int],
                 out: Path, shuffle_buffer: int | str = "auto", prefetch: int = 4,
                 depth: int | None = None) -> dict[str, Any]:
    """{"bench": {count: rates}, "avazu": {count: rates}} for each count in ``workers``,
    shuffling in windows of ``shuffle_buffer`` rows (the run's data.shuffle_buffer), the
    one thread ``prefetch`` batches ahead (data.prefetch), each worker ``depth`` (None: the
    reader's own, ParquetReader.worker_depth)."""
    import pyarrow as pa

    threads = pa.cpu_count()
    pa.set_cpu_count(1)  # one core per count's decoder: the workers hold themselves to one
    try:
        return _sweep(files, schema, batch_size, workers, out, shuffle_buffer, prefetch, depth)
    finally:
        pa.set_cpu_count(threads)


def _sweep(files: list[str], schema: Any, batch_size: int, workers: list[int],
           out: Path, shuffle_buffer: int | str, prefetch: int, depth: int | None) -> dict[str, Any]:
    from data import preprocess

    strings = avazu_files(files, out / "avazu")
    avazu_schema = _string_schema(strings)
    prep = preprocess.fit(strings, avazu_schema, preprocess.Options(encoding="vocabulary"))
    cases = {"bench": (files, schema, None), "avazu": (strings, prep.apply(avazu_schema), prep)}
    result: dict[str, Any] = {}
    for name, (paths, sch, p) in cases.items():
        warm = epoch_rate(paths, sch, batch_size, 0, p, shuffle_buffer=shuffle_buffer, prefetch=prefetch)
        result[name] = {}
        for w in workers:
            copies = copies_for(warm["rows"], warm["window_rows"], w)
            rate = epoch_rate(replicated(paths, copies, out / "copies" / name), sch, batch_size, w, p,
                              shuffle_buffer=shuffle_buffer, prefetch=prefetch, depth=depth)
            result[name][str(w)] = {**rate, "copies": copies}
    return result


def copies_for(rows: int, window_rows: int, workers: int) -> int:
    """Copies of a set of ``rows`` rows (windows of ``window_rows``) that give ``workers``
    workers ``WINDOWS_PER_WORKER`` whole windows each (1 for 0 workers; at most
    ``MAX_COPIES``). Counted in rows: a set of 3.05 windows is no 4 (a partial last
    window): 4 copies of it hold 13 windows, 6 a worker at 2 workers, not 8."""
    need = WINDOWS_PER_WORKER * workers * window_rows
    return max(1, min(MAX_COPIES, -(-need // max(rows, 1))))


def replicated(files: list[str], copies: int, out: Path) -> list[str]:
    """``files``, then ``copies - 1`` copies of them under ``out`` (made once, kept).
    Copies, not links: the reader reads a file reached twice, by a link, once."""
    import shutil

    made = list(files)
    for c in range(1, copies):
        out.mkdir(parents=True, exist_ok=True)
        for i, path in enumerate(files):
            target = out / f"copy{c:02d}-{i:05d}.parquet"
            if not target.is_file():
                shutil.copyfile(path, str(target) + ".tmp")
                Path(str(target) + ".tmp").rename(target)
            made.append(str(target))
    return made


def epoch_rate(files: list[str], schema: Any, batch_size: int, workers: int,
               prep: Any = None, steady_epochs: int = STEADY_EPOCHS,
               shuffle_buffer: int | str = "auto", prefetch: int = 4,
               depth: int | None = None) -> dict[str, float]:
    """Shuffled epochs of one fresh reader at ``workers``: the first one's rows/s and
    start-up seconds, then the steady rows/s of ``steady_epochs`` more; and the window
    it shuffled in (its rows, the shuffle_buffer it came from, windows per epoch),
    ``prefetch`` (the one thread's batches ahead) and, with workers, ``depth``: the
    batches each worker decodes ahead (None: the reader's choice)."""
    from data.reader import ParquetReader

    reader = ParquetReader(files, schema, batch_size, shuffle=True, prefetch=prefetch,
                           preprocess=prep, workers=workers, shuffle_buffer=shuffle_buffer,
                           worker_depth=depth)
    try:
        t0 = time.perf_counter()
        it = reader.epoch(0)
        first = next(it)
        t1 = time.perf_counter()
        rows = first.size + sum(batch.size for batch in it)
        t2 = time.perf_counter()
        steady, busy, cpu, wall, done = [], [], 0.0, 0.0, 0
        for epoch in range(1, 1 + steady_epochs):
            t3, c3, batches = time.perf_counter(), time.thread_time(), 0
            w3 = cpu_seconds(reader.worker_pids())
            n = 0
            for batch in reader.epoch(epoch):
                n, batches = n + batch.size, batches + 1
            seconds = time.perf_counter() - t3
            steady.append(n / seconds)
            busy.append((time.thread_time() - c3) / max(1, batches) * 1e3)
            cpu, wall, done = cpu + cpu_seconds(reader.worker_pids()) - w3, wall + seconds, done + n
    finally:
        reader.close()
    # the workers' own CPU time over the steady epochs: near 100% busy with a rate per
    # CPU-second below one worker's, the cores (shared threads, memory) are the limit;
    # idle workers wait for the taking thread or the queue
    worked = ({"workers_busy": cpu / (wall * workers), "rows_per_worker_cpu_s": done / cpu}
              if workers and cpu > 0 and wall > 0 else {})
    # the thread taking the batches: with workers, what it spends on each (the queue, the
    # mapping, and with CUDA the copy into pinned memory) bounds all workers' rate
    return {"rows_per_s": rows / (t2 - t0), "startup_s": t1 - t0,
            "steady": float(np.median(steady)) if steady else 0.0, "rows": rows,
            "consumer_ms": float(np.median(busy)) if busy else 0.0,
            "window_rows": reader.window_rows, "shuffle_buffer": reader.shuffle_buffer,
            "windows": -(-rows // reader.window_rows), "prefetch": prefetch,
            **({"depth": reader.worker_depth()} if workers else {}), **worked}


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of processes ``pids`` so far (/proc/PID/stat); a process
    gone, or no /proc, counts 0."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def avazu_files(files: list[str], out: Path) -> list[str]:
    """The bench files as Avazu-shaped strings (once; kept under ``out``): label and
    ``AVAZU_COLUMNS`` string columns, each a bench id column written as a decimal string
    of its id times a large odd number (distinct ids stay distinct, 8-12 characters)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    made = []
    for i, path in enumerate(files):
        target = out / f"part-{i:05d}.parquet"
        made.append(str(target))
        if target.is_file():
            continue
        source = pq.ParquetFile(path)
        ids = [n for n in source.schema_arrow.names if n.startswith("C")]
        with pq.ParquetWriter(str(target) + ".tmp", _avazu_arrow_schema()) as writer:
            for g in range(source.num_row_groups):
                t = source.read_row_group(g, columns=["label", *ids])
                cols = {"label": pc.cast(t.column("label"), pa.float32())}
                for j in range(AVAZU_COLUMNS):
                    col = t.column(ids[j % len(ids)])
                    if pa.types.is_list(col.type):
                        col = pc.list_element(col.combine_chunks().fill_null([0]), 0)
                    col = pc.fill_null(col, 0)
                    salted = pc.add(pc.multiply(col, 2654435761), 10_000_000 + j)
                    cols[f"S{j + 1}"] = pc.cast(salted, pa.string())
                writer.write_table(pa.table(cols, schema=_avazu_arrow_schema()))
        Path(str(target) + ".tmp").rename(target)
    return made


def _avazu_arrow_schema() -> Any:
    import pyarrow as pa

    return pa.schema([("label", pa.float32()),
                      *((f"S{j + 1}", pa.string()) for j in range(AVAZU_COLUMNS))])


def _string_schema(files: list[str]) -> Any:
    from data.schema import Schema, SparseFeature

    return Schema("label", (), tuple(SparseFeature(f"S{j + 1}", 1, encoding="vocabulary")
                                     for j in range(AVAZU_COLUMNS)))


def format_workers(sweep: dict[str, Any]) -> str:
    """Per schema: the first epoch's rows/s at each worker count, its ratio to 0 workers
    and its seconds to the first batch; then, for N >= 1 workers, the steady rate's ratio
    to 0 workers' steady rate against the target 0.8·N (issue 23: N workers on N cores),
    where 0 workers ran."""
    lines = []
    for name, by_count in sweep.items():
        base = by_count.get("0", {}).get("rows_per_s")
        cells = []
        for count, r in by_count.items():
            notes = [f"{r['rows_per_s'] / base:.2f}x"] if base else []
            if "startup_s" in r:
                notes.append(f"first batch {r['startup_s']:.2f} s")
            cells.append(f"{count} workers {r['rows_per_s']:,.0f}"
                         + (f" ({', '.join(notes)})" if notes else ""))
        lines.append(f"reader {name} first epoch: " + ", ".join(cells) + " rows/s")
        lines.extend(_window_line(name, by_count))
        steady0 = by_count.get("0", {}).get("steady")
        if not any("steady" in r for r in by_count.values()):
            continue
        scaling = [f"{n} workers {r['steady'] / steady0:.2f}x = "
                   f"{r['steady'] / steady0 / (0.8 * int(n)):.0%} of 0.8·N"
                   for n, r in by_count.items() if int(n) > 0 and "steady" in r and steady0]
        lines.append(f"reader {name} steady (workers running): "
                     + ", ".join(f"{n} workers {r['steady']:,.0f}" for n, r in by_count.items()
                                 if "steady" in r)
                     + " rows/s" + ("; " + ", ".join(scaling) if scaling else ""))
        busy = [f"{n} workers {r['consumer_ms']:.3f}" for n, r in by_count.items()
                if int(n) > 0 and "consumer_ms" in r]
        if busy:
            lines.append(f"reader {name} taking thread's CPU ms a batch: " + ", ".join(busy))
        worked = [f"{n} workers {r['workers_busy']:.0%} busy, {r['rows_per_worker_cpu_s']:,.0f}"
                  for n, r in by_count.items() if "workers_busy" in r]
        if worked:
            lines.append(f"reader {name} workers' own CPU, steady (rows per CPU-second): " + ", ".join(worked))
    return "\n".join(lines)


def _window_line(name: str, by_count: dict[str, Any]) -> list[str]:
    """The shuffle window the counts read in (the same at every count), if recorded."""
    shown = [r for r in by_count.values() if "window_rows" in r]
    if not shown:
        return []
    r = next((r for r in shown if r.get("copies", 1) == 1), shown[0])  # the set once, where read so
    once = r["windows"] // r.get("copies", 1)
    line = (f"reader {name} windows: {r['window_rows']:,} rows (data.shuffle_buffer "
            f"{r['shuffle_buffer']:,}), {once} per epoch"
            + (f"; data.prefetch {r['prefetch']}" if "prefetch" in r else ""))
    depths = [f"{n} workers {c['depth']}" for n, c in by_count.items() if "depth" in c]
    if depths:
        line += "; batches ahead per worker: " + ", ".join(depths)
    copied = [f"{n} workers {c['copies']}x ({c['windows'] / int(n):.0f} windows a worker)"
              for n, c in by_count.items() if c.get("copies", 1) > 1]
    if copied:
        line += "; the set copied for " + ", ".join(copied)
    return [line]
