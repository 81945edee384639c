"""The pass split over worker processes (data.fit_workers) equals the one-process pass
bit for bit: the saved preprocessing.json and every vocabulary file are byte-identical
(reference: workers=0, this process alone), with ties, min_frequency and max_rows, int,
string and list columns over several files and row groups."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import preprocess
from data.errors import UserError
from data.schema import infer_schema


def _files(root: Path) -> list[str]:
    rng = np.random.default_rng(5)
    out = []
    for k in range(3):
        n = 900
        big = rng.integers(0, 60, n) * 100_003 + (1 << 32)  # ints past 2^20: vocabulary
        cols = {"label": rng.random(n).astype(np.float32),
                "d": rng.random(n).astype(np.float32),
                "ids": big,
                "word": [f"w{x}" for x in rng.integers(0, 40, n)],
                "tags": [[f"t{t}" for t in rng.integers(0, 15, rng.integers(0, 3))]
                         for _ in range(n)]}
        path = root / f"part-{k}.parquet"
        pq.write_table(pa.table(cols), path, row_group_size=200)
        out.append(str(path))
    return out


def _saved(files: list[str], opts: preprocess.Options, out: Path) -> dict[str, bytes]:
    prep = preprocess.fit(files, infer_schema(files), opts)
    preprocess.save(prep, out)
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("min_frequency,max_rows", [(1, 0), (3, 12)])
def test_split_fit_equals_one_process(tmp_path: Path, min_frequency, max_rows) -> None:
    files = _files(tmp_path)
    kw = {"encoding": "vocabulary", "min_frequency": min_frequency, "max_rows": max_rows,
          "dense_transform": "standardize"}
    one = _saved(files, preprocess.Options(**kw, sketch=False), tmp_path / "w0")
    assert len(one) == 4  # preprocessing.json + 3 vocabularies
    for workers in (0, 1, 2):  # 0: one process, through the sketch when min_frequency > 1
        assert _saved(files, preprocess.Options(**kw, workers=workers),
                      tmp_path / f"w{workers}") == one, workers


@pytest.mark.slow
def test_a_fit_worker_killed_is_one_line(tmp_path: Path) -> None:
    """A worker the OOM killer takes: before, a BrokenProcessPool traceback."""
    files = _files(tmp_path)
    opts = preprocess.Options(encoding="vocabulary", workers=2)
    killed = []

    def kill_a_worker() -> None:  # as soon as the pool has started one
        deadline = time.monotonic() + 60
        while not killed and time.monotonic() < deadline:
            children = multiprocessing.active_children()
            for child in children[:1]:
                os.kill(child.pid, signal.SIGKILL)
                killed.append(child.pid)
            time.sleep(0.01)

    killer = threading.Thread(target=kill_a_worker)
    killer.start()
    try:
        with pytest.raises(UserError, match=r"a fit worker process died \(killed, perhaps for memory: "
                                            r"try fewer data.fit_workers than 2\)"):
            preprocess.fit(files, infer_schema(files), opts)
    finally:
        killer.join()
    assert killed
