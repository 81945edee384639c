"""The tables of a run and their sharding plan, from its config and schema.

    schema ──tables_from_schema──► [TableSpec]  (one per table name; shared tables once)
    config ──plan_from_config────► ShardingPlan (auto_plan with the config's pins and
                                    memory budget) + the text printed at start

``dlrm plan`` and the trainer both come here, so a plan looked at before a job is
the plan the job uses.
"""

from __future__ import annotations

from data.schema import Schema
from dlrm.config import Config, TablePlacement
from embeddings.hotline.profile import row_bytes
from embeddings.optim import make_sparse_optimizer
from embeddings.plan.describe import describe_plan
from embeddings.plan.estimate import plan_memory
from embeddings.plan.planner import auto_plan
from embeddings.plan.sizes import parse_size
from embeddings.plan.types import ShardingPlan, ShardingType
from embeddings.table import Pooling, TableSpec


def tables_from_schema(schema: Schema, dim: int, pooling: str = "sum", dtype: str = "fp32",
                       dtypes: dict[str, str] | None = None) -> list[TableSpec]:
    """One table per distinct table name; a shared table has the largest row count.
    ``dtypes``: per table, over ``dtype``."""
    features: dict[str, list[str]] = {}
    rows: dict[str, int] = {}
    for f in schema.sparse:
        features.setdefault(f.table_name, []).append(f.name)
        rows[f.table_name] = max(rows.get(f.table_name, 0), f.rows)
    return [
        TableSpec(name, rows=rows[name], dim=dim, features=tuple(feats), pooling=Pooling(pooling),
                  dtype=(dtypes or {}).get(name, dtype))
        for name, feats in features.items()
    ]


def run_tables(cfg: Config, schema: Schema) -> list[TableSpec]:
    """The tables of a run of ``cfg`` on ``schema``."""
    return tables_from_schema(schema, cfg.model.embedding_dim, cfg.embeddings.pooling, cfg.embeddings.dtype,
                              cfg.embeddings.dtypes)


def run_schema(cfg: Config, data: str | None = None) -> tuple[Schema, dict[str, float]]:
    """The schema of the run's data and its known pooling factors (feature → mean ids
    per sample): from ``data`` or ``cfg.data.train`` if set (factors unknown, so
    empty), else from ``cfg.generate`` (a multi-hot bag averages max_bag / 2 ids).

    With data, the tables are sized as training will size them: after data.encoding's
    vocabularies and hashing (one pass over the files where a vocabulary is fitted),
    not by the raw ids (Criteo's hashed ids would ask for 2^32 rows per table)."""
    spec = data or cfg.data.train
    if spec:
        from data.files import expand_paths
        from data.preprocess import fit
        from dlrm.train.inputs import check_table_sizes, infer_run_schema, prep_options

        files = expand_paths(spec)
        schema = infer_run_schema(cfg, files)
        schema = fit(files, schema, prep_options(cfg)).apply(schema)
        check_table_sizes(cfg, schema)
        return schema, {}
    from data.generate import generator_schema

    schema = generator_schema(cfg.generate)
    bag = cfg.generate.max_bag / 2
    return schema, {f.name: bag for f in schema.sparse if f.multi_hot}


def sizes_source(cfg: Config, schema: Schema, data: str | None = None) -> str:
    """One line saying where the planned table sizes come from, so a plan made before
    any data exists is not mistaken for the real job's."""
    total = sum(f.rows for f in schema.sparse)
    what = f"{len(schema.sparse)} tables, {total:,} rows in all"
    spec = data or cfg.data.train
    if spec:
        return f"table sizes: from the data {spec} ({what})"
    source = cfg.generate.table_rows_source
    if source:
        return f"table sizes: no data given, generate.table_rows ({what}): {source}"
    return (f"table sizes: no data given, generate.table_rows ({what}), synthetic; "
            "give --data or data.train for the real sizes")


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
    process: int | None = None,
) -> tuple[ShardingPlan, str]:
    """The plan of a run of ``cfg`` on ``world_size`` ranks and its description.

    ``memory_per_rank`` (a size string) replaces ``cfg.embeddings.memory_per_rank``
    when given. A table that does not fit, or a bad pin, is a PlanError. ``process``
    (bytes each rank's process holds besides the plan's, dlrm/parallel/process_memory.py)
    counts in the description's totals only, never in the plan.
    """
    size = cfg.embeddings.memory_per_rank if memory_per_rank is None else memory_per_rank
    budget = parse_size(size)
    plan = auto_plan(
        run_tables(cfg, schema),
        world_size,
        make_sparse_optimizer(cfg.optim.sparse, cfg.optim.eps, cfg.embeddings.state_dtype),
        batch_size=cfg.data.batch_size,
        memory_per_rank=budget,
        replicate_max_bytes=cfg.embeddings.replicate_max_bytes,
        pinned=pinned_tables(cfg.embeddings.plan),
        pooling_factors=pooling_factors,
    )
    return plan, describe(cfg, schema, plan, budget, pooling_factors, process)


def hotline_note(cfg: Config, schema: Schema) -> str:
    """What a plan means under ``embeddings.placement=hotline`` (``dlrm plan`` printed the
    sharded plan alone, as if every table lived on the devices): the plan places the host
    tier, and each device holds at most ``hotline.budget`` of hot rows."""
    optimizer = make_sparse_optimizer(cfg.optim.sparse, cfg.optim.eps, cfg.embeddings.state_dtype)
    costs = sorted({row_bytes(t, optimizer) for t in run_tables(cfg, schema)})
    budget = parse_size(cfg.hotline.budget) or 0
    cost = f"{costs[0]} B" if len(costs) == 1 else f"{costs[0]}-{costs[-1]} B"
    rows = f"up to {budget // costs[0]:,} rows" if costs else "no rows"
    return (f"hotline: the plan above places the tables in host memory (every row, the cold "
            f"tier; embeddings.memory_per_rank bounds it); each rank's device holds the same hot "
            f"rows, at most hotline.budget={cfg.hotline.budget} of them (weights and optimizer "
            f"state, {cost} a row: {rows}), chosen by a profile at the start of dlrm train")


def describe(
    cfg: Config,
    schema: Schema,
    plan: ShardingPlan,
    budget: int | None = None,
    pooling_factors: dict[str, float] | None = None,
    process: int | None = None,
) -> str:
    """A plan's tables and each rank's memory, as printed at the start of a run."""
    tables = run_tables(cfg, schema)
    optimizer = make_sparse_optimizer(cfg.optim.sparse, cfg.optim.eps, cfg.embeddings.state_dtype)
    memory = plan_memory(plan, tables, optimizer, cfg.data.batch_size, pooling_factors)
    return describe_plan(plan, tables, memory, budget, process)
