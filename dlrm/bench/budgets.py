"""``dlrm bench --hotline-budgets 64MB,128MB,512MB,2GB``: Hotline at several budgets.

    engine "hotline@128MB" = the hotline row's overrides + hotline.budget=128MB

Each budget is one more bench row (same data, steps, ranks); the sweep is then a
table (budget, hot hit rate, popular share, samples/s) and OUT/bench_budgets.png:
samples/s and hit rate against the budget, the curve users choose a budget from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from data.atomic import atomic_path
from data.errors import UserError
from embeddings.plan.sizes import parse_size

SEP = "@"


def budget_engines(spec: str | None) -> list[str]:
    """``"64MB,2GB"`` → ``["hotline@64MB", "hotline@2GB"]``; a bad size is one line."""
    if not spec:
        return []
    out = []
    for part in (p.strip() for p in spec.split(",")):
        try:
            ok = bool(part) and (parse_size(part) or 0) > 0
        except (ValueError, UserError):  # parse_size names the size, not the flag
            ok = False
        if not ok:
            raise UserError(f"--hotline-budgets: {part!r} is not a size such as 128MB or 2GB")
        out.append(f"hotline{SEP}{part}")
    return out


def split_engine(engine: str) -> tuple[str, list[str]]:
    """(the base engine, extra overrides): ``hotline@64MB`` → (hotline, [hotline.budget=64MB])."""
    if SEP not in engine:
        return engine, []
    base, budget = engine.split(SEP, 1)
    return base, [f"hotline.budget={budget}"]


def sweep_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sweep's rows, smallest budget first: budget, bytes, hit rate, popular share, samples/s."""
    out = []
    for row in rows:
        _, extra = split_engine(row["engine"])
        if not extra or not row.get("hotline"):
            continue
        budget = extra[0].split("=", 1)[1]
        out.append({"budget": budget, "budget_bytes": parse_size(budget) or 0, "ranks": row["ranks"],
                    "hot_hit_rate": row["hotline"]["hot_hit_rate"],
                    "popular_share": row["hotline"]["popular_share"],
                    "samples_per_s": row["samples_per_s"]})
    return sorted(out, key=lambda r: (r["ranks"], r["budget_bytes"]))


def format_sweep(sweep: list[dict[str, Any]]) -> str:
    lines = ["hotline.budget sweep:", f"{'budget':>8} {'ranks':>5} {'hit rate':>9} {'popular':>8} {'samples/s':>11}"]
    for r in sweep:
        lines.append(f"{r['budget']:>8} {r['ranks']:>5} {r['hot_hit_rate']:>9.1%} "
                     f"{r['popular_share']:>8.1%} {r['samples_per_s']:>11,.0f}")
    return "\n".join(lines)


def write_sweep_png(path: Path, sweep: list[dict[str, Any]]) -> None:
    """samples/s (left axis) and hot hit rate / popular share (right) per budget."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    labels = [f"{r['budget']}\n{r['ranks']} rank(s)" for r in sweep]
    ax.plot(labels, [r["samples_per_s"] for r in sweep], "o-", color="tab:green", label="samples/s")
    ax.set(xlabel="hotline.budget", ylabel="samples/s", title="Hotline: throughput and hit rate per budget")
    share = ax.twinx()
    share.plot(labels, [r["hot_hit_rate"] for r in sweep], "s--", color="tab:blue", label="hot hit rate")
    share.plot(labels, [r["popular_share"] for r in sweep], "^:", color="tab:orange", label="popular share")
    share.set(ylabel="share", ylim=(0, 1.05))
    fig.legend(loc="lower right")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
