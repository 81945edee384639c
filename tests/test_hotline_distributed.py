"""Hotline on several ranks equals ordinary training in one process: hot rows
replicated (KV all-gather), cold rows sharded over the ranks' host memory by a
mixed plan (table-, column-, row-wise, replicated), every sparse optimizer, mean
pooling, a hot set refreshed mid-run; W ranks (gloo) against one process reading
the same global batches (data.order_world_size=W)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dlrm.train.trainer import train
from tests.conftest import FEW_TABLES, TINY
from tests.multiprocess import run_ranks
from tests.run_state import RTOL, assert_states_close, run_state
from tests.test_distributed_train import case_overrides, config_for, losses, small_data, summary

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

__all__ = ["small_data"]  # the module-scoped data fixture, shared

# Part of the touched rows fit: both micro-batches run on every rank.
HOTLINE = ("embeddings.placement=hotline", "hotline.budget=560KB", "hotline.profile_fraction=0.5", "hotline.fill_unseen=false")
CASES = {
    "sgd_refresh": ("sgd", ("hotline.refresh_every=3",)),
    "adagrad": ("rowwise_adagrad", ()),
    "exact_adagrad": ("adagrad", ()),  # a [rows, dim] state in both tiers
    "adam": ("adam", ("optim.dense=adam",)),
    "mean_nopipe": ("sgd", ("embeddings.pooling=mean", "hotline.pipeline=false")),
}
CASES_W3 = {k: CASES[k] for k in ("sgd_refresh", "adagrad")}


def train_ranks(rank: int, world_size: int, data: dict[str, Path], out: Path, cases: dict) -> None:
    for name, (optim, extra) in cases.items():
        overrides = case_overrides(world_size, optim, (*extra, *HOTLINE))
        train(config_for(data, overrides), out / f"{name}_W{world_size}", echo=lambda s: None)


@pytest.mark.parametrize("world_size", [2, 3])
def test_hotline_ranks_equal_one_process(world_size: int, small_data, tmp_path: Path) -> None:
    cases = CASES if world_size == 2 else CASES_W3
    run_ranks(world_size, train_ranks, small_data, tmp_path, cases)
    for name, (optim, extra) in cases.items():
        # The reference is ordinary training (no Hotline) on the same global batches.
        plain = [x for x in extra if not x.startswith("hotline.")]
        ref = tmp_path / f"{name}_ref{world_size}"
        overrides = case_overrides(1, optim, tuple(plain)) + [f"data.order_world_size={world_size}"]
        train(config_for(small_data, overrides), ref, echo=lambda s: None)
        run = tmp_path / f"{name}_W{world_size}"
        assert json.loads((run / "plan.json").read_text())["world_size"] == world_size
        assert_states_close(run_state(run), run_state(ref), f"hotline {name} W={world_size}",
                            RTOL.get(optim, 1e-5))
        torch.testing.assert_close(losses(run), losses(ref), rtol=1e-5, atol=1e-7)
        # up to a tie (tests/test_distributed_train.py: eval ids past the training tables
        # are left out of their bags since 2026-12-07; W=2 moved by 3.4e-6, half a pair)
        assert summary(run)["eval_auc"] == pytest.approx(summary(ref)["eval_auc"], abs=2e-5)
        assert summary(run)["eval_logloss"] == pytest.approx(summary(ref)["eval_logloss"], rel=1e-6)
        stats = summary(run)["hotline"]
        assert 0.0 < stats["popular_share"] < 1.0, stats  # both micro-batches ran
        assert 0.0 < stats["hot_hit_rate"] < 1.0, stats


def test_torchrun_hotline_resumes_exactly(small_data, tmp_path: Path) -> None:
    """`torchrun -m dlrm train` with Hotline, stopped after 4 steps (checkpoint: hot
    rows written back into the sharded host tier) and resumed, equals one process."""
    from tests.test_torchrun import torchrun

    overrides = case_overrides(2, "adam", HOTLINE) + ["train.progress=false"]
    args = ["train", "--config", str(TINY), "--out", str(tmp_path / "run"),
            f"data.train={small_data['train']}", f"data.eval={small_data['eval']}", *overrides]
    first = torchrun(2, *args, "train.max_steps=4")
    assert "hotline:" in first.stdout + first.stderr  # the profile was made
    second = torchrun(2, *args)
    assert "resumed from" in second.stdout + second.stderr
    ref = tmp_path / "ref"
    train(config_for(small_data, case_overrides(1, "adam") + ["data.order_world_size=2"]), ref,
          echo=lambda s: None)
    assert_states_close(run_state(tmp_path / "run"), run_state(ref), "torchrun hotline resume")


def test_torchrun_hotline_resume_across_a_refresh_is_bit_equal(small_data, tmp_path: Path) -> None:
    """2 ranks, hotline.refresh_every=3, stopped after step 4 (each rank's counts since
    step 3's re-profile: summed into rank 0's at the save) and resumed: bit for bit the
    2-rank run never stopped."""
    from tests.test_torchrun import torchrun

    overrides = case_overrides(2, "adam", HOTLINE) + ["train.progress=false", "hotline.refresh_every=3",
                                                      "train.max_steps=8"]

    def args(out: str) -> list[str]:
        return ["train", "--config", str(TINY), "--out", str(tmp_path / out),
                f"data.train={small_data['train']}", f"data.eval={small_data['eval']}", *overrides]

    torchrun(2, *args("straight"))
    torchrun(2, *args("run"), "train.max_steps=4")
    second = torchrun(2, *args("run"))
    assert "resumed from" in second.stdout + second.stderr
    want, got = run_state(tmp_path / "straight"), run_state(tmp_path / "run")
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


# 4 steps of 128 samples on 8 of the 26 tables: interpreted on the CPU, the all-gathered
# update's programs are most of the test's time (26 tables took 88 s of CI)
TRITON_STEPS = ("train.max_steps=4", "data.batch_size=128", FEW_TABLES)


def train_triton(rank: int, world_size: int, data: dict[str, Path], out: Path) -> None:
    import tests.kernel_cases  # noqa: F401 - TRITON_INTERPRET=1 before triton loads (no GPU)

    # gloo: on the GPU machine the two ranks share its one GPU, which NCCL refuses
    overrides = case_overrides(world_size, "rowwise_adagrad", (*HOTLINE, "embeddings.kernels=triton",
                                                               *TRITON_STEPS, "train.backend=gloo"))
    train(config_for(data, overrides), out / "triton_W2", echo=lambda s: None)


@pytest.mark.kernels
def test_hotline_ranks_on_the_triton_hot_tier_equal_one_process(small_data, tmp_path: Path) -> None:
    """embeddings.kernels=triton on several ranks: each rank holds its hot gradient, the
    ranks' are all-gathered (hot_kernels.py ``gather_ranks``) and every replica applies
    the same one fused update. Reference: ordinary training in one process on the same
    global batches (the Triton kernels interpreted on the CPU; on the GPU machine both
    ranks share the GPU, their collectives through the host)."""
    from tests.kernel_cases import DEVICE

    run_ranks(2, train_triton, small_data, tmp_path)
    run = tmp_path / "triton_W2"
    ref = tmp_path / "ref"
    overrides = case_overrides(1, "rowwise_adagrad", TRITON_STEPS) + ["data.order_world_size=2"]
    train(config_for(small_data, overrides), ref, echo=lambda s: None)
    assert summary(run)["hotline"]["hot_tier_triton"] == 1.0
    # on a GPU cuBLAS sums two half-batch matmuls (then the all-reduce) and one whole
    # one in other orders: the 2026-11-26 H200 run, 3.0e-5 on the bottom MLP's first weight;
    # the CUDA-against-CPU tolerance of tests/gpu_cases.py there
    rtol = RTOL.get("rowwise_adagrad", 1e-5) if DEVICE.type == "cpu" else 1e-4
    assert_states_close(run_state(run), run_state(ref), "hotline triton W=2", rtol)
    torch.testing.assert_close(losses(run), losses(ref), rtol=rtol, atol=1e-7)


def _hot_gradient_ranks(rank: int, world_size: int) -> dict:
    """Each rank builds the run's Hotline collection (dlrm.parallel) and shares a hot
    gradient of its own; what the all-gathers went over comes back."""
    import torch.distributed as dist

    from data.schema import Schema, SparseFeature
    from dlrm.config import load_config
    from dlrm.parallel.distributed import DistInfo
    from dlrm.parallel.parallelize import build_model
    from embeddings.hotline.profile import HotProfile
    from embeddings.kv import KVGradient

    cfg = load_config(TINY, ["embeddings.placement=hotline", "optim.sparse=sgd"])
    schema = Schema("label", ("I1",), (SparseFeature("C1", 50), SparseFeature("C2", 50)))
    info = DistInfo(rank, world_size, rank, torch.device("cpu"), "gloo", timeout_s=60)
    profile = HotProfile({"C1": torch.arange(0, 50, 2), "C2": torch.arange(10)}, {"C1": "C1", "C2": "C2"},
                         budget_bytes=0)
    embeddings = build_model(cfg, schema, info.device, info, profile).embeddings
    hot, host_group = embeddings.hot, embeddings.tier.group
    groups = []
    gather = dist.all_gather

    def spy(*args, group=None, **kwargs):
        groups.append(group)
        return gather(*args, group=group, **kwargs)

    dist.all_gather = spy
    try:  # slots 0 (both ranks), 1 + rank: rows of rank + 1
        shared = hot.shared(KVGradient(torch.tensor([0, 1 + rank]), torch.full((2, 16), rank + 1.0)))
    finally:
        dist.all_gather = gather
    return {"own_group": hot.group is not host_group and dist.get_backend(hot.group) == info.backend,
            "over_hot_group": bool(groups) and all(g is hot.group for g in groups),
            "ids": shared.ids.tolist(), "rows": shared.rows[:, 0].tolist()}


def test_hot_gradients_are_all_gathered_on_the_replicas_own_group() -> None:
    """The hot tier's replicas all-gather their gradients over a group of their own, of
    the run's backend (NCCL on GPUs: the gradient stays on the device), not over the
    host tier's gloo group; every rank gets the same merged gradient."""
    results = run_ranks(2, _hot_gradient_ranks)
    for r in results:
        assert r["own_group"] and r["over_hot_group"], r
        assert r["ids"] == [0, 1, 2] and r["rows"] == [3.0, 1.0, 2.0], r
