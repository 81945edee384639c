"""data.shuffle_buffer=auto (data/shuffle_window.py): windows of 4 row groups.

    auto rows      4 x the largest row group, read from the footers (pyarrow's metadata is
                   the reference), the same for every rank of every world size
    decoding       with 2 decode workers, the rows of the row groups decoded (counted in
                   the workers, at each read_row_group) stay within 1.25 x the rows read
                   (1.15x here); at the old fixed 65,536-row window they were 1.38x.
                   0 workers decodes each row group once (the count's own check)
    resume         a run whose checkpoint was written with another window (an older
                   default) resumed under auto trains the batches of an uninterrupted
                   run with that window; a new run saves the rows auto chose
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

import data.reader as reader_module
from data import shuffle_window
from data.reader import ParquetReader
from data.rows import Layout
from data.schema import Schema, SparseFeature
from dlrm.checkpoint import manager as ck
from dlrm.checkpoint.manifest import load_meta
from tests.conftest import TINY, tiny_overrides
from tests.data_helpers import tiny_dataset

SCHEMA = Schema("label", ("I1",), (SparseFeature("C1", 1000),))


def write(path: Path, start: int, groups: list[int]) -> str:
    """A file of row groups of ``groups`` rows; I1 = global row number from ``start``."""
    n = sum(groups)
    table = pa.table({"label": (np.arange(n) % 2).astype(np.float32),
                      "I1": np.arange(start, start + n, dtype=np.float32),
                      "C1": np.arange(n, dtype=np.int64) % 1000})
    with pq.ParquetWriter(path, table.schema) as w:
        at = 0
        for g in groups:
            w.write_table(table.slice(at, g), row_group_size=g)
            at += g
    return str(path)


def dataset(root: Path, files: list[list[int]]) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    paths, start = [], 0
    for i, groups in enumerate(files):
        paths.append(write(root / f"part-{i}.parquet", start, groups))
        start += sum(groups)
    return paths


def test_auto_is_four_of_the_largest_row_groups_on_every_rank(tmp_path: Path) -> None:
    # the largest group (30,000 rows) sits in the middle file: in one rank's range only
    files = dataset(tmp_path, [[5000] * 4, [1000, 30000, 2000], [7000] * 3])
    largest = max(pq.ParquetFile(f).metadata.row_group(g).num_rows
                  for f in files for g in range(pq.ParquetFile(f).num_row_groups))
    assert largest == 30000
    for world in (1, 2, 3):
        for rank in range(world):
            r = ParquetReader(files, SCHEMA, 96, rank=rank, world_size=world, shuffle=True)
            assert r.shuffle_buffer == 4 * largest, (world, rank)
            b = r.local_batch_size
            assert r.window_rows == 4 * largest // b * b
    # small row groups: the old default; an explicit count is taken as it is
    small = dataset(tmp_path / "small", [[100] * 3])
    assert ParquetReader(small, SCHEMA, 8).shuffle_buffer == 65536
    assert ParquetReader(files, SCHEMA, 8, shuffle_buffer=1000).shuffle_buffer == 1000
    with pytest.raises(ValueError, match="'auto' or a row count"):
        ParquetReader(files, SCHEMA, 8, shuffle_buffer="four")


def test_auto_caps_a_window_at_256_mb() -> None:
    wide = Schema("label", tuple(f"I{i}" for i in range(13)),
                  tuple(SparseFeature(f"C{i}", 2**40) for i in range(26)))
    record = Layout(wide, [True] * 26).width  # the reader's own record, single-hot int64 ids
    assert shuffle_window.row_bytes(wide) == record + 8 == 272  # + its place in the shuffle
    # tables whose ids fit int32 narrow the record, not the cap: the same windows
    small = Schema("label", wide.dense, tuple(SparseFeature(f"C{i}", 10) for i in range(26)))
    assert Layout(small, [True] * 26).width == 160 and shuffle_window.row_bytes(small) == 272
    assert shuffle_window.auto_rows([[65536] * 3, [41248]], wide) == 262144
    huge = shuffle_window.auto_rows([[2_000_000]], wide)
    assert huge == (256 << 20) // 272 and huge * 272 <= 256 << 20
    assert shuffle_window.auto_rows([], wide) == 65536


class CountingReader(ParquetReader):
    """A ParquetReader that appends a line per row group it decodes (in whichever process
    decodes it: the decode workers unpickle this class) to ``log``."""

    log = ""

    def _read_window(self, source, *args):  # type: ignore[no-untyped-def]
        original = reader_module.open_parquet
        reader_module.open_parquet = functools.partial(_counting_open, original, self.log)
        try:
            return super()._read_window(source, *args)
        finally:
            reader_module.open_parquet = original


class _CountedFile:
    def __init__(self, file: pq.ParquetFile, path: str, log: str) -> None:
        self.file, self.path, self.log = file, path, log

    def read_row_group(self, g: int, columns: list[str] | None = None) -> pa.Table:
        table = self.file.read_row_group(g, columns=columns)
        with open(self.log, "a") as fh:  # short lines, O_APPEND: whole lines from every process
            fh.write(f"{os.getpid()} {Path(self.path).name} {g} {table.num_rows}\n")
        return table


def _counting_open(original, log: str, path: str, *args):  # type: ignore[no-untyped-def]
    return _CountedFile(original(path, *args), path, log)


def decoded(files: list[str], workers: int, log: Path, **kw: object) -> tuple[int, int, list]:
    """(rows read, rows decoded, batches' I1) of one shuffled epoch of a CountingReader."""
    log.unlink(missing_ok=True)
    log.touch()
    reader = CountingReader(files, SCHEMA, 1000, shuffle=True, seed=3, workers=workers,
                            prefetch=2, **kw)
    reader.log = str(log)
    try:
        rows = [b.dense[:, 0].long().tolist() for b in reader.epoch(0)]
    finally:
        reader.close()
    lines = [x.split() for x in log.read_text().splitlines()]
    return sum(map(len, rows)), sum(int(x[3]) for x in lines), rows


def test_two_workers_decode_at_most_a_quarter_more(tmp_path: Path) -> None:
    """Row groups of 40,000: with the old fixed 65,536-row window (65,000 in batches of
    1,000) nearly every window boundary falls inside a row group that the next window's
    worker decodes again; auto's windows of 160,000 rows leave 3 boundaries."""
    files = dataset(tmp_path / "data", [[40000] * 3 + [10000]] * 4)  # 520,000 rows
    log = tmp_path / "decoded.log"
    rows, once, batches0 = decoded(files, 0, log)
    assert rows == once == 520_000  # one thread: each row group once (the count works)
    rows, twice, batches2 = decoded(files, 2, log)
    assert batches2 == batches0  # the same batches as ever at any worker count
    assert rows == 520_000 and twice <= 1.25 * rows, twice / rows
    _, old, _ = decoded(files, 2, log, shuffle_buffer=65536)  # the fixed default before
    assert old > 1.3 * rows, old / rows  # 1.38x


def _trace(run: Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for line in (run / "trace" / "rank-0.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["rows"]  # a step run again after a resume: its last record
    return out


def _saved(run: Path) -> tuple[str, str]:
    """data.shuffle_buffer in RUN/config.yaml and in the newest checkpoint."""
    config = yaml.safe_load((run / "config.yaml").read_text())["data"]["shuffle_buffer"]
    meta = load_meta(ck.find_checkpoint(run))["config"]["data"]["shuffle_buffer"]
    return str(config), str(meta)


def test_resume_keeps_the_window_its_checkpoint_was_written_with(tmp_path: Path) -> None:
    from dlrm.cli import main

    (tmp_path / "data").mkdir()
    tiny_dataset(tmp_path / "data", file_rows=(300, 170, 530, 41), row_group_rows=50)

    def argv(run: str, *extra: str) -> list[str]:
        return ["train", "--config", str(TINY), "--out", str(tmp_path / run), *tiny_overrides(),
                f"data.train={tmp_path / 'data'}", "data.eval=", "data.batch_size=64",
                "train.trace_rows=I1", "embeddings.replicate_max_bytes=0", *extra]

    # uninterrupted, windows of 128 rows (17 steps: 1041 rows in batches of 64)
    assert main(argv("straight", "data.shuffle_buffer=128")) == 0
    # the same run stopped at step 8 (as if written under an older default of 128), then
    # resumed with data.shuffle_buffer left at auto (65,536 rows for these 50-row groups)
    assert main(argv("resumed", "data.shuffle_buffer=128", "train.max_steps=8")) == 0
    assert main(argv("resumed")) == 0
    straight, resumed = _trace(tmp_path / "straight"), _trace(tmp_path / "resumed")
    assert sorted(resumed) == sorted(straight) == list(range(1, 18))
    assert all(resumed[s] == straight[s] for s in range(9, 18))
    assert _saved(tmp_path / "resumed") == ("128", "128")
    # a new run under auto saves the rows auto chose, and its batches differ (the window
    # matters: a resume that took auto would have failed the check above)
    assert main(argv("fresh", "train.max_steps=12")) == 0
    assert _saved(tmp_path / "fresh") == ("65536", "65536")
    fresh = _trace(tmp_path / "fresh")
    assert any(fresh[s] != straight[s] for s in range(9, 13))
