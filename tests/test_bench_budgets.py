"""`dlrm bench --hotline-budgets`: one hotline row per budget, the sweep table and PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlrm.bench.budgets import budget_engines, split_engine, sweep_rows, write_sweep_png
from dlrm.bench.run import engine_overrides
from dlrm.cli import main
from tests.conftest import TINY
from tests.test_bench import PNG_MAGIC, SMALL


def test_budget_engines_and_overrides() -> None:
    assert budget_engines("64MB, 2GB") == ["hotline@64MB", "hotline@2GB"]
    assert split_engine("hotline@64MB") == ("hotline", ["hotline.budget=64MB"])
    # The budget comes after the hotline row's own overrides: it wins.
    assert engine_overrides("hotline@64MB")[-1] == "hotline.budget=64MB"
    assert engine_overrides("hotline@64MB")[:-1] == engine_overrides("hotline")


def test_bad_budget_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--config", str(TINY), "--hotline-budgets", "64MB,lots",
                 "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--hotline-budgets" in err and "'lots'" in err and "Traceback" not in err


def test_sweep_rows_sorted_by_budget(tmp_path: Path) -> None:
    rows = [{"engine": e, "ranks": 1, "samples_per_s": s,
             "hotline": {"hot_hit_rate": h, "popular_share": p}}
            for e, s, h, p in [("hotline@2GB", 30.0, 0.99, 0.9), ("hotline@64MB", 10.0, 0.5, 0.1),
                               ("hotline", 20.0, 0.7, 0.3)]]
    sweep = sweep_rows(rows)
    assert [(r["budget"], r["samples_per_s"], r["hot_hit_rate"]) for r in sweep] == [
        ("64MB", 10.0, 0.5), ("2GB", 30.0, 0.99)]
    write_sweep_png(tmp_path / "s.png", sweep)
    assert (tmp_path / "s.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.distributed
@pytest.mark.slow
def test_budget_sweep_end_to_end(tmp_path: Path) -> None:
    code = main(["bench", "--config", str(TINY), "--engines", "host_embedding", "--hotline-budgets",
                 "1KB,64MB", "--steps", "6", "--out", str(tmp_path), *SMALL])
    assert code == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    sweep = {r["budget"]: r for r in report["hotline_budgets"]}
    assert set(sweep) == {"1KB", "64MB"}
    # 64 MB holds every profiled row of the tiny tables (rows the 5% profile never
    # saw stay cold); 1 KB holds a few: fewer hits, fewer popular samples.
    assert sweep["64MB"]["hot_hit_rate"] > sweep["1KB"]["hot_hit_rate"]
    assert sweep["64MB"]["popular_share"] > sweep["1KB"]["popular_share"]
    assert all(r["samples_per_s"] > 0 for r in sweep.values())
    assert (tmp_path / "bench_budgets.png").read_bytes()[:8] == PNG_MAGIC
