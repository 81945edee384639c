"""Tiny Parquet files for tests, written with pyarrow directly (independent of data/).

``tiny_dataset`` plants the global row number in dense column ``I1`` so a test
can tell which row each sample of a batch came from.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data.schema import Schema, SparseFeature


def write_parquet(
    path: str | os.PathLike,
    columns: dict[str, Any],
    row_group_size: int | None = None,
    types: dict[str, pa.DataType] | None = None,
    **write_options: Any,
) -> str:
    """Write ``columns`` (name → list or array) to ``path`` in row groups; return the path.

    ``write_options`` go to ``pyarrow.parquet.write_table`` (e.g. write_statistics=False).
    """
    types = types or {}
    arrays = {k: pa.array(v, type=types.get(k)) for k, v in columns.items()}
    table = pa.table(arrays)
    pq.write_table(table, str(path), row_group_size=row_group_size or max(table.num_rows, 1),
                   **write_options)
    return str(path)


def tiny_dataset(
    out_dir: str | os.PathLike,
    file_rows: tuple[int, ...] = (7, 0, 130, 33),
    row_group_rows: int = 10,
    dense: int = 2,
    sparse: int = 3,
    multi_hot: int = 1,
    table_rows: int = 50,
    seed: int = 0,
) -> tuple[list[str], Schema]:
    """Files of ``file_rows`` rows; I1 = global row number, the last ``multi_hot`` C's are bags.

    Bags have 0..3 ids and about one in ten is null; labels are 0/1 floats.
    """
    rng = np.random.default_rng(seed)
    files, start = [], 0
    for i, n in enumerate(file_rows):
        cols: dict[str, Any] = {"label": rng.integers(0, 2, n).astype(np.float32)}
        cols["I1"] = np.arange(start, start + n, dtype=np.float32)
        for d in range(2, dense + 1):
            cols[f"I{d}"] = rng.random(n).astype(np.float32)
        types: dict[str, pa.DataType] = {}
        for c in range(1, sparse + 1):
            name = f"C{c}"
            if c > sparse - multi_hot:
                cols[name] = [
                    None if rng.random() < 0.1 else rng.integers(0, table_rows, rng.integers(0, 4))
                    .tolist()
                    for _ in range(n)
                ]
                types[name] = pa.list_(pa.int64())
            else:
                cols[name] = rng.integers(0, table_rows, n)
                types[name] = pa.int64()
        files.append(write_parquet(os.path.join(out_dir, f"f{i}.parquet"), cols, row_group_rows,
                                   types))
        start += n
    schema = Schema(
        label="label",
        dense=tuple(f"I{d}" for d in range(1, dense + 1)),
        sparse=tuple(
            SparseFeature(f"C{c}", table_rows, multi_hot=c > sparse - multi_hot)
            for c in range(1, sparse + 1)
        ),
    )
    return files, schema


def within(seconds: float, fn: Any) -> Any:
    """fn() in a thread; a hang fails the test instead of blocking the run."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"hung for {seconds} s"
    if "error" in result:
        raise result["error"]
    return result["value"]
