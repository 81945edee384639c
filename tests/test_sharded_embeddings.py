"""Sharded embeddings equal one process: every strategy (table-, column-, row-wise,
data-parallel, mixed), every sparse optimizer, 1-3 ranks with uneven local batches."""

from __future__ import annotations

import pytest
import torch

from data.jagged import JaggedFeatures
from embeddings.collection import LocalEmbeddingCollection
from embeddings.optim import make_sparse_optimizer
from embeddings.plan.planner import fixed_plan
from embeddings.plan.types import ShardingType
from embeddings.sharded import ShardedEmbeddingCollection, gather_tables
from embeddings.table import Pooling, TableSpec
from tests.multiprocess import run_ranks

DIM = 6
GLOBAL_BATCH = 11  # does not divide by 2 or 3
STEPS = 3
LR = 0.1


def make_tables(pooling: Pooling = Pooling.SUM, scale: int = 1) -> list[TableSpec]:
    """``scale`` multiplies the rows (ids still only hit the first ones)."""
    return [
        TableSpec("t0", rows=40 * scale, dim=DIM, features=("a",), pooling=pooling),
        TableSpec("t1", rows=25 * scale, dim=DIM, features=("b", "c"), pooling=pooling),  # shared
        TableSpec("t2", rows=9 * scale, dim=DIM, features=("d",), pooling=pooling),
        TableSpec("t3", rows=61 * scale, dim=DIM, features=("e",), pooling=pooling),
    ]


FEATURES = ["a", "b", "c", "d", "e"]
ROWS = {"a": 40, "b": 25, "c": 25, "d": 9, "e": 61}


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lengths [F, G], values, upstream gradient [G, F*D]) of step ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    lengths = torch.randint(0, 4, (len(FEATURES), GLOBAL_BATCH), generator=g)
    values = torch.cat([torch.randint(0, ROWS[f], (int(lengths[i].sum()),), generator=g)
                        for i, f in enumerate(FEATURES)])
    upstream = torch.randn(GLOBAL_BATCH, len(FEATURES) * DIM, generator=g)
    return lengths, values, upstream


def rank_rows(rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of the global batch that ``rank`` trains on (uneven shares)."""
    sizes = [GLOBAL_BATCH // world_size + (1 if r < GLOBAL_BATCH % world_size else 0) for r in range(world_size)]
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def local_slice(step: int, rank: int, world_size: int) -> tuple[JaggedFeatures, torch.Tensor]:
    lengths, values, upstream = global_batch(step)
    start, end = rank_rows(rank, world_size)
    per_feature = values.split(lengths.sum(1).tolist())
    vals, lens = [], []
    for i, ids in enumerate(per_feature):
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths[i].cumsum(0)])
        vals.append(ids[offsets[start]: offsets[end]])
        lens.append(lengths[i, start:end])
    kjt = JaggedFeatures(keys=FEATURES, values=torch.cat(vals), lengths=torch.cat(lens), stride=end - start)
    return kjt, upstream[start:end]


PLANS = {
    "table_wise": lambda W: {t: (ShardingType.TABLE_WISE, [i % W]) for i, t in enumerate(["t0", "t1", "t2", "t3"])},
    "column_wise": lambda W: {t: (ShardingType.COLUMN_WISE, []) for t in ["t0", "t1", "t2", "t3"]},
    "row_wise": lambda W: {t: (ShardingType.ROW_WISE, []) for t in ["t0", "t1", "t2", "t3"]},
    "data_parallel": lambda W: {t: (ShardingType.DATA_PARALLEL, []) for t in ["t0", "t1", "t2", "t3"]},
    "mixed": lambda W: {"t0": (ShardingType.TABLE_WISE, [W - 1]), "t1": (ShardingType.COLUMN_WISE, []),
                        "t2": (ShardingType.DATA_PARALLEL, []), "t3": (ShardingType.ROW_WISE, [])},
}
CASES = [(p, o, fused) for p in PLANS for o in ("sgd", "rowwise_adagrad", "adam") for fused in (True, False)]
# Element-wise Adagrad needs no cross-shard statistic: the mixed plan (one table of each
# strategy) covers it, fused and kept, at a fifth of the cost of every plan.
CASES += [("mixed", "adagrad", fused) for fused in (True, False)]


def train_sharded(rank: int, world_size: int, cases, pooling: Pooling = Pooling.SUM, scale: int = 1) -> dict:
    results = {}
    for plan_name, optim, fused in cases:
        tables = make_tables(pooling, scale)
        plan = fixed_plan(tables, world_size, PLANS[plan_name](world_size))
        coll = ShardedEmbeddingCollection(
            tables, plan, lambda kind=optim: make_sparse_optimizer(kind), fused=fused, seed=7
        )
        outputs = {}
        for step in range(STEPS):
            kjt, upstream = local_slice(step, rank, world_size)
            coll.set_lr(LR)
            pooled = coll(kjt)
            assert pooled.shape == (kjt.stride(), len(FEATURES) * DIM)
            outputs[f"pooled@{step}"] = pooled.detach().clone()
            (pooled * upstream).sum().backward()
            coll.step()
        # The forward too: the loss's gradient does not depend on the pooled values.
        results[(plan_name, optim, fused)] = {**gather_tables(coll), **outputs}
    return results


def train_reference(optim: str, pooling: Pooling = Pooling.SUM) -> dict[str, torch.Tensor]:
    coll = LocalEmbeddingCollection(make_tables(pooling), make_sparse_optimizer(optim), fused=True, seed=7)
    outputs = {}
    for step in range(STEPS):
        kjt, upstream = local_slice(step, 0, 1)
        coll.set_lr(LR)
        pooled = coll(kjt)
        outputs[f"pooled@{step}"] = pooled.detach().clone()
        (pooled * upstream).sum().backward()
        coll.step()
    return {**{k: v.clone() for k, v in coll.export_tables().items()}, **outputs}


def assert_tables_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str,
                        rank: int = 0, world_size: int = 1) -> None:
    """Tables and optimizer state equal; each step's pooled output equal to the
    reference's rows of this rank's slice of the global batch."""
    assert set(got) == set(want), (label, sorted(got), sorted(want))
    start, end = rank_rows(rank, world_size)
    for key, expected in want.items():
        if key.startswith("pooled@"):
            expected = expected[start:end]
        torch.testing.assert_close(
            got[key], expected, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{label} {key}: {m}"
        )


@pytest.mark.slow
def test_one_rank_without_process_group_equals_local() -> None:
    results = train_sharded(0, 1, [c for c in CASES if not c[2]])
    for (plan_name, optim, fused), tables in results.items():
        assert_tables_equal(tables, train_reference(optim), f"W=1 {plan_name} {optim}")


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.distributed
@pytest.mark.slow
def test_sharded_equals_single_process(world_size: int) -> None:
    per_rank = run_ranks(world_size, train_sharded, CASES)
    references = {o: train_reference(o) for o in {case[1] for case in CASES}}
    for case in CASES:
        for rank in range(world_size):
            assert_tables_equal(per_rank[rank][case], references[case[1]], f"W={world_size} rank {rank} {case}",
                                rank, world_size)


@pytest.mark.distributed
@pytest.mark.slow
def test_mean_pooling_row_and_column_wise() -> None:
    cases = [("mixed", "sgd", True), ("row_wise", "adam", False)]
    per_rank = run_ranks(2, train_sharded, cases, Pooling.MEAN)
    for case in cases:
        for rank in range(2):
            assert_tables_equal(per_rank[rank][case], train_reference(case[1], Pooling.MEAN),
                                f"mean {case} rank {rank}", rank, 2)


def record_collectives(rank: int, world_size: int) -> list[tuple[str, int]]:
    """Train replicated tables with every torch.distributed collective recorded."""
    import torch.distributed as dist

    calls: list[tuple[str, int]] = []

    def spy(name):
        original = getattr(dist, name)

        def wrapper(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            lists = [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
            calls.append((name, max([t.numel() for t in tensors + lists], default=0)))
            return original(*args, **kwargs)

        setattr(dist, name, wrapper)

    for name in ("all_reduce", "all_gather", "all_to_all_single", "broadcast", "reduce_scatter", "all_gather_into_tensor"):
        spy(name)
    cases = [("data_parallel", "rowwise_adagrad", True), ("data_parallel", "sgd", False)]
    train_sharded(rank, world_size, cases, Pooling.SUM, 1000)
    return calls


@pytest.mark.distributed
@pytest.mark.slow
def test_replicated_tables_exchange_kv_pairs_not_dense_gradients() -> None:
    smallest_table = min(t.rows * t.dim for t in make_tables(scale=1000))  # 54,000 values
    for calls in run_ranks(2, record_collectives):
        names = {name for name, _ in calls}
        assert "all_reduce" not in names and "reduce_scatter" not in names
        assert "all_gather" in names  # the KV exchange happened
        # Only touched rows travel: every buffer is far smaller than any table
        # (gather_tables at the end of train_sharded uses all_gather_object).
        gathered = [n for name, n in calls if name == "all_gather"]
        assert max(gathered) < smallest_table / 50, (max(gathered), smallest_table)
