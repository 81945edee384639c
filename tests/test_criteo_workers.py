"""`dlrm convert-criteo --workers N` (data/criteo_pool.py): the inputs parsed and the
parts written by N processes give the files one process writes, and a bad line in one
input stops every job at once, with the one line one process gives."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from data.criteo_dataset import convert_criteo_dataset
from data.criteo_pool import run_all
from data.errors import DataError, UserError
from tests.test_criteo import GOOD, HEAD10K, PADDLE, needs_shared


def _parts(out: Path) -> list[tuple[str, int, list[int]]]:
    """(name, rows, row-group sizes) of every part under ``out``, and their tables."""
    found = []
    for path in sorted(out.rglob("part-*.parquet")):
        meta = pq.ParquetFile(path).metadata
        found.append((str(path.relative_to(out)), meta.num_rows,
                      [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]))
    return found


@needs_shared
@pytest.mark.slow
@pytest.mark.parametrize("how", [{"eval_fraction": 0.15, "min_frequency": 2},
                                 {"eval_days": 1, "ids": "raw"}])
def test_workers_write_what_one_process_writes(tmp_path: Path, how: dict) -> None:
    inputs = [str(PADDLE), str(HEAD10K), str(PADDLE)]
    outs = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        outs[workers] = convert_criteo_dataset(inputs, str(out), row_group_rows=700, file_rows=2500,
                                               workers=workers, **how)
        assert not (out / ".staging").exists()
    one, two = tmp_path / "w1", tmp_path / "w2"
    assert _parts(one) == _parts(two) and len(_parts(one)) >= 4
    for name, _, _ in _parts(one):
        assert pq.read_table(one / name).equals(pq.read_table(two / name)), name
    assert outs[1]["sets"]["train"]["rows"] == outs[2]["sets"]["train"]["rows"]
    assert outs[1].get("table_rows") == outs[2].get("table_rows")


def test_a_bad_line_in_one_input_stops_every_worker(tmp_path: Path) -> None:
    inputs = []
    for i in range(3):
        path = tmp_path / f"day_{i}"
        path.write_text(GOOD * 2000 + ("1\t2\n" if i == 2 else ""))
        inputs.append(str(path))
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"day_2: line 2001: 2 fields where 40 were expected"):
        convert_criteo_dataset(inputs, str(out), eval_days=1, file_rows=500, workers=2)
    assert not (out / ".staging").exists()
    assert not list(out.rglob("*.parquet")) and not list(out.rglob(".part-*"))


def _sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _fail(after: float) -> None:
    time.sleep(after)
    raise DataError("bad line", file="day_23")


def test_the_first_failure_ends_the_jobs_still_running() -> None:
    started = time.monotonic()
    with pytest.raises(DataError, match="file day_23: bad line"):
        run_all([(_sleep, (120.0,)), (_fail, (0.5,))], workers=2)
    assert time.monotonic() - started < 60  # not after the 120 s job
    assert run_all([(_sleep, (0.0,)), (os.path.join, ("a", "b"))], workers=2) == [0.0, "a/b"]


def _die(after: float) -> None:
    time.sleep(after)
    os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer does


def test_a_worker_killed_is_one_line_not_a_hang() -> None:
    started = time.monotonic()
    with pytest.raises(UserError, match=r"a converter process died \(killed, perhaps for memory"):
        run_all([(_sleep, (120.0,)), (_die, (0.5,)), (_sleep, (0.0,))], workers=2)
    assert time.monotonic() - started < 60
