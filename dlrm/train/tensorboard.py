"""``train.tensorboard=true``: the numbers of RUN/metrics.jsonl also as TensorBoard
scalars in RUN/tensorboard/ (rank 0 only), for watching a long run live:

    metrics.jsonl record                          TensorBoard scalar (x = step)
    {"event": "train",   "step": s, "loss": ..}   train/loss, train/samples_per_s,
                                                  train/window_samples_per_s
    {"event": "hotline", "step": s, ..}           hotline/hot_hit_rate, hotline/popular_share,
                                                  hotline/gather_hidden, hotline/gather_ms, ..
    {"event": "eval",    "step": s, "auc": ..}    eval/auc, eval/logloss, eval/ne, ..
    {"event": "summary", "steps": s, ..}          summary/samples_per_s, summary/eval_auc,
                                                  summary/hotline/hot_hit_rate, ..

Every number of a record is written (a nested dict's too; lists and strings are
left to the JSON lines), so a new metric shows up in both places without touching this.
``tensorboard`` is an optional package: asking for the writer without it is one
line saying how to install it.
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Any

from dlrm.config import ConfigError

DIR = "tensorboard"  # RUN/tensorboard/


class TensorBoardLog:
    """Scalars of metrics records, written with ``torch.utils.tensorboard.SummaryWriter``."""

    def __init__(self, run_dir: Path) -> None:
        self.writer = summary_writer()(log_dir=str(Path(run_dir) / DIR))

    def write(self, record: dict[str, Any]) -> None:
        """One record's numbers as ``{event}/{key}`` at its step; flushed, so a
        TensorBoard watching the directory sees them at once (records come every
        train.log_every steps: a flush each costs nothing that matters)."""
        event = record.get("event", "metrics")
        step = record.get("step", record.get("steps", 0))
        for key, value in scalars(record).items():
            self.writer.add_scalar(f"{event}/{key}", value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The record's numbers (not booleans, not its step) by key; a nested dict's as
    ``key/inner`` (the summary's whole-run ``hotline`` stats)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if not prefix and key in ("event", "step", "steps"):
            continue
        if isinstance(value, dict):
            out.update(scalars(value, f"{prefix}{key}/"))
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = float(value)
    return out


def summary_writer() -> type:
    """torch's SummaryWriter; a ConfigError (one line) where tensorboard is not
    installed. Every rank asks, so a job without it stops on all ranks at once."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's module imports the tensorboard package
        raise ConfigError(
            "train.tensorboard=true needs the tensorboard package: pip install tensorboard"
        ) from None
    return SummaryWriter
