"""dlrm bench --fit-only's figures: the distinct values it divides the peak by equal
numpy's own count of the generated columns, and the sketch run counts fewer exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from dlrm.bench.fit_bench import CARD, fit_bench, format_fit


@pytest.mark.slow
def test_fit_bench_counts_the_generated_distinct_values(tmp_path: Path) -> None:
    result = fit_bench(tmp_path, 8000, [1], [0])
    table = pq.read_table([str(p) for p in sorted(tmp_path.glob("*.parquet"))])
    distinct = sum(len(np.unique(table.column(f"C{i + 1}").to_numpy())) for i in range(len(CARD)))
    assert [m["distinct"] for m in result["memory"]] == [distinct] * 3
    assert result["memory"][0]["counted"] == distinct
    assert result["memory"][2]["counted"] < result["memory"][1]["counted"]  # sketch dropped
    assert result["rates"][0]["rows_per_s"] > 0 and "ranks 1 workers 0" in format_fit(result)
