"""``dlrm plan``: print the sharding plan a run would use, and each rank's memory.

    dlrm plan --config configs/bench.yaml --world-size 8 --memory-per-rank 16GB

The schema comes from ``--data`` or the config's ``data.train`` when either is
given (Parquet footers only), else from its ``generate:`` section, so a plan can be
looked at before any data exists. Nothing is launched; only torch is imported.
"""

from __future__ import annotations

import argparse

from data.schema import Schema
from dlrm.config import Config, TablePlacement
from embeddings.plan.types import ShardingPlan, ShardingType


def cmd_plan(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="dlrm plan", description="Print the sharding plan and per-rank memory of a run."
    )
    p.add_argument("--config", required=True, help="YAML config (see configs/)")
    p.add_argument("--world-size", type=int, required=True, help="ranks to plan for")
    p.add_argument("--memory-per-rank", default=None,
                   help='budget like "16GB" or "512MiB" (default: embeddings.memory_per_rank)')
    p.add_argument("--data", default=None,
                   help="Parquet file, directory or glob (default: data.train)")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    a = p.parse_args(argv)
    from dlrm.config import load_config

    cfg = load_config(a.config, a.overrides)
    schema, pooling = run_schema(cfg, a.data)
    _, text = plan_from_config(
        cfg, schema, a.world_size, memory_per_rank=a.memory_per_rank, pooling_factors=pooling
    )
    print(text)
    return 0


def run_schema(cfg: Config, data: str | None = None) -> tuple[Schema, dict[str, float]]:
    """The schema of the run's data and its known pooling factors (feature → mean ids
    per sample): from ``data`` or ``cfg.data.train`` if set (factors unknown, so
    empty), else from ``cfg.generate`` (a multi-hot bag averages max_bag / 2 ids)."""
    spec = data or cfg.data.train
    if spec:
        from data.files import expand_paths
        from data.schema import infer_schema

        schema = infer_schema(
            expand_paths(spec),
            label=cfg.data.label,
            dense=cfg.data.dense or None,
            sparse=cfg.data.sparse or None,
            rows=cfg.data.rows or None,
            tables=cfg.data.tables or None,
        )
        return schema, {}
    from data.generate import generator_schema

    schema = generator_schema(cfg.generate)
    bag = cfg.generate.max_bag / 2
    return schema, {f.name: bag for f in schema.sparse if f.multi_hot}


def pinned_tables(plan: dict[str, TablePlacement]) -> dict[str, tuple[ShardingType, list[int]]]:
    """``embeddings.plan`` of the config as auto_plan's ``pinned``."""
    return {name: (ShardingType(p.sharding), list(p.ranks)) for name, p in plan.items()}


def plan_from_config(
    cfg: Config,
    schema: Schema,
    world_size: int,
    *,
    memory_per_rank: str | None = None,
    pooling_factors: dict[str, float] | None = None,
) -> tuple[ShardingPlan, str]:
    """The plan of a run of ``cfg`` on ``world_size`` ranks and its description.

    ``memory_per_rank`` (a size string) replaces ``cfg.embeddings.memory_per_rank``
    when given. A table that does not fit, or a bad pin, is a PlanError.
    """
    from dlrm.parallel.parallelize import tables_from_schema
    from embeddings.optim import make_sparse_optimizer
    from embeddings.plan.planner import auto_plan
    from embeddings.plan.sizes import parse_size

    tables = tables_from_schema(schema, cfg.model.embedding_dim, cfg.embeddings.pooling)
    optimizer = make_sparse_optimizer(cfg.optim.sparse, cfg.optim.eps)
    size = cfg.embeddings.memory_per_rank if memory_per_rank is None else memory_per_rank
    budget = parse_size(size)
    batch = cfg.data.batch_size
    plan = auto_plan(
        tables,
        world_size,
        optimizer,
        batch_size=batch,
        memory_per_rank=budget,
        replicate_max_bytes=cfg.embeddings.replicate_max_bytes,
        pinned=pinned_tables(cfg.embeddings.plan),
        pooling_factors=pooling_factors,
    )
    return plan, describe(cfg, schema, plan, budget, pooling_factors)


def describe(
    cfg: Config,
    schema: Schema,
    plan: ShardingPlan,
    budget: int | None = None,
    pooling_factors: dict[str, float] | None = None,
) -> str:
    """A plan's tables and each rank's memory, as printed at the start of a run."""
    from dlrm.parallel.parallelize import tables_from_schema
    from embeddings.optim import make_sparse_optimizer
    from embeddings.plan.describe import describe_plan
    from embeddings.plan.estimate import plan_memory

    tables = tables_from_schema(schema, cfg.model.embedding_dim, cfg.embeddings.pooling)
    optimizer = make_sparse_optimizer(cfg.optim.sparse, cfg.optim.eps)
    memory = plan_memory(plan, tables, optimizer, cfg.data.batch_size, pooling_factors)
    return describe_plan(plan, tables, memory, budget)
