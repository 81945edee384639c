"""dlrm bench --reader-only --workers: the Avazu-shaped string set and the per-count rates.

The string set is checked against the bench ids it is made from (each string column a
one-to-one renaming of an id column, so its vocabulary has exactly as many values as
the ids have distinct values); the rates count exactly the epoch's rows at 0 and 2
workers.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dlrm.bench.reader_sweep import (
    AVAZU_COLUMNS,
    MAX_COPIES,
    WINDOWS_PER_WORKER,
    avazu_files,
    copies_for,
    cpu_seconds,
    epoch_rate,
    format_workers,
    replicated,
)
from tests.data_helpers import tiny_dataset


def test_avazu_strings_rename_the_ids_one_to_one(tmp_path: Path) -> None:
    (tmp_path / "ints").mkdir()
    files, _ = tiny_dataset(tmp_path / "ints", file_rows=(40, 25), sparse=2, multi_hot=0)
    strings = avazu_files(files, tmp_path / "avazu")
    assert avazu_files(files, tmp_path / "avazu") == strings  # kept, not rewritten
    for src, out in zip(files, strings):
        a, s = pq.read_table(src), pq.read_table(out)
        assert s.num_rows == a.num_rows and s.column_names[0] == "label"
        assert len(s.column_names) == 1 + AVAZU_COLUMNS
        for j in range(AVAZU_COLUMNS):
            ids = a.column(f"C{j % 2 + 1}").to_pylist()
            text = s.column(f"S{j + 1}").to_pylist()
            assert all(isinstance(t, str) and len(t) >= 8 for t in text)
            assert len(set(zip(ids, text))) == len(set(ids)) == len(set(text))


@pytest.mark.parametrize("workers", [0, 2])
def test_epoch_rate_counts_every_row(tmp_path: Path, workers: int) -> None:
    files, schema = tiny_dataset(tmp_path)
    rate = epoch_rate(files, schema, 16, workers, steady_epochs=2)
    assert rate["rows"] == 170 and rate["rows_per_s"] > 0 and rate["startup_s"] >= 0
    assert rate["steady"] > 0
    assert 0 < rate["consumer_ms"] < 1e3 * 170 / rate["steady"]  # CPU ms a batch, within an epoch's wall time
    # the window it read in: auto for 10-row groups is 65,536 rows (one window here)
    assert (rate["shuffle_buffer"], rate["window_rows"], rate["windows"]) == (65536, 65536, 1)
    assert rate["prefetch"] == 4  # the reader's default: batches decoded ahead by the thread
    assert rate.get("depth") == (None if workers == 0 else 11)  # a worker: the window's 11 batches
    rate = epoch_rate(files, schema, 16, workers, steady_epochs=1, shuffle_buffer=40, prefetch=7)
    assert (rate["shuffle_buffer"], rate["window_rows"], rate["windows"]) == (40, 32, 6)
    assert rate["rows"] == 170 and rate["prefetch"] == 7
    assert rate.get("depth") == (None if workers == 0 else 7)  # 2 a window, at least data.prefetch
    if workers:
        rate = epoch_rate(files, schema, 16, workers, steady_epochs=1, shuffle_buffer=40, depth=1)
        assert rate["rows"] == 170 and rate["depth"] == 1


def test_format_workers_ratios() -> None:
    sweep = {"bench": {"0": {"rows_per_s": 100.0}, "2": {"rows_per_s": 150.0}}}
    assert format_workers(sweep) == ("reader bench first epoch: 0 workers 100 (1.00x), "
                                     "2 workers 150 (1.50x) rows/s")
    sweep = {"bench": {"0": {"rows_per_s": 100.0, "steady": 110.0, "startup_s": 0.01},
                       "4": {"rows_per_s": 300.0, "steady": 330.0, "startup_s": 0.5}}}
    assert format_workers(sweep).splitlines() == [
        ("reader bench first epoch: 0 workers 100 (1.00x, first batch 0.01 s), "
         "4 workers 300 (3.00x, first batch 0.50 s) rows/s"),
        ("reader bench steady (workers running): 0 workers 110, 4 workers 330 rows/s; "
         "4 workers 3.00x = 94% of 0.8·N")]  # 3 / 3.2
    del sweep["bench"]["0"]  # a count alone (gpu_session's A/B run): its rates, no ratio
    sweep["bench"]["4"]["consumer_ms"] = 0.1234
    assert format_workers(sweep).splitlines() == [
        "reader bench first epoch: 4 workers 300 (first batch 0.50 s) rows/s",
        "reader bench steady (workers running): 4 workers 330 rows/s",
        "reader bench taking thread's CPU ms a batch: 4 workers 0.123"]
    window = {"window_rows": 262144, "shuffle_buffer": 262144, "windows": 4}
    sweep = {"bench": {"0": {"rows_per_s": 100.0, **window}}}
    assert format_workers(sweep).splitlines()[1] == (
        "reader bench windows: 262,144 rows (data.shuffle_buffer 262,144), 4 per epoch")
    sweep = {"bench": {"0": {"rows_per_s": 100.0, **window, "prefetch": 16},
                       "8": {"rows_per_s": 500.0, **window, "prefetch": 16, "depth": 64}}}
    assert format_workers(sweep).splitlines()[1] == (
        "reader bench windows: 262,144 rows (data.shuffle_buffer 262,144), 4 per epoch; "
        "data.prefetch 16; batches ahead per worker: 8 workers 64")


def test_workers_own_cpu_is_read_from_proc_and_said() -> None:
    """cpu_seconds against the kernel's count of this process as os.times gives it (a
    tick apart at most); a process gone counts nothing. The line the sweep prints."""
    import subprocess
    import sys

    end = time.process_time() + 0.3
    while time.process_time() < end:  # some CPU time of our own
        pass
    t = os.times()
    assert cpu_seconds([os.getpid()]) == pytest.approx(t.user + t.system, abs=0.05)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert cpu_seconds([gone.pid]) == 0.0
    sweep = {"bench": {"4": {"rows_per_s": 300.0, "steady": 330.0, "workers_busy": 0.93,
                             "rows_per_worker_cpu_s": 2_500_000.0}}}
    assert format_workers(sweep).splitlines()[-1] == (
        "reader bench workers' own CPU, steady (rows per CPU-second): 4 workers 93% busy, 2,500,000")


def test_copies_give_each_worker_eight_windows() -> None:
    window = 65536
    gpu_set = 16 * window  # the GPU session's set: 16 whole windows
    assert copies_for(gpu_set, window, 0) == 1 and copies_for(gpu_set, window, 1) == 1
    assert copies_for(gpu_set, window, 2) == 1 and copies_for(gpu_set, window, 4) == 2
    assert copies_for(gpu_set, window, 16) == 8 and copies_for(window, window, 16) == MAX_COPIES
    # 200,000 rows are 3.05 windows, not 4: 6 copies hold 18.3 (9 a worker at 2 workers);
    # 4 copies held 12.2 (the bench on configs/tiny.yaml said "6 windows a worker")
    assert copies_for(200_000, window, 2) == 6
    for rows, workers in ((200_000, 2), (100_000, 3), (gpu_set, 16), (70_000, 4)):
        copies = copies_for(rows, window, workers)
        assert copies * rows // window >= WINDOWS_PER_WORKER * workers or copies == MAX_COPIES


def test_a_replicated_set_is_read_whole_each_copy(tmp_path: Path) -> None:
    """The copies are files the reader reads again (a link would be read once), so an
    epoch of 3 copies at 2 workers has 3 times the rows and every row 3 times."""
    files, schema = tiny_dataset(tmp_path)
    three = replicated(files, 3, tmp_path / "copies")
    assert len(three) == 3 * len(files) and three[:len(files)] == files
    assert replicated(files, 3, tmp_path / "copies") == three  # kept, not copied again
    assert replicated(files, 1, tmp_path / "none") == files and not (tmp_path / "none").exists()
    rate = epoch_rate(three, schema, 16, 2, steady_epochs=1, shuffle_buffer=40)
    assert rate["rows"] == 3 * 170 and rate["windows"] == 16  # windows of 32 rows over the 510


def test_the_window_line_names_the_copies() -> None:
    window = {"window_rows": 65536, "shuffle_buffer": 65536, "prefetch": 4}
    sweep = {"bench": {"0": {"rows_per_s": 100.0, **window, "windows": 16, "copies": 1},
                       "16": {"rows_per_s": 900.0, **window, "windows": 128, "copies": 8}}}
    assert format_workers(sweep).splitlines()[1] == (
        "reader bench windows: 65,536 rows (data.shuffle_buffer 65,536), 16 per epoch; data.prefetch 4; "
        "the set copied for 16 workers 8x (8 windows a worker)")
