"""`dlrm bench`'s GPU side, as far as a CPU can check it: the per-engine HBM and PCIe
bytes and bound of dlrm/bench/limits.py by hand, the rows' fields against a made-up
GPU limit, the CPU limit unchanged, and the TorchRec rows skipped with a line where
torchrec is missing (the GPU machine has plain torch). The measurements themselves
run in tests/test_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dlrm.bench import limits
from dlrm.bench import run as bench
from dlrm.cli import main
from dlrm.config import load_config
from tests.conftest import REPO, TINY

BY_HAND = ["generate.dense=3", "generate.sparse=2", "generate.multi_hot=1", "generate.max_bag=4",
           "model.embedding_dim=2", "model.bottom_mlp=[4,2]", "model.top_mlp=[5,1]",
           "model.interaction=dot"]
# A made-up GPU: 1 GFLOP/s fp32 (2 bf16), 1 GB/s HBM, 0.5 GB/s in, 0.25 GB/s out.
GPU = {"matmul_fp32_gflops": 1.0, "matmul_bf16_gflops": 2.0, "hbm_gb_s": 1.0,
       "h2d_pinned_gb_s": 0.5, "d2h_pinned_gb_s": 0.25, "device": "made-up GPU", "torch": "x",
       "cuda": "y"}


def test_engine_traffic_by_hand() -> None:
    cfg = load_config(None, BY_HAND)
    # 3 lookups of 2·4 bytes; input: (3 dense + label)·4 + (3 ids + 2 lengths)·8 = 56
    assert limits.input_bytes_per_sample(cfg) == 56
    on_gpu = limits.engine_traffic(cfg, 1.0)
    assert on_gpu == {"hbm_bytes_per_sample": 3 * 8 * 4, "pcie_bytes_per_sample": 56}
    half = limits.engine_traffic(cfg, 0.5)  # 1.5 missed lookups: row in, gradient out
    assert half["pcie_bytes_per_sample"] == 56 + 2 * 1.5 * 8
    assert half["hbm_bytes_per_sample"] == on_gpu["hbm_bytes_per_sample"]


def test_engine_bound_is_the_slower_of_compute_and_copies() -> None:
    cfg = load_config(None, BY_HAND)
    flops = limits.model_cost(cfg).flops  # 408
    compute = flops / 1e9 + 96 / 1e9
    on_gpu = limits.engine_bound(cfg, GPU, 1.0, bf16=False)
    assert on_gpu["samples_per_s_bound"] == pytest.approx(1 / max(compute, 56 / 0.25e9))
    host = limits.engine_bound(cfg, GPU, 0.0, bf16=True)  # every row over PCIe, bf16 matmuls
    pcie = (56 + 2 * 3 * 8) / 0.25e9  # the slower direction bounds both
    assert host["samples_per_s_bound"] == pytest.approx(1 / max(flops / 2e9 + 96 / 1e9, pcie))


def test_rows_get_their_own_bound_on_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(None, BY_HAND)
    rows = [
        {"engine": "native", "ranks": 1, "samples_per_s": 1e5, "precision": "fp32", "hotline": None},
        {"engine": "hotline", "ranks": 1, "samples_per_s": 2e5, "precision": "fp32",
         "hotline": {"hot_hit_rate": 0.9}},
        {"engine": "host_embedding", "ranks": 1, "samples_per_s": 5e4, "precision": "fp32",
         "hotline": {"hot_hit_rate": 0.0}},
    ]
    bench.add_bounds(rows, cfg, GPU)
    native, hot, host = rows
    assert native["device_hit_rate"] == 1.0 and host["device_hit_rate"] == 0.0
    assert hot["pcie_bytes_per_sample"] == pytest.approx(56 + 2 * 0.3 * 8)
    for r in rows:
        assert r["fraction_of_bound"] == pytest.approx(r["samples_per_s"] / r["samples_per_s_bound"])
        assert r["hbm_gb_s"] == pytest.approx(r["samples_per_s"] * 96 / 1e9)
        assert r["pcie_gb_s"] == pytest.approx(r["samples_per_s"] * r["pcie_bytes_per_sample"] / 1e9)
    text = bench.format_gpu(GPU, rows)
    assert "made-up GPU" in text and "hotline / host_embedding at 1 rank(s): 4.00x" in text
    assert "hotline / native at 1 rank(s): 2.00x" in text


def test_rows_on_a_cpu_keep_the_machine_bound() -> None:
    cfg = load_config(None, BY_HAND)
    limit = {"samples_per_s_bound": 1000.0, "samples_per_s_bound_bf16": 2000.0}
    rows = [{"engine": "native", "ranks": 1, "samples_per_s": 500.0, "precision": "fp32"},
            {"engine": "native_bf16", "ranks": 1, "samples_per_s": 500.0, "precision": "bf16"}]
    bench.add_bounds(rows, cfg, limit)
    assert [r["fraction_of_bound"] for r in rows] == [0.5, 0.25]
    assert "hbm_gb_s" not in rows[0]


def test_a_row_above_its_bound_is_named_as_a_wrong_measurement() -> None:
    """The first H200 bench printed in_memory at 991% of its bound without a word (the
    meter timed queued CUDA-graph replays): a row past a measured bound is an error."""
    cfg = load_config(None, BY_HAND)
    limit = {"samples_per_s_bound": 1000.0, "samples_per_s_bound_bf16": 2000.0,
             "matmul_fp32_gflops": 1.0, "matmul_bf16_gflops": 2.0, "bandwidth_gb_s": 1.0,
             "flops_per_sample": 1.0, "embedding_bytes_per_sample": 1.0, "tf32": True}
    rows = [{"engine": "native", "ranks": 1, "samples_per_s": 900.0, "precision": "fp32"},
            {"engine": "in_memory", "ranks": 1, "samples_per_s": 9910.0, "precision": "fp32"}]
    bench.add_bounds(rows, cfg, limit)
    text = bench.format_limit(limit, rows)
    assert "mm fp32 (TF32)" in text and "in_memory@1 991.0%" in text
    warnings = [line for line in text.splitlines() if line.startswith("warning")]
    assert len(warnings) == 1 and "in_memory@1 above the bound" in warnings[0]
    assert "native@1 above" not in warnings[0]
    rows.pop()
    assert "warning" not in bench.format_limit(limit, rows)


@pytest.mark.slow
def test_cpu_limit_unchanged_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where CUDA is not available the limit is the CPU's, with the keys it always had."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    limit = limits.machine_limit(load_config(TINY, ["data.batch_size=64"]))
    assert set(limit) == {"matmul_fp32_gflops", "matmul_bf16_gflops", "bandwidth_gb_s",
                          "flops_per_sample", "embedding_bytes_per_sample", "lookups_per_sample",
                          "samples_per_s_bound", "samples_per_s_bound_bf16"}
    assert all(v > 0 for v in limit.values())


def test_torchrec_engines_skipped_with_a_line(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench, "torchrec_missing", lambda: "torchrec is not installed")
    kept = bench.runnable_engines(["native", "torchrec", "hotline", "torchrec_bf16"])
    assert kept == ["native", "hotline"]
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("skipping torchrec, torchrec_bf16: torchrec is")
    assert bench.runnable_engines(["native"]) == ["native"]
    assert main(["bench", "--config", str(TINY), "--engines", "torchrec"]) == 2  # nothing left
    assert "nothing to run without torchrec" in capsys.readouterr().err


BLOCKER = """
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torchrec", "fbgemm_gpu"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None

sys.meta_path.insert(0, Block())
from dlrm.bench.run import runnable_engines
print(runnable_engines(["native", "torchrec", "hotline", "host_embedding"]))
"""


def test_torchrec_found_missing_where_it_cannot_be_imported() -> None:
    """A fresh interpreter whose imports of torchrec and fbgemm_gpu fail (as on the GPU
    machine): the bench drops the TorchRec rows, saying why, and imports neither."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                     os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", BLOCKER], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    skip = ("skipping torchrec: torchrec is not installed (the native rows need neither "
            "torchrec nor fbgemm)")
    assert lines == [skip, "['native', 'hotline', 'host_embedding']"]


def test_rows_time_the_batches_after_hotline_s_profile_window(tmp_path) -> None:
    """configs/bench_gpu.yaml: 1M rows in batches of 4096 are 244 batches; a quarter
    (61) are Hotline's profile, then the 5 warm-up steps: 66 untimed steps for every
    row. A row's rate is the median of the log windows that start after them."""
    import json

    cfg = load_config(REPO / "configs" / "bench_gpu.yaml", [])
    assert bench.untimed_steps(cfg) == 1_000_000 // 4096 // 4 + 5 == 66
    events = [{"event": "train", "step": s, "window_samples_per_s": 1e6 if s <= 70 else float(s)}
              for s in range(10, 110, 10)]  # windows 61-70 and before: the all-hot profile's
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(e) for e in [*events, {"event": "summary", "steps": 100}]))
    row = bench.collect(metrics, untimed=60)
    assert row["windows"] == 4 and row["samples_per_s"] == 95.0  # 61-70 .. 91-100: 1e6, 80, 90, 100
    row = bench.collect(metrics, untimed=66)
    assert row["windows"] == 3 and row["samples_per_s"] == 90.0


def test_the_hotline_line_says_what_the_gather_waited_for() -> None:
    """The GPU session reads where a Hotline step's time went from this line: the
    gather's wait for the cold ids' copy (the device's split, a step ahead) is said
    where there was one (CUDA), and so are the step loop's and the gather's waits."""
    stats = {"hot_hit_rate": 0.954, "popular_share": 0.371, "gather_ms": 1.3, "transfer_ms": 0.2,
             "gather_hidden": 0.48, "gather_threads": 0.0, "gather_torch_threads": 16.0,
             "hot_tier_triton": 1.0, "split_ahead": 0.99, "gather_wait_ms": 0.79,
             "header_wait_ms": 0.02, "update_wait_ms": 0.65}
    row = {"engine": "hotline", "ranks": 1, "hotline": stats}
    line = bench._hotline_line(row)
    assert "host gather 1.3 ms/step, transfer 0.2 ms/step" in line and "cold ids" not in line
    assert "the step loop waited 0.79 ms/step for cold rows" in line and "the gather 0.65 for host updates" in line
    line = bench._hotline_line({**row, "hotline": {**stats, "ids_wait_ms": 0.9}})
    assert "host gather 1.3 ms/step (0.9 of it waiting for the cold ids' copy), transfer 0.2 ms/step" in line
    refresh = {**stats, "refreshes": 4.0, "refresh_pause_ms": 148.6, "refresh_wait_ms": 0.5, "plan_ms": 212.0,
               "count_ms": 1.234}
    line = bench._hotline_line({**row, "hotline": refresh})
    assert ("4 refreshes pausing 148.6 ms each (0.5 of it waiting for the plan; the planner 212 ms a plan, "
            "1.23 ms a step counting)") in line
    assert "pages" not in line  # no big host tensor: no share said
    line = bench._hotline_line({**row, "hotline": {**stats, "host_huge_pages": 0.0}})
    assert "gather in one call over 16 torch thread(s) from a host tier 0% on 2 MiB pages" in line
    assert "CPU a step" not in line  # not timed (a run before the clocks)
    # read in place (hotline.cold_path=mapped): no host gather, no copy, nothing to hide;
    # the step loop's time issuing the device's reads
    line = bench._hotline_line({**row, "hotline": {**stats, "cold_in_place": 1.0, "gather_ms": 0.0,
                                                     "transfer_ms": 0.04, "gather_hidden": 0.0}})
    assert ("read in place by the device (hotline.cold_path=mapped), 0.04 ms/step on the step loop issuing "
            "the reads, hot tier on triton") in line
    assert "host gather" not in line and "hidden" not in line
    clocks = {**stats, "loop_cpu_ms": 1.1, "loop_wall_ms": 2.4, "gather_cpu_ms": 0.5, "update_cpu_ms": 0.3}
    line = bench._hotline_line({**row, "hotline": clocks})
    assert ("CPU a step: the step loop 1.10 ms of its 2.40 ms, the gather thread 0.50, the update thread 0.30"
            in line)
    line = bench._hotline_line({**row, "hotline": {**clocks, "cold_in_place": 1.0}})  # the reads: the loop's own
    assert "CPU a step: the step loop 1.10 ms of its 2.40 ms, 0.50 of it in the reads, the update thread 0.30" in line
    for threads, said in ((1.0, "1 gather thread of ours"), (4.0, "4 gather threads of ours")):
        line = bench._hotline_line({**row, "hotline": {**stats, "gather_threads": threads}})
        assert said in line and "torch thread" not in line
