"""`dlrm bench` end to end on the tiny config (real torchrun ranks, 20 steps), its
reader-only mode, and the model cost formula of dlrm/bench/limits.py against a hand count."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from dlrm.bench.limits import model_cost
from dlrm.bench.run import ENGINES, stated_rows_override
from dlrm.cli import main
from dlrm.config import load_config
from dlrm.models.interaction import DotInteraction
from tests.conftest import REPO, TINY

SMALL = ["generate.rows=20000", "generate.row_group_rows=4096"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def full_bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Every engine's row, once for the module (a process per row): its out dir and
    what it printed (the tests of single rows read them, not a bench of their own)."""
    out = tmp_path_factory.mktemp("bench")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["bench", "--config", str(TINY), "--ranks", "1", "--steps", "20", "--out", str(out),
                     *SMALL])
    assert code == 0, printed.getvalue()[-3000:]
    return out, printed.getvalue()


@pytest.fixture
def bench(full_bench: tuple[Path, str]) -> Path:
    return full_bench[0]


@pytest.mark.distributed
@pytest.mark.slow
def test_bench_rows_ratios_and_limit(bench: Path) -> None:
    report = json.loads((bench / "bench.json").read_text())
    rows = {(r["engine"], r["ranks"]): r for r in report["rows"]}
    assert set(rows) == {("native", 1), ("native_bf16", 1), ("torchrec", 1), ("torchrec_bf16", 1),
                         ("torch_baseline", 1), ("in_memory", 1), ("hotline", 1),
                         ("native_bf16_tables", 1), ("native_fp16_tables", 1),
                         ("hotline_bf16_tables", 1), ("host_embedding", 1), ("hotline_eager", 1),
                         ("hotline_in_memory", 1)}
    # hotline.graph_step=auto on the CPU (the hot tier on torch's kernels): the eager step
    # without a word, as hotline_eager's (graph_step=off)
    for engine in ("hotline", "hotline_eager"):
        assert "static" not in rows[engine, 1]["step_mode"]
    for engine, staged in (("native", "in_memory"), ("hotline", "hotline_in_memory")):
        assert rows[engine, 1]["vs_in_memory"] == pytest.approx(
            rows[engine, 1]["samples_per_s"] / rows[staged, 1]["samples_per_s"])
    assert rows["hotline_in_memory", 1]["hotline"]["hot_hit_rate"] > 0.5  # Hotline as in its own row
    assert rows["host_embedding", 1]["hotline"]["hot_hit_rate"] == 0.0  # nothing on the device
    # Hotline's cold gather on its gather thread; host_embedding's, every row, on 4 of ours
    assert rows["hotline", 1]["hotline"]["gather_threads"] == 1.0
    assert rows["host_embedding", 1]["hotline"]["gather_threads"] == 4.0
    # what it ran on, stated beside the figures: the commit git names for this checkout
    import subprocess

    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], check=False, capture_output=True,
                          text=True).stdout.strip()
    ran = report["ran_on"]
    assert ran["commit"] == (head or "unknown (not a git checkout; set DLRM_COMMIT)") and ran["device"].startswith("cpu, ")
    assert rows["hotline", 1]["hotline"]["hot_hit_rate"] > 0.5
    # 20 timed steps after the same untimed ones (Hotline's profile window, the warm-up)
    untimed = rows["native", 1]["untimed_steps"]
    assert untimed > 5
    for engine in ("hotline", "host_embedding"):  # every split but the first made ahead
        steps = 20 + untimed
        assert rows[engine, 1]["hotline"]["split_ahead"] == (steps - 1) / steps
    for r in rows.values():
        assert r["samples_per_s"] > 0
        assert r["steps"] == 20 and r["untimed_steps"] == untimed
        assert r["fraction_of_bound"] > 0
    assert rows["torchrec", 1]["vs_torchrec"] == 1.0
    bf16 = rows["native_bf16", 1]  # measured against the bf16 bound
    assert bf16["precision"] == "bf16" and rows["native", 1]["precision"] == "fp32"
    assert bf16["fraction_of_bound"] == pytest.approx(
        bf16["samples_per_s"] / report["limit"]["samples_per_s_bound_bf16"])
    native = rows["native", 1]
    assert native["vs_torchrec"] == pytest.approx(
        native["samples_per_s"] / rows["torchrec", 1]["samples_per_s"])
    # bf16 against TorchRec under the same autocast
    assert rows["torchrec_bf16", 1]["precision"] == "bf16"
    assert bf16["vs_torchrec"] == pytest.approx(
        bf16["samples_per_s"] / rows["torchrec_bf16", 1]["samples_per_s"])
    assert bf16["vs_torchrec_precision"] == "bf16" and native["vs_torchrec_precision"] == "fp32"
    limit = report["limit"]
    for key in ("matmul_fp32_gflops", "matmul_bf16_gflops", "bandwidth_gb_s", "flops_per_sample",
                "embedding_bytes_per_sample", "samples_per_s_bound", "samples_per_s_bound_bf16"):
        assert limit[key] > 0, key
    tiny = load_config(TINY, SMALL).generate
    for (engine, _), r in rows.items():  # what each row trained, from its own summary
        dtype = engine.rsplit("_", 2)[1] if engine.endswith("_tables") else "fp32"  # native_bf16_tables: bf16
        assert r["tables"] == {"count": tiny.sparse, "rows": tiny.sparse * tiny.table_rows[0],
                               "bytes": tiny.sparse * tiny.table_rows[0] * 16 * (4 if dtype == "fp32" else 2),
                               "dtype": dtype}, engine
    assert (bench / "bench.png").read_bytes()[:8] == PNG_MAGIC
    assert (bench / "runs" / "native_1" / "metrics.jsonl").is_file()
    assert not list((bench / "runs").glob("*/checkpoints"))  # GBs each on the bench tables
    assert not list(bench.glob(".*tmp*"))  # temp names renamed away


@pytest.mark.distributed
@pytest.mark.slow
def test_reader_only_reuses_dataset(bench: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stamp = (bench / "data" / "generate.json").stat().st_mtime_ns
    code = main(["bench", "--config", str(TINY), "--reader-only", "--out", str(bench), *SMALL])
    assert code == 0
    assert "reusing dataset" in capsys.readouterr().out
    assert (bench / "data" / "generate.json").stat().st_mtime_ns == stamp
    report = json.loads((bench / "bench.json").read_text())
    assert len(report["rows"]) == len(ENGINES)  # the training rows (torch_baseline, half tables among them) are kept
    reader = report["reader"]
    assert reader["rows"] == 20000
    assert reader["rows_per_s"] > 0
    assert set(reader["modes"]) == {"shuffled", "vocabulary_shuffled"}
    assert reader["cold"]["reader_rows_per_s"] > 0 and reader["cold"]["disk_mb_s"] > 0
    assert all(rate > 0 for rate in reader["modes"].values())


def test_bad_ranks_is_a_user_error(tmp_path: Path) -> None:
    assert main(["bench", "--config", str(TINY), "--ranks", "0", "--out", str(tmp_path)]) == 2


@pytest.mark.distributed
@pytest.mark.slow
def test_engine_subset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--config", str(TINY), "--engines", "native,tensorflow",
                 "--out", str(tmp_path)]) == 2
    assert "tensorflow" in capsys.readouterr().err
    code = main(["bench", "--config", str(TINY), "--engines", "native", "--steps", "6",
                 "--out", str(tmp_path), *SMALL])
    assert code == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [(r["engine"], r["vs_torchrec"]) for r in rows] == [("native", None)]


def test_model_cost_by_hand() -> None:
    cfg = load_config(None, [
        "generate.dense=3", "generate.sparse=2", "generate.multi_hot=1", "generate.max_bag=4",
        "model.embedding_dim=2", "model.bottom_mlp=[4,2]", "model.top_mlp=[5,1]",
        "model.interaction=dot",
    ])
    # bottom 3→4→2: 2·3·4 + 2·4·2 = 40; dot over F+1 = 3 vectors of D = 2: 2·3²·2 = 36;
    # top input D + 3·2/2 = 5, 5→5→1: 2·5·5 + 2·5·1 = 60; training = 3 x (40+36+60).
    assert DotInteraction(2, 2).out_features == 5
    cost = model_cost(cfg)
    assert cost.flops == 3 * (40 + 36 + 60)
    # lookups: 1 one-hot + a mean bag of 4/2; each reads 2·4 bytes and moves 3x that more.
    assert cost.lookups == 3
    assert cost.embedding_bytes == 3 * 2 * 4 * 4


def test_rounds_merge_to_the_median_round() -> None:
    from dlrm.bench.run import merge_rounds

    runs = [{"engine": e, "ranks": 1, "samples_per_s": v, "tag": (e, i)}
            for i, (a, b) in enumerate([(30.0, 20.0), (10.0, 22.0), (20.0, 21.0)])
            for e, v in (("native", a), ("torchrec", b))]
    rows = {r["engine"]: r for r in merge_rounds(runs)}
    assert rows["native"]["samples_per_s"] == 20.0 and rows["native"]["tag"] == ("native", 2)
    assert rows["native"]["rounds"] == [30.0, 10.0, 20.0]  # in the order they ran
    assert rows["torchrec"]["samples_per_s"] == 21.0
    two = merge_rounds(runs[:4])  # even count: the lower middle, a real round
    assert {r["engine"]: r["samples_per_s"] for r in two} == {"native": 10.0, "torchrec": 20.0}


@pytest.mark.parametrize("config", ["bench.yaml", "bench_gpu.yaml"])
def test_bench_configs_train_the_stated_table_sizes(tmp_path: Path, config: str) -> None:
    """A table of 3M stated rows whose ids (2,000 rows of Zipf) fill a sliver of it:
    every bench row trains it at 3M rows; left to the data (the default encoding,
    auto), it would be a vocabulary of the ids seen."""
    from data.generate import generate_dataset
    from dlrm.parallel.planning import run_schema

    small = ["generate.rows=2000", "generate.sparse=2", "generate.multi_hot=0",
             "generate.table_rows=[3000000,5]", "generate.row_group_rows=1000", "generate.file_rows=2000"]
    generated = load_config(TINY.parent / config, small)
    generate_dataset(str(tmp_path / "d"), generated.generate, seed=0)
    stated = [stated_rows_override(generated), *small]  # what dlrm bench adds to every row
    schema, _ = run_schema(load_config(TINY.parent / config, stated), str(tmp_path / "d"))
    assert [f.rows for f in schema.sparse] == [3_000_000, 5]
    unstated, _ = run_schema(load_config(TINY.parent / config, [*small, "data.encoding=auto"]),
                             str(tmp_path / "d"))
    assert unstated.sparse[0].rows < 3_000_000  # what the bench trained before it said the sizes


@pytest.mark.distributed
@pytest.mark.slow
def test_in_memory_row_beside_native(full_bench: tuple[Path, str]) -> None:
    out, printed = full_bench
    rows = {r["engine"]: r for r in json.loads((out / "bench.json").read_text())["rows"]}
    assert rows["in_memory"]["steps"] == rows["native"]["steps"] == 20
    ratio = rows["native"]["samples_per_s"] / rows["in_memory"]["samples_per_s"]
    assert rows["native"]["vs_in_memory"] == pytest.approx(ratio)
    assert f"from Parquet / in memory = {ratio:.3f}" in printed


def test_input_ratio_pairs_each_engine_with_its_in_memory_row_of_its_rank_count() -> None:
    from dlrm.bench.run import add_input_ratio

    rows = [{"engine": "native", "ranks": 1, "samples_per_s": 90.0},
            {"engine": "in_memory", "ranks": 1, "samples_per_s": 100.0},
            {"engine": "native", "ranks": 2, "samples_per_s": 50.0},
            {"engine": "hotline", "ranks": 1, "samples_per_s": 70.0},
            {"engine": "hotline_in_memory", "ranks": 2, "samples_per_s": 80.0},
            {"engine": "hotline", "ranks": 2, "samples_per_s": 60.0},
            {"engine": "host_embedding", "ranks": 2, "samples_per_s": 40.0}]
    add_input_ratio(rows)
    assert [r.get("vs_in_memory") for r in rows] == [0.9, None, None, None, None, 0.75, None]


@pytest.mark.distributed
@pytest.mark.slow
def test_half_table_rows_beside_native(full_bench: tuple[Path, str]) -> None:
    """native_bf16_tables / native_fp16_tables train the same model with every table in
    that type: the tables cell and bench.json say so, at half the bytes of native's."""
    bench, out = full_bench
    rows = {r["engine"]: r for r in json.loads((bench / "bench.json").read_text())["rows"]}
    for dtype in ("bf16", "fp16"):
        row = rows[f"native_{dtype}_tables"]
        assert row["tables"]["dtype"] == dtype and rows["native"]["tables"]["dtype"] == "fp32"
        assert row["tables"]["bytes"] * 2 == rows["native"]["tables"]["bytes"]
        rate = row["samples_per_s"] / rows["native"]["samples_per_s"]
        assert row["vs_fp32_tables"] == {"samples_per_s": pytest.approx(rate), "table_bytes": 0.5}
        assert f"native_{dtype}_tables@1 / native@1: samples/s {rate:.3f}x, table bytes 0.500x" in out


def test_half_table_lines_pair_rows_of_a_rank_count() -> None:
    from dlrm.bench.run import half_table_lines

    def row(engine: str, ranks: int, rate: float, nbytes: int) -> dict:
        return {"engine": engine, "ranks": ranks, "samples_per_s": rate, "tables": {"bytes": nbytes}}

    rows = [row("native", 1, 100.0, 1000), row("native_bf16_tables", 1, 110.0, 500),
            row("native_fp16_tables", 2, 90.0, 500), row("hotline", 1, 70.0, 1000),
            row("hotline_bf16_tables", 1, 84.0, 500)]
    lines = half_table_lines(rows)
    assert rows[1]["vs_fp32_tables"] == {"samples_per_s": pytest.approx(1.1), "table_bytes": 0.5}
    assert "vs_fp32_tables" not in rows[2] and "vs_fp32_tables" not in rows[3]  # no native row at 2 ranks
    # Hotline's half row against Hotline's, not native's
    assert rows[4]["vs_fp32_tables"] == {"samples_per_s": pytest.approx(1.2), "table_bytes": 0.5}
    assert lines == [("native_bf16_tables@1 / native@1: samples/s 1.100x, table bytes 0.500x "
                      "(issue 24: >= 1.0x at 0.5x +- 2% of the bytes)"),
                     ("hotline_bf16_tables@1 / hotline@1: samples/s 1.200x, table bytes 0.500x "
                      "(issue 24: >= 1.0x at 0.5x +- 2% of the bytes)")]


def test_a_failed_run_is_reported_and_the_others_still_run(monkeypatch, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """--keep-going (the default): a run that exits non-zero is listed, the runs after it
    still run and print their line as each ends; --no-keep-going stops at it."""
    import argparse

    from dlrm.bench import run as bench_run

    def fake_run(config, overrides, engine, ranks, steps, data_dir, runs, round_=0, untimed=5):
        if engine == "hotline":
            raise bench_run.RunFailed(f"{engine} on {ranks} rank(s) exited 3; log x.log", 3, Path("x.log"))
        return {"engine": engine, "ranks": ranks, "samples_per_s": 1000.0 * (1 + len(engine)),
                "sections_ms": {"lookup": 1.5, "mlp": None}, "wall_s": 2.0}

    monkeypatch.setattr(bench_run, "run_engine", fake_run)
    a = argparse.Namespace(repeat=1, ranks=[1], engines=["native", "hotline", "host_embedding"],
                           config="c.yaml", overrides=[], keep_going=True)
    runs, failed = bench_run.run_all(a, 5, tmp_path, tmp_path)
    assert [r["engine"] for r in runs] == ["native", "host_embedding"]
    assert [(f["engine"], f["code"]) for f in failed] == [("hotline", 3)]
    out = capsys.readouterr().out
    assert "native@1: 7,000 samples/s (ms/step: lookup 1.5), 2 s wall" in out
    assert out.index("FAILED hotline") < out.index("host_embedding@1: 15,000 samples/s")
    a.keep_going = False
    with pytest.raises(bench_run.RunFailed):
        bench_run.run_all(a, 5, tmp_path, tmp_path)
