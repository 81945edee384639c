"""The GPU tests' bodies (tests/gpu_cases.py) run CPU against CPU, so that a mistake
of a body itself (an override the config refuses, a key that is not there, the
wrong runs compared, a trace parsed wrongly) shows on a machine without a GPU,
before a GPU session spends its time on it. One case of each body; the CUDA set
is tests/test_gpu.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import gpu_cases as cases


@pytest.mark.slow
def test_device_equals_cpu_body(tiny_data, tmp_path: Path) -> None:
    cases.device_equals_cpu(tiny_data, tmp_path, "cpu", "optim.sparse=adam", "embeddings.fused=false",
                            "embeddings.pooling=mean")


@pytest.mark.slow
def test_hotline_bodies(tiny_data, tmp_path: Path) -> None:
    cases.hotline_equals_plain(tiny_data, tmp_path / "eq", "cpu", "optim.sparse=sgd",
                               "hotline.refresh_every=5", "embeddings.pooling=mean", evaluate=True)
    cases.hotline_resume(tiny_data, tmp_path / "resume", "cpu")


def test_host_tier_body(tiny_data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cases.host_tier_and_cold_copy(tiny_data, tmp_path, "cpu", monkeypatch)


@pytest.mark.slow
def test_resume_elsewhere_body(tiny_data, tmp_path: Path) -> None:
    cases.resume_elsewhere(tiny_data, tmp_path, "cpu", "cpu")


@pytest.mark.parametrize("strategy", cases.STRATEGIES)
def test_sharded_collection_body(tiny_data, strategy: str) -> None:
    cases.skip_unless_planned(tiny_data, strategy)
    cases.sharded_collection_equals_local(tiny_data, "cpu", strategy, steps=2)


@pytest.mark.slow
def test_eval_device_flag_and_a_process_without_cuda(tiny_data, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    cases.run(tiny_data, run, "cpu", steps=3)
    evals = cases.evals_on_the_cpu(run, str(tiny_data["eval"]), capsys)
    cases.assert_metrics_close(evals["cpu"], evals["run"], "--device cpu")
    cases.assert_metrics_close(evals["no_gpu"], evals["run"], "no CUDA device")


@pytest.mark.slow
def test_timeline_model_splits_both_ways(tiny_data, tmp_path: Path) -> None:
    """The GPU timeline test's model (wide MLPs, batch 4096, 1500KB of hot rows): popular
    samples and the others each hold a good share of the batch, and its profiler
    settings are accepted (on the CPU the trace has no CUDA activity)."""
    summary = cases.run(tiny_data, tmp_path / "hot", "cpu", *cases.HOTLINE, *cases.TIMELINE, steps=5)
    stats = summary["hotline"]
    assert 0.2 < stats["popular_share"] < 0.9, stats
    assert (tmp_path / "hot" / "profile" / "rank-0.json").is_file()


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_one_rank_body(tiny_data, tmp_path: Path) -> None:
    """The torchrun body with gloo on the CPU, against one process."""
    cases.skip_unless_planned(tiny_data, "row_wise")
    run = cases.torchrun_one_rank(tiny_data, tmp_path, "cpu", "gloo", "row_wise")
    cases.run(tiny_data, tmp_path / "one", "cpu")
    cases.assert_runs_close(run, tmp_path / "one", "torchrun gloo row_wise")


def test_gpu_timeline_reads_a_trace(tmp_path: Path) -> None:
    """Kernels on stream 7 (the compute stream: most kernel time), a pinned copy on
    stream 20 (no kernels: the cold rows' copy stream) half under a kernel and three
    quarters inside the popular micro-batch's device span (120..160); not cold copies:
    a pageable batch copy on stream 7, a pinned batch copy on stream 9 (Hotline's split
    stream, which runs the classification's kernels)."""
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 100.0, "dur": 50.0, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 200.0, "dur": 50.0, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "sort", "ts": 0.0, "dur": 5.0, "args": {"stream": 9}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 80.0,
         "dur": 5.0, "args": {"stream": 9}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 130.0,
         "dur": 40.0, "args": {"stream": 20}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "ts": 90.0,
         "dur": 5.0, "args": {"stream": 7}},
        {"ph": "i", "cat": "cpu_op", "name": "marker", "ts": 1.0},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "hotline.popular", "ts": 120.0, "dur": 40.0,
         "args": {"stream": 7}},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "hotline.non_popular", "ts": 160.0,
         "dur": 100.0, "args": {"stream": 7}},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    timeline = cases.gpu_timeline(path)
    assert timeline["compute_stream"] == 7 and timeline["kernels"] == 2
    assert [name for _, _, name in timeline["cold_copies"]] == ["Memcpy HtoD (Pinned -> Device)"]
    assert timeline["overlapped"] == pytest.approx(0.5)  # 130..150 of 130..170
    assert timeline["popular"] == [(120.0, 160.0)]
    assert timeline["under_popular"] == pytest.approx(0.75)  # 130..160 of 130..170


@pytest.mark.slow
def test_trainer_names_hotline_passes_in_a_trace(tiny_data, tmp_path: Path) -> None:
    """The trainer names Hotline's one pass over the mini-batch (record_function), as
    the GPU timeline test finds it; on the CPU the names show as user annotations."""
    cases.run(tiny_data, tmp_path, "cpu", *cases.HOTLINE, "hotline.budget=1500KB",
              "hotline.profile_fraction=1.0", "train.profile_start=2", "train.profile_steps=2", steps=4)
    events = json.loads((tmp_path / "profile" / "rank-0.json").read_text())["traceEvents"]
    names = [e.get("name") for e in events if e.get("cat") == "user_annotation"]
    assert names.count("hotline.mini_batch") == 2 and "hotline.popular" not in names, names


@pytest.mark.slow
def test_half_tables_bodies(tiny_data, tmp_path: Path) -> None:
    """The bodies of test_gpu.py's half-table cases, CPU against CPU."""
    cases.device_equals_cpu(tiny_data, tmp_path / "mixed", "cpu", "embeddings.dtypes.C1=fp32",
                            "embeddings.dtypes.C2=fp16", "embeddings.dtype=bf16")
    cases.device_equals_cpu(tiny_data, tmp_path / "state", "cpu", "embeddings.state_dtype=bf16", "optim.sparse=adam")
    cases.hotline_equals_plain(tiny_data, tmp_path / "hot", "cpu", "optim.sparse=rowwise_adagrad",
                               "embeddings.dtype=bf16")
    cases.hotline_equals_plain(tiny_data, tmp_path / "hot-mixed", "cpu", "embeddings.dtypes.C1=fp32",
                               "embeddings.dtypes.C2=fp16", "embeddings.dtype=bf16", "optim.sparse=rowwise_adagrad")
