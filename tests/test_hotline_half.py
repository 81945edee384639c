"""Hotline with fp16/bf16 tables: hot and host tiers hold the rows in the table's type
and round every update stochastically by (seed, step, full table, row, column), so a
Hotline collection equals the plain collection bit for bit.

References: ``LocalEmbeddingCollection`` (one process) and, at 2 ranks, the single
process on the whole batch (as tests/test_half_sharded.py), same seeds and batches.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from embeddings.collection import LocalEmbeddingCollection
from embeddings.hotline.tiers import HotlineEmbeddingCollection
from embeddings.optim import make_sparse_optimizer
from embeddings.plan.planner import fixed_plan
from embeddings.sharded import gather_tables
from embeddings.table import Pooling
from tests.multiprocess import run_ranks
from tests.test_embeddings import random_kjt, tables_fixture
from tests.test_hotline import FEATURES, LR, hot_sets, profile_of, rows_of
from tests.test_sharded_embeddings import PLANS, STEPS, local_slice, make_tables, rank_rows


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str) -> None:
    assert sorted(got) == sorted(want), label
    for key, value in want.items():
        if key.endswith(".weight") or value.dtype in (torch.bfloat16, torch.float16):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), f"{label} {key}"
        else:
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-7, msg=f"{label} {key}")


# adam "all" / "none": steps where one tier has no lookup (an empty gradient, applied:
# Adam counts the step) with half weights and state
CASES = [("bf16", "rowwise_adagrad", "half", True, "fp32"), ("fp16", "sgd", "all", False, "fp32"),
         ("bf16", "adam", "half", False, "bf16"), ("bf16", "adagrad", "none", True, "fp32"),
         ("bf16", "adam", "all", False, "bf16"), ("fp16", "adam", "none", False, "fp32")]


@pytest.mark.parametrize("dtype,kind,share,fused,state", CASES)
def test_hotline_half_equals_local_bit_for_bit(dtype: str, kind: str, share: str, fused: bool, state: str) -> None:
    steps = 4
    pooling = Pooling.MEAN if kind == "rowwise_adagrad" else Pooling.SUM
    tables = [dataclasses.replace(t, dtype=dtype) for t in tables_fixture(pooling)]
    kjts = [random_kjt(FEATURES, rows_of(tables), batch=6, max_len=1 if s < 2 else 3, seed=s) for s in range(steps)]
    ups = [torch.randn(6, 16, generator=torch.Generator().manual_seed(100 + s)) for s in range(steps)]
    ref = LocalEmbeddingCollection(tables, make_sparse_optimizer(kind, state_dtype=state), fused=fused, seed=5)
    hot = HotlineEmbeddingCollection(tables, profile_of(tables, hot_sets(tables, kjts, share, 0)),
                                     make_sparse_optimizer(kind, state_dtype=state), fused=fused, seed=5)
    assert hot.hot_weight.dtype == ref.weight.dtype == hot.host.weight.dtype
    for s, (kjt, up) in enumerate(zip(kjts, ups)):
        if s == steps // 2:
            hot.refresh(profile_of(tables, hot_sets(tables, kjts, "half", 1)))
        for coll in (ref, hot):
            coll.set_lr(LR)
            (coll(kjt) * up).sum().backward()
            coll.step()
    label = f"{dtype} {kind} {share} fused={fused} state={state}"
    assert_same(hot.export_tables(), ref.export_tables(), label)
    assert int(hot.hot_state["rounding_step"]) == int(hot.host.state["rounding_step"]) == steps


def train_hotline_ranks(rank: int, world_size: int, optim: str) -> dict:
    tables = [dataclasses.replace(t, dtype="bf16") for t in make_tables()]
    plan = fixed_plan(tables, world_size, PLANS["mixed"](world_size))
    hot_rows = {t.name: torch.arange(0, t.rows, 3) for t in tables}  # a third of every table
    coll = HotlineEmbeddingCollection(tables, profile_of(tables, hot_rows), make_sparse_optimizer(optim),
                                      fused=False, seed=7, plan=plan)
    coll.grad_scale = 1.0
    pooled = []
    for step in range(STEPS):
        kjt, upstream = local_slice(step, rank, world_size)
        coll.set_lr(0.1)
        out = coll(kjt)
        pooled.append(out.detach().clone())
        (out * upstream).sum().backward()
        coll.step()
    coll.sync_to_host()
    return {"tables": {k: v.clone() for k, v in gather_tables(coll.host).items()}, "pooled": pooled}


def one_process(optim: str) -> tuple[dict, list]:
    tables = [dataclasses.replace(t, dtype="bf16") for t in make_tables()]
    coll = LocalEmbeddingCollection(tables, make_sparse_optimizer(optim), seed=7)
    pooled = []
    for step in range(STEPS):
        kjt, upstream = local_slice(step, 0, 1)
        coll.set_lr(0.1)
        out = coll(kjt)
        pooled.append(out.detach().clone())
        (out * upstream).sum().backward()
    return {k: v.clone() for k, v in coll.export_tables().items()}, pooled


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("optim", ["sgd", "rowwise_adagrad"])
def test_two_rank_hotline_bf16_equals_one_process(optim: str) -> None:
    want, want_pooled = one_process(optim)
    for rank, got in enumerate(run_ranks(2, train_hotline_ranks, optim)):
        assert_same(got["tables"], want, f"W=2 rank {rank} {optim}")
        start, end = rank_rows(rank, 2)
        for a, b in zip(got["pooled"], want_pooled, strict=True):
            torch.testing.assert_close(a, b[start:end], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind,ratio", [("sgd", 2.0), ("rowwise_adagrad", (4 * 8 + 4) / (2 * 8 + 4))])
def test_half_tables_fit_more_hot_rows_in_a_budget(kind: str, ratio: float) -> None:
    """A hot row costs its weight in the table's type plus its optimizer state."""
    from embeddings.hotline.profile import choose_hot_rows
    from embeddings.table import TableSpec

    counts = {"t": torch.arange(1000, 0, -1)}  # every row used, most popular first
    chosen = {}
    for dtype in ("fp32", "bf16"):
        table = TableSpec("t", rows=1000, dim=8, features=("f",), dtype=dtype)
        chosen[dtype] = choose_hot_rows(counts, [table], make_sparse_optimizer(kind), 36 * 100)["t"].numel()
    state = 4 if kind == "rowwise_adagrad" else 0
    assert chosen["fp32"] == 3600 // (4 * 8 + state) and chosen["bf16"] == 3600 // (2 * 8 + state)
    assert chosen["bf16"] / chosen["fp32"] == pytest.approx(ratio, rel=0.01)


@pytest.mark.parametrize("dtype,pipeline", [("bf16", "true"), ("fp16", "false")])
def test_half_hotline_adam_with_every_row_hot_trains_as_ordinary(tiny_data, tmp_path, dtype: str,
                                                                 pipeline: str) -> None:
    """A budget that holds every row touched: the host tier's gradient is empty each step
    and is still applied (Adam counts the step). It was made in the table's type, and
    Adam's fp32 state refused it (a crash at the first step with half tables)."""
    from tests.run_state import assert_states_close, run_state
    from tests.test_hotline_train import run

    common = ("optim.sparse=adam", f"embeddings.dtype={dtype}", "train.max_steps=4", "data.batch_size=64")
    run(tiny_data, tmp_path / "plain", *common)
    summary = run(tiny_data, tmp_path / "hot", *common, "embeddings.placement=hotline", "hotline.budget=10MB",
                  "hotline.fill_unseen=false", f"hotline.pipeline={pipeline}")
    assert summary["hotline"]["hot_hit_rate"] == 1.0
    assert_states_close(run_state(tmp_path / "hot"), run_state(tmp_path / "plain"), f"{dtype} hotline adam all hot")
