"""Bodies of the GPU tests, each taking the device to run on, so that the same code
runs on CUDA in ``tests/test_gpu.py`` (marker ``gpu``) and CPU against CPU in
``tests/test_gpu_dryrun.py``, which catches most of a body's own mistakes (a bad
override, a wrong key, a comparison of the wrong runs) on a machine without a GPU.

Everything goes through public entry points: ``dlrm.train.trainer.train``, the
``dlrm`` CLI, ``build_model``, the collections' constructors; sparse inputs come
from the reader, whatever jagged type it produces.

Tolerances (``DEVICE_RTOL``, norm-wise per tensor, ``||got - want|| <= rtol ||want||``):
a CUDA run and a CPU run of the same steps are not bit-equal. cuBLAS and MKL sum a
matmul's K products in different orders (blocking, split-K), CUDA's index_add,
embedding_bag backward and scatter use atomics whose order changes from run to run,
and exp/log differ in the last ulp; each is about 1e-7 relative (fp32 epsilon
1.2e-7) per operation, and growth through 12 steps of Adagrad/Adam (which divide
by the root of small squared gradients) stays under 1e-5 in practice (the same
amplification is what ``tests/run_state.py`` allows between rank counts). 1e-4
leaves a margin of 10 and still catches a real bug: one row updated wrongly in one
table of the tiny model moves that table by about 3e-3 of its norm. TF32 is off
(``torch.set_float32_matmul_precision("highest")``, the default): with it, matmuls
keep 10 mantissa bits and the runs differ by 1e-3.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dlrm.config import load_config
from dlrm.train.trainer import train
from tests.conftest import REPO, TINY, tiny_overrides
from tests.run_state import run_state

DEVICE_RTOL = 1e-4  # CUDA against CPU, or two CUDA runs (atomics): see the module docstring
STEPS = 12
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
STRATEGIES = ("table_wise", "column_wise", "row_wise", "data_parallel")
HOTLINE = ("embeddings.placement=hotline", "hotline.budget=1MB", "hotline.fill_unseen=false")
# The eager Hotline step, whose parts hotline.graph_dense and graph_split graph (on a GPU
# the default, graph_step=auto, captures the whole step instead)
EAGER_HOTLINE = (*HOTLINE, "hotline.graph_step=off")

# A popular micro-batch that keeps the GPU busy (wide MLPs, batch 4096) beside a
# non-popular one with cold rows: 1500KB of hot rows chosen from every training batch
# make about 70% of tiny's samples popular (measured on its data: 1MB gives 18%).
TIMELINE = ("data.batch_size=4096", "model.bottom_mlp=[1024,512,16]",
            "model.top_mlp=[2048,2048,1024,1]", "hotline.budget=1500KB",
            "hotline.profile_fraction=1.0", "train.profile_start=3", "train.profile_steps=4")


# ------------------------------------------------------------------ runs


def run(data: dict[str, Path], out: Path, device: str, *extra: str, steps: int = STEPS) -> dict:
    """``steps`` steps of configs/tiny.yaml on ``device``; the trainer's summary."""
    cfg = load_config(TINY, tiny_overrides(**{"data.train": data["train"], "data.eval": ""})
                      + [f"train.max_steps={steps}", "train.log_every=4", f"train.device={device}",
                         "train.tf32=false", *extra])  # the tolerances assume fp32 products
    return train(cfg, out, echo=lambda s: None)


def losses(run_dir: Path) -> list[float]:
    """The logged mean loss of every window (train.log_every steps)."""
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [e["loss"] for e in events if e["event"] == "train"]


def assert_close_norm(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str,
                      rtol: float = DEVICE_RTOL) -> None:
    """Every tensor within ``rtol`` of ``want``, norm-wise (on the CPU, in float64)."""
    assert got.keys() == want.keys(), (label, sorted(set(got) ^ set(want)))
    relative, failed = {}, []
    for key, expected in want.items():
        a, b = got[key].detach().cpu().double(), expected.detach().cpu().double()
        assert a.shape == b.shape, f"{label} {key}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        diff, scale = float((a - b).norm()), float(b.norm())
        relative[key] = diff / max(scale, 1e-30)
        if diff > rtol * scale + 1e-7:
            failed.append(f"{key}: |diff| {diff:.3g} vs |want| {scale:.3g}")
    # every tensor's figure on a failure, the worst first: whether the tables or the MLPs
    # moved first tells a sparse-side fault from rounding the dense side amplified
    worst = sorted(relative.items(), key=lambda kv: -kv[1])
    assert not failed, (f"{label}: {len(failed)} of {len(relative)} tensors past {rtol:g}: " + "; ".join(failed[:3])
                        + " | worst: " + ", ".join(f"{k} {v:.1e}" for k, v in worst[:8]))
    print(f"{label}: worst relative difference {worst[0][1]:.2e} (allowed {rtol:g})")


def assert_runs_close(got: Path, want: Path, label: str, rtol: float = DEVICE_RTOL) -> None:
    """Two finished runs: every parameter and optimizer state (read on the CPU from
    their checkpoints, whatever device wrote them) and every logged loss."""
    assert_close_norm(run_state(got), run_state(want), label, rtol)
    torch.testing.assert_close(losses(got), losses(want), rtol=rtol, atol=1e-6,
                               msg=lambda m: f"{label} losses: {m}")


# ------------------------------------------------------------------ bodies


# Sparse Adam divides by the root of its second moment, which for a near-zero, partly
# cancelled gradient is rounding-sized: such an element steps by about lr either way,
# and the tables' difference reaches the MLPs. The 2026-11-26 H200 run: adam, fused, mean
# pooling, 1.33e-4 on the bottom MLP's first weight (the other Adam cases under 1e-4).
# 3e-4 still leaves a real bug (one row updated wrongly: ~3e-3) ten times over.
OPTIMIZER_RTOL = {"optim.sparse=adam": 3e-4}


def device_equals_cpu(data: dict[str, Path], tmp: Path, device: str, *extra: str) -> None:
    """One process on ``device`` against the same run on the CPU."""
    run(data, tmp / "cpu", "cpu", *extra)
    run(data, tmp / device, device, *extra)
    rtol = max([DEVICE_RTOL, *(OPTIMIZER_RTOL.get(x, 0.0) for x in extra)])
    assert_runs_close(tmp / device, tmp / "cpu", f"{device} vs cpu {extra}", rtol)


def hotline_equals_plain(data: dict[str, Path], tmp: Path, device: str, *extra: str,
                         evaluate: bool = False) -> dict:
    """Hotline (hot rows on ``device``, the rest in host memory) against ordinary
    training on the same device (``evaluate``: and its end-of-run eval, where Hotline
    looks cold rows up inline); the Hotline run's summary."""
    if evaluate:
        extra = (*extra, f"data.eval={data['eval']}")
    plain = run(data, tmp / "plain", device, *extra)
    summary = run(data, tmp / "hot", device, *HOTLINE, *extra)
    assert_runs_close(tmp / "hot", tmp / "plain", f"hotline on {device} {extra}")
    if evaluate:
        metrics = {k.removeprefix("eval_"): v for k, v in summary.items() if k.startswith("eval_")}
        want = {k.removeprefix("eval_"): v for k, v in plain.items() if k.startswith("eval_")}
        assert_metrics_close(metrics, want, f"hotline eval on {device}")
    stats = summary["hotline"]
    assert 0.0 < stats["popular_share"] < 1.0, stats  # both micro-batches really ran
    return summary


def hotline_resume(data: dict[str, Path], tmp: Path, device: str) -> None:
    """Hotline stopped at step 5 and resumed equals Hotline never stopped."""
    run(data, tmp / "straight", device, "optim.sparse=adam", *HOTLINE)
    run(data, tmp / "resumed", device, "optim.sparse=adam", *HOTLINE, steps=5)
    run(data, tmp / "resumed", device, "optim.sparse=adam", *HOTLINE)
    # Parameters only: a resumed run's loss windows are cut at the restart.
    assert_close_norm(run_state(tmp / "resumed"), run_state(tmp / "straight"),
                      f"hotline resume on {device}")


def resume_elsewhere(data: dict[str, Path], tmp: Path, first: str, then: str) -> None:
    """5 steps on ``first``, resumed on ``then`` to step 12, against 12 steps on
    ``then``: the checkpoint (dense and embedding state, Adam's too) moves devices."""
    extra = ("optim.sparse=adam", "optim.dense=adam")
    run(data, tmp / "straight", then, *extra)
    run(data, tmp / "moved", first, *extra, steps=5)
    run(data, tmp / "moved", then, *extra)
    assert_close_norm(run_state(tmp / "moved"), run_state(tmp / "straight"), f"{first} then {then}")


def eval_json(args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """``dlrm eval ARGS`` in a fresh interpreter (``env``: e.g. no CUDA device); its JSON."""
    env = {**os.environ, **(env or {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "dlrm", "eval", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def evals_on_the_cpu(run_dir: Path, data: str, capsys: Any) -> dict[str, dict[str, Any]]:
    """``dlrm eval`` of one checkpoint: on the run's own device ("run"), with
    ``--device cpu`` ("cpu"), and with it in a process that sees no GPU ("no_gpu")."""
    from dlrm.cli import main

    args = ["--checkpoint", str(run_dir), "--data", data]
    out = {}
    for name, extra in (("run", []), ("cpu", ["--device", "cpu"])):
        assert main(["eval", *args, *extra]) == 0
        out[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    out["no_gpu"] = eval_json([*args, "--device", "cpu"], env={"CUDA_VISIBLE_DEVICES": ""})
    return out


def assert_metrics_close(got: dict[str, Any], want: dict[str, Any], label: str) -> None:
    """Eval metrics of one checkpoint scored on two devices. Scores differ by rounding
    (1e-6 relative); AUC moves only where two scores swap order, 1/(pos*neg) each."""
    assert got["rows"] == want["rows"], label
    for key in ("auc", "logloss", "ne", "calibration", "ctr"):
        assert abs(got[key] - want[key]) <= 1e-4 * max(1.0, abs(want[key])), (label, key, got, want)


def sharded_collection_equals_local(data: dict[str, Path], device: str, strategy: str,
                                    optim: str = "rowwise_adagrad", steps: int = 4) -> None:
    """One rank (no process group) of ``ShardedEmbeddingCollection`` with every table
    pinned to ``strategy``, on ``device``, against ``LocalEmbeddingCollection`` on the
    CPU: same batches (from the reader), same upstream gradients, ``steps`` steps.
    A strategy the planner refuses at world size 1 is skipped by the caller."""
    from dlrm.parallel.parallelize import sparse_optimizer
    from dlrm.parallel.planning import plan_from_config, run_tables
    from dlrm.train.inputs import make_reader, resolve_data
    from embeddings.collection import LocalEmbeddingCollection
    from embeddings.sharded import ShardedEmbeddingCollection, gather_tables

    cfg = load_config(TINY, tiny_overrides(**{"data.train": data["train"], "data.eval": ""})
                      + [pins(strategy), "embeddings.replicate_max_bytes=0", f"optim.sparse={optim}",
                         "data.batch_size=256"])
    run_data = resolve_data(cfg)
    tables = run_tables(cfg, run_data.schema)
    plan, _ = plan_from_config(cfg, run_data.schema, 1)
    sharded = ShardedEmbeddingCollection(tables, plan, lambda: sparse_optimizer(cfg), fused=True,
                                         seed=cfg.seed, device=device)
    local = LocalEmbeddingCollection(tables, sparse_optimizer(cfg), fused=True, seed=cfg.seed)
    reader = make_reader(cfg, run_data.train_files, run_data.schema, True)
    width = len(local.features) * local.dim
    for step, batch in enumerate(itertools.islice(reader.epoch(0), steps)):
        upstream = torch.randn(batch.size, width, generator=torch.Generator().manual_seed(step))
        for coll, dev in ((sharded, device), (local, "cpu")):
            coll.set_lr(cfg.optim.sparse_lr)
            pooled = coll(batch.to(dev).sparse)
            assert pooled.device.type == torch.device(dev).type
            (pooled * upstream.to(dev)).sum().backward()
            coll.step()
    want = {k: v.detach().cpu() for k, v in local.export_tables().items()}
    assert_close_norm(gather_tables(sharded), want, f"{strategy} on {device}")


def pins(strategy: str) -> str:
    """``embeddings.plan`` pinning two single-hot and two multi-hot tables of
    configs/tiny.yaml (C1, C2; C25, C26: the generator's last ``multi_hot`` columns
    are bags) to ``strategy``; the planner places the rest."""
    body = ", ".join(f"{name}: {{sharding: {strategy}}}" for name in ("C1", "C2", "C25", "C26"))
    return f"embeddings.plan={{{body}}}"


def torchrun_one_rank(data: dict[str, Path], tmp: Path, device: str, backend: str,
                      strategy: str, ranks: int = 1, *extra: str) -> Path:
    """``torchrun --nproc_per_node=ranks -m dlrm train`` with ``train.backend``, the
    first tables pinned to ``strategy``; the run directory. Several ranks on one GPU
    share it (gloo: NCCL refuses two ranks on one device)."""
    out = tmp / f"torchrun_{strategy}_{ranks}"
    args = ["--config", str(TINY), "--out", str(out), *tiny_overrides(), f"data.train={data['train']}",
            "data.eval=", f"train.max_steps={STEPS}", "train.log_every=4", f"train.device={device}",
            f"train.backend={backend}", "train.tf32=false", pins(strategy), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           "-m", "dlrm", "train", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def skip_unless_planned(data: dict[str, Path], strategy: str) -> None:
    """Skip a strategy the planner refuses for these tables at world size 1."""
    from dlrm.parallel.planning import plan_from_config
    from dlrm.train.inputs import resolve_data
    from embeddings.plan.types import PlanError

    cfg = load_config(TINY, [f"data.train={data['train']}", pins(strategy)])
    schema = resolve_data(cfg).schema
    try:
        plan_from_config(cfg, schema, 1)
    except PlanError as e:
        pytest.skip(f"the planner refuses {strategy} at world size 1: {e}")


def host_tier_and_cold_copy(data: dict[str, Path], tmp: Path, device: str,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Hotline's tiers through public attributes: the host tier's weight and optimizer
    state are pageable on any device (page-locked, torch's host allocator rounded them
    up to a power of two; rows cross through pinned buffers of their own), and with
    CUDA ``gather_cold`` copies the cold rows from a pinned buffer under a stream other
    than the current (compute) one; on any device the hot rows are on ``device`` and
    the cold rows are exact copies."""
    from dlrm.parallel.parallelize import build_model
    from dlrm.parallel.planning import run_tables
    from dlrm.train.hotline import make_profile
    from dlrm.train.inputs import make_reader, resolve_data

    cfg = load_config(TINY, tiny_overrides(**{"data.train": data["train"], "data.eval": ""})
                      + [*HOTLINE, f"train.device={device}", "optim.sparse=adam"])
    run_data = resolve_data(cfg)
    reader = make_reader(cfg, run_data.train_files, run_data.schema, True)
    profile = make_profile(cfg, run_tables(cfg, run_data.schema), reader, tmp, lambda s: None)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    emb = build_model(cfg, run_data.schema, dev, None, profile).embeddings
    host = emb.host
    cuda = dev.type == "cuda"
    assert host.weight.device.type == "cpu" and host.state
    assert not host.weight.is_pinned()
    assert not any(t.is_pinned() for t in host.state.values()), \
        {k: t.is_pinned() for k, t in host.state.items()}
    assert emb.hot_weight.device.type == dev.type and emb.hot_weight.shape[0] > 0

    entered: list[tuple[object, object]] = []
    real_stream = torch.cuda.stream

    def spy(stream):  # what gather_cold runs its copy under, and what was current then
        entered.append((stream, torch.cuda.current_stream(dev) if cuda else None))
        return real_stream(stream)

    monkeypatch.setattr(torch.cuda, "stream", spy)
    batch = next(iter(reader.epoch(0)))
    rest = batch.select((~emb.split(batch.sparse)).nonzero().flatten())
    assert rest.size > 0
    cold = emb.gather_cold(rest.sparse)
    if cuda:
        assert entered, "gather_cold copied without entering a stream"
        assert all(s is not None and s != current for s, current in entered), entered
    else:
        assert entered == []  # no copy at all: the host is the device
    assert cold.rows.device.type == dev.type and cold.ids.numel() > 0
    torch.testing.assert_close(cold.rows.detach().cpu(), host.weight.detach()[cold.ids.cpu()],
                               rtol=0, atol=0)


# ------------------------------------------------------------------ GPU timeline


def gpu_timeline(trace_path: Path) -> dict[str, Any]:
    """From a Chrome trace of torch.profiler with CUDA activity (``train.profile_steps``):

    compute_stream   the stream with the most kernel time (the trainer's)
    cold_copies      host-to-device copies on a stream that runs no kernel (the cold
                     rows' copy stream; Hotline's split stream, which copies each batch in
                     and classifies it, runs kernels): (start, end, name) µs
    popular          the device spans of the ``hotline.popular`` micro-batches (the
                     trainer's record_function: first to last of their device work)
    under_popular    the share of the copies' time inside those spans: the copy engine
                     worked while the popular micro-batch was on the device
    overlapped       the share of the copies' time during which a kernel of the compute
                     stream ran (reported, not asserted: a host-bound step leaves the SMs
                     idle between kernels, and a few-µs copy then lands in a gap)
    """
    raw = json.loads(trace_path.read_text())
    events = raw["traceEvents"] if isinstance(raw, dict) else raw
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]

    def stream(e: dict) -> Any:
        return (e.get("args") or {}).get("stream", e.get("tid"))

    def interval(e: dict) -> tuple[float, float]:
        return float(e["ts"]), float(e["ts"]) + float(e["dur"])

    kernel_time: dict[Any, float] = {}
    for e in spans:
        if e.get("cat") == "kernel":
            kernel_time[stream(e)] = kernel_time.get(stream(e), 0.0) + float(e["dur"])
    if not kernel_time:
        return {"compute_stream": None, "cold_copies": [], "overlapped": 0.0, "kernels": 0,
                "popular": [], "under_popular": 0.0}
    compute = max(kernel_time, key=kernel_time.__getitem__)
    kernels = sorted(interval(e) for e in spans if e.get("cat") == "kernel" and stream(e) == compute)
    popular = sorted(interval(e) for e in spans
                     if e.get("cat") == "gpu_user_annotation" and e.get("name") == "hotline.popular")
    copies = [(*interval(e), str(e.get("name", ""))) for e in spans
              if e.get("cat") == "gpu_memcpy" and "HtoD" in str(e.get("name", "")) and stream(e) not in kernel_time]

    def share_inside(windows: list[tuple[float, float]]) -> float:
        total = covered = 0.0
        for start, end, _ in copies:
            total += end - start
            covered += sum(max(0.0, min(end, w1) - max(start, w0)) for w0, w1 in windows
                           if w0 < end and w1 > start)
        return covered / total if total > 0 else 0.0

    return {"compute_stream": compute, "cold_copies": copies, "kernels": len(kernels),
            "popular": popular, "under_popular": share_inside(popular),
            "overlapped": share_inside(kernels)}
