"""The plan as text: every table's strategy, ranks and shard shapes, then every
rank's memory against the budget (printed at start and by ``dlrm plan``)."""

from __future__ import annotations

from collections import Counter

from embeddings.plan.estimate import RankMemory
from embeddings.plan.sizes import format_bytes
from embeddings.plan.types import ShardingPlan, ShardingType, tables_by_name
from embeddings.sharding.registry import strategy
from embeddings.table import TableSpec


def describe_plan(
    plan: ShardingPlan,
    tables: list[TableSpec],
    memory: list[RankMemory],
    budget: int | None = None,
    process: int | None = None,
) -> str:
    """A readable account of ``plan``: every table's strategy, ranks and shard shapes
    (rows x cols), then every rank's memory (from ``plan_memory``) against ``budget``.
    Where any table is fp16/bf16, each table's size is followed by its dtype.
    ``process``: bytes each rank's process holds besides (a ``process`` column, in the
    total; a last line names each rank whose total is over ``budget``).

        sharding plan: 3 tables over 2 ranks (table_wise 1, row_wise 1, data_parallel 1)
        table  rows x dim         sharding       ranks  shards (rows x cols)
        big    1,000,000x64       row_wise       0-1    2 of 500,000x64
        ...
        rank  tables     optimizer  buffers   total      free of 8.0 GiB
        0     130.0 MiB  0 B        1.1 MiB   131.1 MiB  7.9 GiB
    """
    specs = tables_by_name(tables)
    counts = Counter(tp.sharding for tp in plan.tables.values())
    kinds = ", ".join(f"{k.value} {counts[k]}" for k in ShardingType if counts[k])
    head = f"sharding plan: {len(plan.tables)} tables over {plan.world_size} ranks ({kinds})"
    table_rows = [["table", "rows x dim", "sharding", "ranks", "shards (rows x cols)"]]
    typed = any(t.dtype != "fp32" for t in tables)  # fp16/bf16 tables: each one's type named
    for name, tp in plan.tables.items():
        size = f"{specs[name].rows:,}x{specs[name].dim}" + (f" {specs[name].dtype}" if typed else "")
        how = strategy(tp.sharding)
        ranks = how.describe_ranks(tp, plan.world_size)
        table_rows.append([name, size, tp.sharding.value, ranks, how.describe_shapes(tp)])
    mem_rows = [["rank", "tables", "optimizer", "buffers", *(["process"] if process is not None else []),
                 "total"]]
    if budget is not None:
        mem_rows[0].append(f"free of {format_bytes(budget)}")
    totals = [m.total + (process or 0) for m in memory]
    for r, (m, total) in enumerate(zip(memory, totals)):
        parts = [m.tables, m.optimizer, m.buffers, *([process] if process is not None else []), total]
        row = [str(r), *(format_bytes(b) for b in parts)]
        if budget is not None:
            row.append(format_bytes(budget - total))
        mem_rows.append(row)
    lines = [head, *_align(table_rows), "", *_align(mem_rows)]
    over = [r for r, total in enumerate(totals) if budget is not None and total > budget]
    if over:
        who = f"ranks {', '.join(map(str, over))} need" if len(over) > 1 else f"rank {over[0]} needs"
        lines.append(f"over budget: {who} up to {format_bytes(max(totals) - budget)} more than the "
                     f"{format_bytes(budget)} of memory_per_rank{' once the process is counted' if process else ''}"
                     ": the run would not fit (more ranks, a larger budget, or smaller tables)")
    return "\n".join(lines)


def _align(rows: list[list[str]]) -> list[str]:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
