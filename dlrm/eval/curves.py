"""Training curves of a run, drawn from RUN/metrics.jsonl to one PNG (``dlrm plot RUN``).

    ┌ RUN: training curves ─────────────────────────────┐
    │ loss        train BCE per log window ──, eval ●   │  one x axis: optimizer step
    │ eval AUC    ● at each eval                        │
    │ samples/s   per log window ──, run's rate - - -   │
    └───────────────────────────────────────────────────┘

The series come from the JSON lines the trainer writes (``{"event": "train"}`` every
train.log_every steps, ``{"event": "eval"}`` at each eval). A resumed run appends
to the same file and may log a step again: the later record of a step wins. A kill
can cut the file's last line short: that line is left out, any other unreadable line
is an error naming it. matplotlib is imported when drawing, on the Agg canvas (no
pyplot state), as in ``plots.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data.atomic import atomic_path
from data.errors import UserError

METRICS = "metrics.jsonl"
CURVES_FILE = "curves.png"


@dataclass
class Curves:
    """What is drawn: (step, value) series, by step."""

    loss: list[tuple[int, float]] = field(default_factory=list)  # train BCE per window
    samples_per_s: list[tuple[int, float]] = field(default_factory=list)  # per window
    eval_auc: list[tuple[int, float]] = field(default_factory=list)
    eval_logloss: list[tuple[int, float]] = field(default_factory=list)
    run_rate: float | None = None  # the summary's samples/s over the timed steps
    best: dict[str, Any] | None = None  # train.keep_best / early_stop: the best eval (summary's "best")
    early_stop: int | None = None  # the step an early stop ended the run at


def read_curves(run_dir: str | Path) -> Curves:
    """The series of RUN/metrics.jsonl; a UserError (one line) naming the file
    when it is missing, holds no training record yet, or has a bad line."""
    by_step: dict[str, dict[int, float]] = {k: {} for k in ("loss", "sps", "auc", "logloss")}
    curves = Curves()
    for record in _records(Path(run_dir) / METRICS):
        event, step = record.get("event"), record.get("step")
        if event == "train" and step is not None:
            by_step["loss"][step] = record["loss"]
            by_step["sps"][step] = record.get("window_samples_per_s", record["samples_per_s"])
        elif event == "eval" and step is not None:
            by_step["auc"][step] = record["auc"]
            by_step["logloss"][step] = record["logloss"]
        elif event == "summary" and record.get("trained_steps", 1):  # not a finished run's rerun
            curves.run_rate = record.get("samples_per_s")
        if event == "summary":
            curves.best, curves.early_stop = record.get("best", curves.best), record.get("early_stopped")
    if not by_step["loss"]:
        raise UserError(f"{Path(run_dir) / METRICS}: no training records yet "
                        "(the trainer writes one every train.log_every steps)")
    curves.loss, curves.samples_per_s, curves.eval_auc, curves.eval_logloss = (
        sorted(by_step[k].items()) for k in ("loss", "sps", "auc", "logloss"))
    return curves


def _mark_best(curves: Curves, *axes: Any) -> None:
    """train.keep_best / early_stop: a line at the best eval's step and one where the
    run stopped early (labelled on the first axes)."""
    for n, ax in enumerate(axes):
        if curves.best and curves.best.get("step") is not None:
            b = curves.best
            ax.axvline(b["step"], ls=":", c="tab:green", lw=1.2,
                       label=f"best {b['metric']} {b['value']:.4f} (step {b['step']})" if n == 0 else None)
        if curves.early_stop is not None:
            ax.axvline(curves.early_stop, ls="--", c="tab:red", lw=1,
                       label=f"early stop (step {curves.early_stop})" if n == 0 else None)
    if curves.best or curves.early_stop is not None:
        axes[0].legend(loc="best")


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise UserError(f"{path}: not found (is {path.parent} a run directory of dlrm train?)")
    lines = path.read_text().splitlines()
    out = []
    for n, line in enumerate(lines, 1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines):
                break  # a kill cut the last record short
            raise UserError(f"{path}:{n}: not a JSON record") from None
    return out


def write_curves(run_dir: str | Path, out: str | Path | None = None) -> tuple[Path, Curves]:
    """Draw the run's curves to ``out`` (default RUN/curves.png), atomically; the
    path and the series drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import StrMethodFormatter

    run_dir = Path(run_dir)
    curves = read_curves(run_dir)
    fig = Figure(figsize=(8, 9), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, auc_ax, rate_ax = fig.subplots(3, 1, sharex=True)
    fig.suptitle(f"{run_dir.resolve().name}: training curves")
    loss_ax.plot(*zip(*curves.loss), lw=1.5, label="train loss (mean BCE per log window)")
    if curves.eval_logloss:
        loss_ax.plot(*zip(*curves.eval_logloss), "o", ms=6, label="eval logloss")
    loss_ax.set(ylabel="binary cross-entropy (nats)")
    loss_ax.legend(loc="best")  # "best": away from the points (an eval point sat under a fixed corner)
    if curves.eval_auc:
        auc_ax.plot(*zip(*curves.eval_auc), "o-", ms=6, c="tab:green", label="eval AUC")
        auc_ax.legend(loc="best")
    else:
        auc_ax.text(0.5, 0.5, "no eval in this run (data.eval)", ha="center", va="center",
                    transform=auc_ax.transAxes, color="grey")
    auc_ax.set(ylabel="ROC AUC")
    rate_ax.plot(*zip(*curves.samples_per_s), lw=1.5, c="tab:purple", label="per log window")
    if curves.run_rate:
        rate_ax.axhline(curves.run_rate, ls="--", c="grey", lw=1,
                        label=f"whole run: {curves.run_rate:,.0f} samples/s")
    rate_ax.set(xlabel="optimizer step", ylabel="throughput (samples/s)")
    rate_ax.set_ylim(bottom=0)
    rate_ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    rate_ax.legend(loc="best")
    _mark_best(curves, loss_ax, auc_ax)
    for ax in (loss_ax, auc_ax, rate_ax):
        ax.grid(alpha=0.3)
    path = Path(out) if out is not None else run_dir / CURVES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path, curves
