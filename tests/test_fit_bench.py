"""dlrm bench --fit-only's figures: the distinct values it divides the peak by equal
numpy's own count of the generated columns, the sketch run counts fewer exactly, and
the rate runs fit a vocabulary for exactly the config's tables over 2^20 rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from data.generate import GenerateConfig
from dlrm.bench.fit_bench import CARD, big_tables, fit_bench, format_fit


@pytest.mark.slow
def test_fit_bench_counts_the_generated_distinct_values(tmp_path: Path) -> None:
    cfg = GenerateConfig(dense=2, sparse=3, table_rows=[10, 2**21, 50], row_group_rows=1000,
                         file_rows=4000)
    result = fit_bench(tmp_path, 8000, [1], [0, 1, 2], cfg)
    assert result["vocabulary_columns"] == ["C2"]
    table = pq.read_table([str(p) for p in sorted((tmp_path / "memory").glob("*.parquet"))])
    distinct = sum(len(np.unique(table.column(f"C{i + 1}").to_numpy())) for i in range(len(CARD)))
    assert [m["distinct"] for m in result["memory"]] == [distinct] * 4
    assert result["memory"][0]["counted"] == distinct
    assert result["memory"][2]["counted"] < result["memory"][1]["counted"]  # sketch dropped
    half = pq.read_table([str(p) for p in sorted((tmp_path / "memory").glob("*.parquet"))[:2]])
    assert result["marginal"]["distinct"] == [
        sum(len(np.unique(half.column(f"C{i + 1}").to_numpy())) for i in range(len(CARD))),
        distinct]
    assert result["rates"][0]["rows_per_s"] > 0 and "ranks 1 workers 0" in format_fit(result)
    two = result["rates"][2]  # its workers' start-up timed alone and taken out of its time
    assert two["startup_s"] > 0 and two["rows_per_s_after_startup"] > two["rows_per_s"]
    # 0 or 1 worker: counted in this process, no start-up to take out
    assert result["rates"][0]["startup_s"] == result["rates"][1]["startup_s"] == 0
    assert "start-up" in format_fit(result).splitlines()[3]


def test_big_tables_are_the_ones_over_2_20_rows(tmp_path: Path) -> None:
    from data.generate import generate_dataset

    cfg = GenerateConfig(rows=100, dense=1, sparse=4, table_rows=[10, 2**20 + 1, 2**20, 3 << 20])
    files = generate_dataset(str(tmp_path), cfg, rows=100)
    assert big_tables(files, cfg.table_rows) == {
        "C1": "identity", "C2": "vocabulary", "C3": "identity", "C4": "vocabulary"}
    assert set(big_tables(files, [100]).values()) == {"vocabulary"}  # none big: all
