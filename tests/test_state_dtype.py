"""``embeddings.state_dtype``: element-wise Adagrad / Adam state stored in bf16 or fp16.

References: the state's closed form under a constant gradient (Adam's v after t steps
of g = 1 is 1 - 0.999^t), fp32 state (the same collection, the same batches), the
byte counts the dtype implies, and a single process for the sharded layout.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from embeddings.collection import LocalEmbeddingCollection
from embeddings.kv import KVGradient
from embeddings.optim import make_sparse_optimizer
from embeddings.plan.estimate import plan_memory
from embeddings.plan.planner import fixed_plan
from embeddings.sharded import ShardedEmbeddingCollection, gather_tables
from embeddings.table import TableSpec
from tests.test_sharded_embeddings import LR, PLANS, STEPS, local_slice, make_tables

ROWS, DIM = 16, 8


@pytest.mark.parametrize("kind", ["adagrad", "adam"])
def test_element_wise_state_bytes_halve(kind: str) -> None:
    full = make_sparse_optimizer(kind, state_dtype="fp32")
    for half in ("bf16", "fp16"):
        assert make_sparse_optimizer(kind, state_dtype=half).state_bytes_per_row(DIM) * 2 == full.state_bytes_per_row(DIM)
    tables = make_tables()
    plan = fixed_plan(tables, 2, PLANS["row_wise"](2))
    a = plan_memory(plan, tables, full, batch_size=8)
    b = plan_memory(plan, tables, make_sparse_optimizer(kind, state_dtype="bf16"), batch_size=8)
    assert [m.optimizer * 2 for m in b] == [m.optimizer for m in a]
    assert [m.tables for m in b] == [m.tables for m in a]


def test_rowwise_state_stays_fp32() -> None:
    opt = make_sparse_optimizer("rowwise_adagrad", state_dtype="bf16")
    assert opt.state_layout()["sum"].dtype == torch.float32 and opt.state_bytes_per_row(DIM) == 4


def adam_second_moment(steps: int, stochastic: bool) -> torch.Tensor:
    """v of every element after ``steps`` updates with g = 1 (bf16 state)."""
    table = TableSpec("t", rows=ROWS, dim=DIM, features=("f",))
    coll = LocalEmbeddingCollection([table], make_sparse_optimizer("adam", state_dtype="bf16"), seed=0)
    coll.set_lr(1e-4)
    grad = KVGradient(torch.arange(ROWS), torch.ones(ROWS, DIM))
    for _ in range(steps):
        if stochastic:
            coll.apply_gradient(grad)
        else:  # the same update, written back round-to-nearest
            coll.state["rounding_step"] += 1
            coll.optimizer.apply(coll.weight.data, coll.state, grad, coll.lr)
    return coll.state["exp_avg_sq"].float()


def test_bf16_adam_state_follows_fp32_only_with_stochastic_rounding() -> None:
    steps = 600
    exact = 1 - 0.999**steps  # 0.451
    sr, rtn = adam_second_moment(steps, True), adam_second_moment(steps, False)
    assert abs(float(sr.mean()) - exact) < 0.01, float(sr.mean())
    # round-to-nearest: once 0.001 x (1 - v) is under half a bf16 spacing of v (from
    # v = 0.25: spacing 2^-9), v stops
    assert float(rtn.max()) < 0.3, float(rtn.max())


def test_sharded_half_state_equals_one_process() -> None:
    """Column shards round their state with the full table's columns: the same bits."""
    tables = [dataclasses.replace(t, dtype="bf16") for t in make_tables()]
    results = {}
    for name in ("one process", "column_wise"):
        if name == "one process":
            coll = LocalEmbeddingCollection(tables, make_sparse_optimizer("adam", state_dtype="bf16"), seed=7)
        else:
            plan = fixed_plan(tables, 1, PLANS["column_wise"](1))
            coll = ShardedEmbeddingCollection(tables, plan, lambda: make_sparse_optimizer("adam", state_dtype="bf16"),
                                              seed=7)
        for step in range(STEPS):
            kjt, upstream = local_slice(step, 0, 1)
            coll.set_lr(LR)
            (coll(kjt) * upstream).sum().backward()
            coll.step()
        results[name] = gather_tables(coll) if name != "one process" else coll.export_tables()
    one, sharded = results["one process"], results["column_wise"]
    assert one["t1.exp_avg_sq"].dtype == torch.bfloat16
    for key in one:
        if key.endswith(("exp_avg", "exp_avg_sq", "weight")):
            assert torch.equal(one[key], sharded[key]), key


def run_train(tiny_data, run: Path, **extra) -> dict:
    from dlrm.config import load_config
    from dlrm.train.trainer import train
    from tests.conftest import TINY, tiny_overrides

    cfg = load_config(TINY, tiny_overrides(**{"data.train": tiny_data["train"], "data.eval": tiny_data["eval"],
                                              "optim.sparse": "adam", "optim.sparse_lr": 0.002, **extra}))
    return train(cfg, run, echo=lambda s: None)


@pytest.mark.slow
def test_bf16_state_run_tracks_fp32_and_resumes_bit_exact(tiny_data, tmp_path: Path) -> None:
    from tests.run_state import run_state

    summary = {d: run_train(tiny_data, tmp_path / d, **{"embeddings.state_dtype": d}) for d in ("fp32", "bf16")}
    assert summary["fp32"]["eval_auc"] > 0.70
    assert abs(summary["bf16"]["eval_auc"] - summary["fp32"]["eval_auc"]) <= 0.002, summary
    a, b = run_state(tmp_path / "fp32"), run_state(tmp_path / "bf16")
    moments = [k for k in a if k.endswith((".exp_avg", ".exp_avg_sq"))]
    assert moments and all(b[k].dtype == torch.bfloat16 and b[k].nbytes * 2 == a[k].nbytes for k in moments)

    extra = {"embeddings.state_dtype": "bf16", "train.max_steps": 40}
    run_train(tiny_data, tmp_path / "straight", **extra)
    run_train(tiny_data, tmp_path / "resumed", **{**extra, "train.max_steps": 15})
    run_train(tiny_data, tmp_path / "resumed", **extra)
    x, y = run_state(tmp_path / "straight"), run_state(tmp_path / "resumed")
    assert x.keys() == y.keys()
    for key in x:
        assert torch.equal(x[key], y[key]), key
