"""Per-table dtypes (``embeddings.dtypes``): tables of fp32, bf16 and fp16 side by side.

A stack holds one dtype, so a collection of mixed tables keeps one stack per dtype.
References: each dtype group alone in its own single-process ``LocalEmbeddingCollection``
(tables are independent given the pooled gradients, and the stochastic rounding is keyed
by table, row and column, not by stack), and the bytes each table's dtype implies.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from data.jagged import JaggedFeatures
from embeddings.collection import LocalEmbeddingCollection
from embeddings.optim import make_sparse_optimizer
from embeddings.plan.estimate import plan_memory
from embeddings.plan.planner import fixed_plan
from embeddings.plan.types import ShardingType
from embeddings.sharded import ShardedEmbeddingCollection, gather_tables
from tests.multiprocess import run_ranks
from tests.test_sharded_embeddings import (
    DIM,
    FEATURES,
    LR,
    PLANS,
    STEPS,
    local_slice,
    make_tables,
    rank_rows,
)

DTYPES = {"t0": "fp32", "t1": "bf16", "t2": "fp16", "t3": "bf16"}
CASES = [(p, o) for p in PLANS for o in ("sgd", "rowwise_adagrad", "adam")]


def mixed_tables() -> list:
    return [dataclasses.replace(t, dtype=DTYPES[t.name]) for t in make_tables()]


def train_sharded(rank: int, world_size: int, cases) -> dict:
    results = {}
    for plan_name, optim in cases:
        tables = mixed_tables()
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


def train_groups_alone(optim: str) -> tuple[dict, list]:
    """Each dtype's tables in a collection of their own, on the same batches; the
    pooled output put together in feature order."""
    groups = {}
    for dtype in dict.fromkeys(DTYPES.values()):
        tables = [t for t in mixed_tables() if t.dtype == dtype]
        groups[dtype] = LocalEmbeddingCollection(tables, make_sparse_optimizer(optim), seed=7)
    pooled = []
    for step in range(STEPS):
        kjt, upstream = local_slice(step, 0, 1)
        columns: dict[str, torch.Tensor] = {}
        for coll in groups.values():
            coll.set_lr(LR)
            out = coll(only(kjt, coll.features))
            index = torch.tensor([FEATURES.index(f) * DIM + c for f in coll.features for c in range(DIM)])
            (out * upstream[:, index]).sum().backward()
            for i, f in enumerate(coll.features):
                columns[f] = out.detach()[:, i * DIM : (i + 1) * DIM]
        pooled.append(torch.cat([columns[f] for f in FEATURES], dim=1))
    tables = {}
    for coll in groups.values():
        tables.update({k: v.clone() for k, v in coll.export_tables().items()})
    return tables, pooled


def only(kjt: JaggedFeatures, features: list[str]) -> JaggedFeatures:
    """The bags of ``features`` alone."""
    keys, batch = kjt.keys(), kjt.stride()
    per_feature = kjt.lengths().view(len(keys), batch)
    values = kjt.values().split(per_feature.sum(dim=1).tolist())
    pick = [keys.index(f) for f in features]
    return JaggedFeatures(keys=features, values=torch.cat([values[i] for i in pick]),
                          lengths=torch.cat([per_feature[i] for i in pick]), stride=batch)


def check(results: dict, world_size: int, rank: int) -> None:
    for (plan_name, optim), (tables, pooled) in results.items():
        want, want_pooled = train_groups_alone(optim)
        label = f"W={world_size} {plan_name} {optim}"
        for key, value in want.items():
            if key.endswith(".weight"):
                name = key.split(".")[0]
                assert tables[key].dtype == {"fp32": torch.float32, "bf16": torch.bfloat16,
                                             "fp16": torch.float16}[DTYPES[name]], key
                if DTYPES[name] == "fp32":  # a column shard's row-wise Adagrad sums in another order
                    torch.testing.assert_close(tables[key], value, rtol=1e-5, atol=1e-6, msg=f"{label} {key}")
                else:  # rounded stochastically by (table, row, column): the same bits
                    assert torch.equal(tables[key], value), f"{label} {key}"
            elif not key.endswith(".rounding_step"):  # the fp32 group alone keeps no rounding count
                torch.testing.assert_close(tables[key], value, rtol=1e-5, atol=1e-7, msg=f"{label} {key}")
        start, end = rank_rows(rank, world_size)
        for got, full in zip(pooled, want_pooled, strict=True):
            torch.testing.assert_close(got, full[start:end], rtol=1e-5, atol=1e-6)


def test_one_process_mixed_equals_each_group_alone() -> None:
    check(train_sharded(0, 1, [("mixed", "rowwise_adagrad"), ("column_wise", "adam"), ("data_parallel", "sgd")]),
          1, 0)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_mixed_equals_each_group_alone() -> None:
    per_rank = run_ranks(2, train_sharded, CASES)
    for rank in range(2):
        check(per_rank[rank], 2, rank)


def test_plan_bytes_per_table_follow_its_dtype() -> None:
    tables = mixed_tables()
    plan = fixed_plan(tables, 4, {t.name: (ShardingType.TABLE_WISE, [i]) for i, t in enumerate(tables)})
    memory = plan_memory(plan, tables, make_sparse_optimizer("sgd"), batch_size=8)
    for i, t in enumerate(tables):
        itemsize = 4 if t.dtype == "fp32" else 2
        assert memory[i].tables == t.rows * t.dim * itemsize, t.name
    from embeddings.plan.describe import describe_plan

    lines = describe_plan(plan, tables, memory).splitlines()
    for t in tables:
        assert any(line.split()[:3] == [t.name, f"{t.rows:,}x{t.dim}", t.dtype] for line in lines), t.name


def run_train(tiny_data, run: Path, **extra) -> dict:
    from dlrm.config import load_config
    from dlrm.train.trainer import train
    from tests.conftest import TINY, tiny_overrides

    cfg = load_config(TINY, tiny_overrides(**{"data.train": tiny_data["train"], **extra}))
    return train(cfg, run, echo=lambda s: None)


MIXED = {"embeddings.dtypes.C1": "bf16", "embeddings.dtypes.C2": "fp16", "embeddings.dtypes.C3": "bf16"}


@pytest.mark.slow
def test_mixed_run_checkpoints_each_table_in_its_type_and_resumes_bit_exact(tiny_data, tmp_path: Path) -> None:
    from tests.run_state import run_state

    extra = {**MIXED, "train.max_steps": 30}
    run_train(tiny_data, tmp_path / "straight", **extra)
    run_train(tiny_data, tmp_path / "resumed", **{**extra, "train.max_steps": 12})
    run_train(tiny_data, tmp_path / "resumed", **extra)
    # one process, several dtypes: the sharded collection on one rank (keys name whole-table shards)
    a, b = ({k.replace("/rows0/cols0", ""): v for k, v in run_state(tmp_path / r).items()}
            for r in ("straight", "resumed"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert a["tables.C1.weight"].dtype == torch.bfloat16
    assert a["tables.C2.weight"].dtype == torch.float16
    assert a["tables.C4.weight"].dtype == torch.float32


def test_unknown_table_in_dtypes_is_one_line(tiny_data, tmp_path: Path, capsys) -> None:
    from dlrm.cli import main

    code = main(["train", "--config", "configs/tiny.yaml", "--out", str(tmp_path / "run"),
                 f"data.train={tiny_data['train']}", "train.progress=false", "embeddings.dtypes.nope=bf16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "embeddings.dtypes" in err[0] and "'nope'" in err[0], err


def test_hotline_with_several_dtypes_is_accepted(tiny_data, tmp_path: Path, capsys) -> None:
    """Per-table dtypes under Hotline (one collection per dtype, embeddings/hotline/
    mixed.py) train through the CLI: each table is checkpointed in its own type.
    Equality with ordinary training: tests/test_hotline_mixed.py."""
    from dlrm.cli import main
    from tests.run_state import run_state

    code = main(["train", "--config", "configs/tiny.yaml", "--out", str(tmp_path / "run"),
                 f"data.train={tiny_data['train']}", "train.progress=false", "train.max_steps=4", "data.eval=",
                 "embeddings.placement=hotline", "embeddings.dtypes.C1=bf16", "embeddings.dtypes.C2=fp16"])
    assert code == 0, capsys.readouterr().err
    state = {k.replace("/rows0/cols0", ""): v for k, v in run_state(tmp_path / "run").items()}
    assert state["tables.C1.weight"].dtype == torch.bfloat16
    assert state["tables.C2.weight"].dtype == torch.float16
    assert state["tables.C3.weight"].dtype == torch.float32
