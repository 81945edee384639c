"""fp16 tables sharded over 1, 2 and 3 ranks equal one process bit for bit.

The stochastic rounding's random stream is keyed by (seed, step, full table, row,
column), not by rank or shard: each plan rounds every element as one process does.
Reference: LocalEmbeddingCollection on the whole batch (tests/test_sharded_embeddings.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from embeddings.collection import LocalEmbeddingCollection
from embeddings.optim import make_sparse_optimizer
from embeddings.plan.planner import fixed_plan
from embeddings.sharded import ShardedEmbeddingCollection, gather_tables
from tests.multiprocess import run_ranks
from tests.test_sharded_embeddings import LR, PLANS, STEPS, local_slice, make_tables, rank_rows

CASES = [(p, o) for p in PLANS for o in ("sgd", "rowwise_adagrad")]


def half_tables(dtype: str = "fp16") -> list:
    return [dataclasses.replace(t, dtype=dtype) for t in make_tables()]


def train_sharded(rank: int, world_size: int, cases) -> dict:
    results = {}
    for plan_name, optim in cases:
        tables = half_tables()
        plan = fixed_plan(tables, world_size, PLANS[plan_name](world_size))
        coll = ShardedEmbeddingCollection(tables, plan, lambda kind=optim: make_sparse_optimizer(kind), seed=7)
        pooled = []
        for step in range(STEPS):
            kjt, upstream = local_slice(step, rank, world_size)
            coll.set_lr(LR)
            out = coll(kjt)
            pooled.append(out.detach().clone())
            (out * upstream).sum().backward()
            coll.step()
        results[(plan_name, optim)] = ({k: v.clone() for k, v in gather_tables(coll).items()}, pooled)
    return results


def train_reference(optim: str) -> tuple[dict, list]:
    coll = LocalEmbeddingCollection(half_tables(), make_sparse_optimizer(optim), seed=7)
    pooled = []
    for step in range(STEPS):
        kjt, upstream = local_slice(step, 0, 1)
        coll.set_lr(LR)
        out = coll(kjt)
        pooled.append(out.detach().clone())
        (out * upstream).sum().backward()
    return {k: v.clone() for k, v in coll.export_tables().items()}, pooled


def check(results: dict, world_size: int, rank: int) -> None:
    for (plan_name, optim), (tables, pooled) in results.items():
        want, want_pooled = train_reference(optim)
        assert set(tables) == set(want), (plan_name, sorted(tables), sorted(want))
        for key, value in want.items():
            if key.endswith(".weight"):
                assert tables[key].dtype == torch.float16, key
                assert torch.equal(tables[key], value), f"W={world_size} {plan_name} {optim} {key}"
            else:
                torch.testing.assert_close(tables[key], value, rtol=1e-5, atol=1e-7)
        start, end = rank_rows(rank, world_size)
        for got, full in zip(pooled, want_pooled, strict=True):
            torch.testing.assert_close(got, full[start:end], rtol=1e-5, atol=1e-6)


def test_one_rank_equals_local() -> None:
    check(train_sharded(0, 1, CASES), 1, 0)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.distributed
@pytest.mark.slow
def test_sharded_fp16_equals_one_process(world_size: int) -> None:
    per_rank = run_ranks(world_size, train_sharded, CASES)
    for rank in range(world_size):
        check(per_rank[rank], world_size, rank)
