"""CUDA: the GPU paths against the CPU and against themselves (marker ``gpu``;
skipped without CUDA by tests/conftest.py; ``make test-gpu``, or on a machine with
its own torch ``PYTHONPATH=. python3 -m pytest -m gpu tests``).

    equal to CPU      one process on CUDA = the same run on the CPU: every sparse
                      optimizer x fused/kept x sum/mean pooling on mixed single- and
                      multi-hot data, and all-single-hot data (CUDA on the Triton
                      kernels, embeddings.kernels=auto; and on the torch path)
    Hotline on CUDA   = ordinary training on the GPU (every optimizer, refresh,
                      no pipeline, resume); the host tier pinned, cold rows copied
                      on a side stream; the copy hidden under the popular
                      micro-batch on the GPU's own timeline
    torchrun          --nproc_per_node=1 with train.backend=nccl, first tables
                      pinned to each strategy the planner allows at one rank
    sharded, 1 rank   ShardedEmbeddingCollection on CUDA = the local one on CPU,
                      per strategy
    checkpoints       saved on CUDA, evaluated and resumed on the CPU, and back

Tolerances: ``tests/gpu_cases.py`` says why 1e-4 (norm-wise) between devices.
Everything is small (configs/tiny.yaml, 12 steps): the set takes a few minutes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dlrm.cli import main
from dlrm.config import load_config
from tests import gpu_cases as cases
from tests.conftest import TINY
from tests.run_state import run_state

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def full_fp32_matmuls():
    """TF32 off (torch's default; a site setting could turn it on): the tolerances
    assume fp32 products."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


@pytest.fixture(scope="module")
def single_hot_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """configs/tiny.yaml's data with every sparse feature single-hot (multi_hot=0)."""
    from data.generate import generate_dataset

    root = tmp_path_factory.mktemp("single_hot")
    cfg = load_config(TINY, ["generate.multi_hot=0", "generate.row_group_rows=4096"])
    generate_dataset(str(root / "train"), cfg.generate, seed=11, rows=8192)
    return {"train": root / "train"}


# ------------------------------------------------------------------ CUDA = CPU


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("fused", ["true", "false"])
@pytest.mark.parametrize("optim", cases.OPTIMIZERS)
def test_cuda_equals_cpu(tiny_data, tmp_path: Path, optim: str, fused: str, pooling: str) -> None:
    """Mixed data: C1-C22 single-hot, C23-C26 bags of 0..5 ids (mean divides by the
    bag's length, an empty bag pools to zero)."""
    cases.device_equals_cpu(tiny_data, tmp_path, "cuda", f"optim.sparse={optim}",
                            f"embeddings.fused={fused}", f"embeddings.pooling={pooling}")


@pytest.mark.parametrize("optim", cases.OPTIMIZERS)
def test_cuda_equals_cpu_single_hot(single_hot_data, tmp_path: Path, optim: str) -> None:
    cases.device_equals_cpu(single_hot_data, tmp_path, "cuda", f"optim.sparse={optim}")


@pytest.mark.parametrize("optim", cases.OPTIMIZERS)
def test_cuda_torch_kernels_equal_cpu(tiny_data, tmp_path: Path, optim: str) -> None:
    """The CUDA runs above take the Triton kernels (embeddings.kernels=auto); the torch
    path on CUDA stays a choice, so it is checked too."""
    cases.device_equals_cpu(tiny_data, tmp_path, "cuda", f"optim.sparse={optim}", "embeddings.kernels=torch")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_cuda_half_tables_on_triton_close_to_cpu(tiny_data, tmp_path: Path, dtype: str) -> None:
    """Half tables on CUDA take the Triton kernels: fp32 pooling, the fused update with
    the torch path's stochastic rounding (same hash coordinates). The fp32 sums differ
    between devices in their last bits, which moves a rounding now and then, so the
    runs agree to the type's precision, not to DEVICE_RTOL."""
    cases.run(tiny_data, tmp_path / "cpu", "cpu", f"embeddings.dtype={dtype}", "optim.sparse=rowwise_adagrad")
    cases.run(tiny_data, tmp_path / "cuda", "cuda", f"embeddings.dtype={dtype}", "optim.sparse=rowwise_adagrad")
    cases.assert_runs_close(tmp_path / "cuda", tmp_path / "cpu", f"{dtype} cuda vs cpu", rtol=1e-2)


# ------------------------------------------------------------------ Hotline on CUDA


@pytest.mark.parametrize("optim", cases.OPTIMIZERS)
def test_hotline_on_cuda_equals_ordinary_training(tiny_data, tmp_path: Path, optim: str) -> None:
    summary = cases.hotline_equals_plain(tiny_data, tmp_path, "cuda", f"optim.sparse={optim}",
                                         evaluate=optim == "sgd")
    assert 0.5 < summary["hotline"]["hot_hit_rate"] < 1.0


@pytest.mark.parametrize("extra", [("hotline.refresh_every=5",), ("hotline.pipeline=false",),
                                   ("embeddings.pooling=mean",)])
def test_hotline_on_cuda_refresh_no_pipeline_mean(tiny_data, tmp_path: Path, extra) -> None:
    cases.hotline_equals_plain(tiny_data, tmp_path, "cuda", "optim.sparse=rowwise_adagrad", *extra)


def test_hotline_on_cuda_resumes_exactly(tiny_data, tmp_path: Path) -> None:
    cases.hotline_resume(tiny_data, tmp_path, "cuda")


def test_hotline_host_tier_pageable_and_cold_rows_on_a_side_stream(
    tiny_data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cases.host_tier_and_cold_copy(tiny_data, tmp_path, "cuda", monkeypatch)


def test_hotline_gather_and_copy_hidden_under_the_step_s_hot_side(tiny_data, tmp_path: Path) -> None:
    """Two measures of one run (8 steps, steps 3-6 under torch.profiler; the default
    graph options, so on a GPU the dense model and the splits are graphed):

    - the trainer's ``gather_hidden``: 1 - (time the step waited for the host thread)
      / (host gather + copy time), wall clock on the host: > 0 means part of the
      gather ran while the step's hot lookups and bottom MLP were dispatched;
    - the GPU's own timeline (CUDA activity of the Chrome trace, which CUPTI stamps
      on the device): the cold rows' host-to-device copies run on a stream of their
      own, from pinned memory. How much of their time ran under a kernel is printed,
      not asserted: this tiny model's step is host-bound, so the SMs idle between
      kernels and a copy of a few µs lands in such a gap. (The Hotline paper's step,
      whose copies fell under the popular micro-batch's span, is gone: one pass.)"""
    summary = cases.run(tiny_data, tmp_path / "hot", "cuda", *cases.HOTLINE, *cases.TIMELINE, steps=8)
    stats = summary["hotline"]
    assert 0.2 < stats["popular_share"] < 0.9, stats  # both kinds of samples non-trivial
    assert stats["gather_ms"] > 0 and stats["transfer_ms"] > 0, stats
    assert stats["gather_hidden"] > 0, stats
    assert 0 <= stats["ids_wait_ms"] <= stats["gather_ms"], stats  # a part of the gather's time
    timeline = cases.gpu_timeline(tmp_path / "hot" / "profile" / "rank-0.json")
    copies = timeline["cold_copies"]
    print(f"hotline timeline: {len(copies)} cold copies, {timeline['overlapped']:.0%} of their time under "
          f"compute kernels; step {summary['step_mode']}; stats {json.dumps(stats)}")
    assert timeline["kernels"] > 0 and copies, timeline
    assert all("Pinned" in name for _, _, name in copies), copies  # DMA from page-locked memory


# ------------------------------------------------------------------ torchrun, NCCL


@pytest.fixture(scope="module")
def one_process_cuda(tiny_data, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("one_process") / "run"
    cases.run(tiny_data, out, "cuda")
    return out


@pytest.mark.parametrize("strategy", cases.STRATEGIES)
def test_torchrun_one_rank_nccl_equals_one_process(tiny_data, tmp_path: Path, one_process_cuda: Path,
                                                   strategy: str) -> None:
    """At world size 1 dlrm/parallel/distributed.py makes no process group and
    build_model uses the local collection, so this checks the launch (torchrun's
    environment, LOCAL_RANK 0 → cuda:0, train.backend=nccl accepted), not NCCL
    collectives or the strategy's code: those need 2+ GPUs (NCCL refuses two ranks
    on one GPU). The strategies' own code on CUDA is the next test."""
    cases.skip_unless_planned(tiny_data, strategy)
    run = cases.torchrun_one_rank(tiny_data, tmp_path, "cuda", "nccl", strategy)
    summary = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["event"] == "summary" and summary["steps"] == cases.STEPS
    cases.assert_runs_close(run, one_process_cuda, f"torchrun nccl {strategy}")


@pytest.mark.parametrize("strategy", cases.STRATEGIES)
def test_sharded_collection_on_cuda_equals_local_on_cpu(tiny_data, strategy: str) -> None:
    cases.skip_unless_planned(tiny_data, strategy)
    cases.sharded_collection_equals_local(tiny_data, "cuda", strategy)


# ------------------------------------------------------------------ checkpoints


def test_checkpoint_saved_on_cuda_evaluates_on_cpu(tiny_data, tmp_path: Path, capsys) -> None:
    """Trained with train.device=cuda: ``dlrm eval --device cpu`` here, and in a
    process that sees no GPU at all (CUDA_VISIBLE_DEVICES empty), give the metrics
    of the evaluation on the GPU; the parameters read on the CPU are the GPU's."""
    run = tmp_path / "gpu"
    cases.run(tiny_data, run, "cuda", "optim.sparse=adam", steps=6)
    evals = cases.evals_on_the_cpu(run, str(tiny_data["eval"]), capsys)
    cases.assert_metrics_close(evals["cpu"], evals["run"], "cpu vs gpu eval")
    cases.assert_metrics_close(evals["no_gpu"], evals["run"], "no-GPU process vs gpu eval")
    state = run_state(run)  # loaded into a CPU model
    assert all(t.device.type == "cpu" for t in state.values())


def test_checkpoint_saved_on_cpu_evaluates_on_cuda(tiny_data, tmp_path: Path, capsys) -> None:
    run = tmp_path / "cpu"
    cases.run(tiny_data, run, "cpu", "optim.sparse=rowwise_adagrad", steps=6)
    data = str(tiny_data["eval"])
    assert main(["eval", "--checkpoint", str(run), "--data", data]) == 0
    on_cpu = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["eval", "--checkpoint", str(run), "--data", data, "--device", "cuda"]) == 0
    on_gpu = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cases.assert_metrics_close(on_gpu, on_cpu, "gpu vs cpu eval")


@pytest.mark.parametrize("first,then", [("cuda", "cpu"), ("cpu", "cuda")])
def test_resume_on_the_other_device(tiny_data, tmp_path: Path, first: str, then: str) -> None:
    cases.resume_elsewhere(tiny_data, tmp_path, first, then)


def test_hotline_checkpoint_from_cuda_resumes_on_cpu(tiny_data, tmp_path: Path) -> None:
    """Hotline's hot rows live on the GPU; its checkpoint holds whole tables, so a
    CPU run (ordinary placement) continues it: equal to a straight Hotline run on
    the GPU, within the device tolerance."""
    extra = ("optim.sparse=rowwise_adagrad",)
    cases.run(tiny_data, tmp_path / "straight", "cuda", *cases.HOTLINE, *extra)
    cases.run(tiny_data, tmp_path / "moved", "cuda", *cases.HOTLINE, *extra, steps=5)
    cases.run(tiny_data, tmp_path / "moved", "cpu", *extra)
    cases.assert_close_norm(run_state(tmp_path / "moved"), run_state(tmp_path / "straight"),
                            "hotline cuda → plain cpu")


# ------------------------------------------------------------------ dlrm bench on the GPU


def test_cuda_limit_measures_the_gpu() -> None:
    from dlrm.bench.limits import machine_limit

    cfg = load_config(TINY, ["data.batch_size=8192", "model.bottom_mlp=[1024,16]"])
    limit = machine_limit(cfg)
    print(json.dumps(limit, indent=1))
    assert limit["device"] == torch.cuda.get_device_name()
    for key in ("matmul_fp32_gflops", "matmul_bf16_gflops", "hbm_gb_s", "h2d_pinned_gb_s",
                "d2h_pinned_gb_s", "samples_per_s_bound", "samples_per_s_bound_bf16"):
        assert limit[key] > 0, key
    assert limit["hbm_gb_s"] > limit["h2d_pinned_gb_s"]  # HBM against PCIe (or C2C)


def test_bench_gpu_rows(tmp_path: Path, capsys) -> None:
    """The bench's three GPU rows on the tiny model (1MB of hot rows), 20 steps each:
    every row with its share of lookups on the GPU, bytes per sample and bound."""
    code = main(["bench", "--config", str(TINY), "--engines", "native,hotline,host_embedding",
                 "--steps", "20", "--out", str(tmp_path), "generate.rows=20000",
                 "generate.row_group_rows=4096", "hotline.budget=1MB"])
    assert code == 0
    out = capsys.readouterr().out
    assert "gpu: " in out and "hotline / host_embedding at 1 rank(s)" in out, out[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["engine"]: r for r in report["rows"]}
    assert rows["native"]["device_hit_rate"] == 1.0
    assert rows["host_embedding"]["device_hit_rate"] == 0.0
    assert 0.5 < rows["hotline"]["device_hit_rate"] < 1.0
    assert (rows["native"]["pcie_bytes_per_sample"] < rows["hotline"]["pcie_bytes_per_sample"]
            < rows["host_embedding"]["pcie_bytes_per_sample"])
    for r in rows.values():
        assert r["samples_per_s"] > 0 and r["fraction_of_bound"] > 0 and r["hbm_gb_s"] > 0
        assert r["peak_memory_mb"][0] > 0  # CUDA allocations: the rows ran on the GPU


# ------------------------------------------------------------------ the dense side


@pytest.mark.parametrize("dense", ["sgd", "adagrad", "adam"])
def test_dense_optimizer_fused_on_cuda(dense: str) -> None:
    from dlrm.train.optim import build_dense_optimizer

    cfg = load_config(TINY, [f"optim.dense={dense}"])
    params = [torch.nn.Parameter(torch.randn(4, 4, device="cuda"))]
    opt = build_dense_optimizer(cfg, params)
    from dlrm.train.adagrad import DeviceAdagrad
    from dlrm.train.optim import fused_adagrad_runs  # torch's CUDA Adagrad kernel came in 2025

    if dense == "adagrad" and not fused_adagrad_runs(params[0].device):
        assert isinstance(opt, DeviceAdagrad)
    else:
        assert opt.defaults["fused"] is True
    cpu = build_dense_optimizer(cfg, [torch.nn.Parameter(torch.randn(4, 4))])
    assert bool(cpu.defaults.get("fused")) is (dense != "sgd") and not cpu.defaults.get("foreach")


@pytest.mark.parametrize("tf32", [True, False])
def test_train_tf32_setting(tiny_data, tmp_path: Path, tf32: bool) -> None:
    cases.run(tiny_data, tmp_path, "cuda", f"train.tf32={str(tf32).lower()}", steps=2)
    assert torch.backends.cuda.matmul.allow_tf32 is tf32


# ------------------------------------------------------------------ CUDA graphs


def test_graph_replayed_training_equals_eager(single_hot_data, tmp_path: Path) -> None:
    """Single-hot data (static shapes): 12 steps, captured at step 3 and replayed, equal
    12 eager steps (the same kernels in the same order), and no step syncs the host
    once captured (the replay is one launch)."""
    # every dense optimizer: Adagrad (tiny's) torch's fused kernel or, where this torch
    # has none on CUDA, dlrm/train/adagrad.py (the 2026-11-27 H200: eager, 0.30x graphed)
    for dense in ("sgd", "adam", "adagrad"):
        graphed = cases.run(single_hot_data, tmp_path / f"g{dense}", "cuda", "train.cuda_graphs=on",
                            f"optim.dense={dense}")
        eager = cases.run(single_hot_data, tmp_path / f"e{dense}", "cuda", "train.cuda_graphs=off",
                          f"optim.dense={dense}")
        assert graphed["step_mode"].startswith("graphs: captured at step 3"), graphed["step_mode"]
        assert "0 other-shape steps eager" in graphed["step_mode"], graphed["step_mode"]
        assert "ms of GPU time a replay" in graphed["step_mode"], graphed["step_mode"]  # graphs.ReplayTimer
        assert eager["step_mode"] == "eager (train.cuda_graphs=off)"
        cases.assert_runs_close(tmp_path / f"g{dense}", tmp_path / f"e{dense}", f"graphs vs eager, {dense}",
                                rtol=1e-5)
    # bf16 tables: the rounding's step count lives on the device, so a replay rounds anew
    graphed = cases.run(single_hot_data, tmp_path / "gbf16", "cuda", "train.cuda_graphs=on", "optim.dense=sgd",
                        "embeddings.dtype=bf16")
    cases.run(single_hot_data, tmp_path / "ebf16", "cuda", "train.cuda_graphs=off", "optim.dense=sgd",
              "embeddings.dtype=bf16")
    assert graphed["step_mode"].startswith("graphs: captured at step 3"), graphed["step_mode"]
    cases.assert_runs_close(tmp_path / "gbf16", tmp_path / "ebf16", "graphs vs eager, bf16", rtol=1e-5)


def test_hotline_with_the_dense_model_graphed_equals_eager(tiny_data, tmp_path: Path) -> None:
    """hotline.graph_dense: the dense model's halves replayed as CUDA graphs inside the
    eager Hotline step (dlrm/train/dense_graphs.py) train as the eager step does (the
    same kernels; the tolerance of the graph test above), and the summary says the
    graphs ran: by default (``auto``) on a GPU. tiny's batch (64) divides its data:
    every step replays."""
    graphed = cases.run(tiny_data, tmp_path / "g", "cuda", *cases.EAGER_HOTLINE, "hotline.graph_split=off")
    cases.run(tiny_data, tmp_path / "e", "cuda", *cases.EAGER_HOTLINE, "hotline.graph_dense=off",
              "hotline.graph_split=off")
    assert "dense model graphed" in graphed["step_mode"], graphed["step_mode"]
    cases.assert_runs_close(tmp_path / "g", tmp_path / "e", "hotline graph_dense vs eager", rtol=1e-5)


@pytest.mark.parametrize("placement", ["native", "hotline"])
def test_bf16_autocast_under_graphs_equals_eager(single_hot_data, tmp_path: Path, placement: str) -> None:
    """train.precision=bf16 under the graphs: the native step captured whole, and
    Hotline's dense halves (hotline.graph_dense, captured with the cast cache off), train
    as the same runs eager. The same bf16 kernels: the tolerance leaves room for cuBLAS
    picking another bf16 algorithm under capture, no more."""
    bf16 = ("train.precision=bf16", "optim.dense=sgd")
    if placement == "native":
        on, off = ("train.cuda_graphs=on",), ("train.cuda_graphs=off",)
    else:
        on = (*cases.EAGER_HOTLINE, "hotline.graph_dense=on", "hotline.graph_split=off")
        off = (*cases.EAGER_HOTLINE, "hotline.graph_dense=off", "hotline.graph_split=off")
    graphed = cases.run(single_hot_data, tmp_path / "g", "cuda", *bf16, *on)
    cases.run(single_hot_data, tmp_path / "e", "cuda", *bf16, *off)
    assert ("graphs: captured" if placement == "native" else "dense model graphed") in graphed["step_mode"], \
        graphed["step_mode"]
    cases.assert_runs_close(tmp_path / "g", tmp_path / "e", f"{placement} bf16 autocast graphed vs eager", rtol=1e-3)


@pytest.mark.parametrize("dtypes", [(), ("embeddings.dtypes.C1=fp16", "embeddings.dtype=bf16")],
                         ids=["one_dtype", "several_dtypes"])
def test_hotline_with_splits_and_dense_model_graphed_equals_eager(single_hot_data, tmp_path: Path,
                                                                  dtypes: tuple[str, ...]) -> None:
    """hotline.graph_split and graph_dense on single-hot data (every split the captured
    shape): the splits replayed as CUDA graphs (two, in turn; dlrm/train/split_graphs.py)
    and the dense halves too train as the eager step does, with a refresh in between
    (the graphs captured again against the new hot ids). Several table dtypes: the
    joint split, each group cut at the captured runs."""
    both = ("hotline.graph_split=true", "hotline.graph_dense=true", "hotline.refresh_every=5")
    graphed = cases.run(single_hot_data, tmp_path / "g", "cuda", *cases.EAGER_HOTLINE, *both, *dtypes)
    cases.run(single_hot_data, tmp_path / "e", "cuda", *cases.EAGER_HOTLINE, "hotline.refresh_every=5",
              "hotline.graph_dense=false", "hotline.graph_split=false", *dtypes)
    assert graphed["hotline"]["split_graphed"] > 0.5, graphed["hotline"]
    assert "dense model graphed" in graphed["step_mode"], graphed["step_mode"]
    assert "splits graphed" in graphed["step_mode"], graphed["step_mode"]
    cases.assert_runs_close(tmp_path / "g", tmp_path / "e", "hotline graphs vs eager", rtol=1e-5)


@pytest.mark.parametrize("name,extra", [
    ("mixed", ("embeddings.dtypes.C1=fp32", "embeddings.dtypes.C2=fp16", "embeddings.dtype=bf16")),
    ("state", ("optim.sparse=adam", "embeddings.state_dtype=bf16", "embeddings.dtypes.C1=fp16")),
])
def test_graph_replay_with_mixed_dtypes_equals_eager(single_hot_data, tmp_path: Path, name: str, extra) -> None:
    """One process with tables of several dtypes (DtypeStacks: every stack's kernels
    take the whole batch, nothing routed by the host) and half Adam state (rounded in
    the fused update), captured at step 3 and replayed: equal to the eager run."""
    graphed = cases.run(single_hot_data, tmp_path / "g", "cuda", "train.cuda_graphs=on", "optim.dense=sgd", *extra)
    cases.run(single_hot_data, tmp_path / "e", "cuda", "train.cuda_graphs=off", "optim.dense=sgd", *extra)
    assert graphed["step_mode"].startswith("graphs: captured at step 3"), graphed["step_mode"]
    assert "0 other-shape steps eager" in graphed["step_mode"], graphed["step_mode"]
    cases.assert_runs_close(tmp_path / "g", tmp_path / "e", f"graphs vs eager, {name}", rtol=1e-5)


# ------------------------------------------------------------------ 2 ranks, one GPU


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", cases.STRATEGIES)
def test_two_ranks_sharing_the_gpu_equal_one_process(tiny_data, tmp_path: Path, strategy: str) -> None:
    """torchrun --nproc_per_node=2 on the one GPU with gloo (collectives through the
    host), the first tables pinned to each strategy, reading the global batches one
    process reads (data.order_world_size=2): the same parameters as that process."""
    order = "data.order_world_size=2"
    two = cases.torchrun_one_rank(tiny_data, tmp_path, "cuda", "gloo", strategy, 2, order)
    one = cases.run(tiny_data, tmp_path / "one", "cuda", order)
    cases.assert_runs_close(two, tmp_path / "one", f"2 ranks on one GPU, {strategy}")
    assert one["world_size"] == 1


# ------------------------------------------------------------------ half tables on CUDA (issue 24)


HALF = ("embeddings.dtypes.C1=fp32", "embeddings.dtypes.C2=fp16", "embeddings.dtype=bf16")


@pytest.mark.parametrize("extra", [HALF, ("embeddings.state_dtype=bf16", "optim.sparse=adam")])
def test_half_tables_and_state_on_cuda_equal_cpu(tiny_data, tmp_path: Path, extra) -> None:
    """Per-table dtypes (several stacks) and bf16 Adam state (the fused Triton update)
    on CUDA: close to the CPU run (stochastic rounding flips where fp32 sums differ in
    the last bit)."""
    cases.device_equals_cpu(tiny_data, tmp_path, "cuda", *extra)


def test_hotline_bf16_on_cuda_equals_ordinary_training(tiny_data, tmp_path: Path) -> None:
    """Hot rows in bf16 on the GPU, cold rows in bf16 in pinned host memory."""
    cases.hotline_equals_plain(tiny_data, tmp_path, "cuda", "optim.sparse=rowwise_adagrad", "embeddings.dtype=bf16")


def test_hotline_mixed_dtypes_on_cuda_equals_ordinary_training(tiny_data, tmp_path: Path) -> None:
    """Per-table dtypes under Hotline: a hot tier per dtype on the GPU, a host tier per
    dtype in pinned host memory, the mini-batch split jointly on the device; against
    ordinary training (DtypeStacks). Row-wise Adagrad: Adam turns the micro-batches'
    other fp32 summation order into larger differences of near-zero gradients, which
    stochastic rounding then makes discrete (on the CPU a single-dtype bf16 Adam run is
    3e-3 from plain), past this tolerance."""
    cases.hotline_equals_plain(tiny_data, tmp_path, "cuda", *HALF, "optim.sparse=rowwise_adagrad")
