"""Which rows each rank trained on (``train.trace_rows=COLUMN``): the exactly-once record.

    RUN/trace/rank-R.jsonl     one line per optimizer step, once its update is done:
        {"step": 12, "epoch": 1, "batch": 3, "start": 8, "rows": [417, 12, ...]}

``rows``: the values of COLUMN in the step's samples on this rank, in batch order
(a dense column holding integers below 2**24, exact in float32, or a single-hot
sparse column). ``batch``: the step's first batch of the epoch. ``start``: the step
this process began at (0, or the checkpoint it resumed): after a restart the steps
between the checkpoint and the kill run again, with a larger ``start``, and
replace the lost ones. Lines are appended, so a run resumed keeps its history.
"""

from __future__ import annotations

import json
from pathlib import Path

from data.batch import Batch
from data.schema import Schema
from dlrm.checkpoint.manager import Progress


class RowTrace:
    """Appends this rank's rows of every step to RUN/trace/rank-R.jsonl."""

    def __init__(self, run_dir: Path, column: str, schema: Schema, rank: int, start: int) -> None:
        from dlrm.config import ConfigError

        single_hot = [f.name for f in schema.sparse if not f.multi_hot]
        if column in schema.dense:
            self.dense_index: int | None = schema.dense.index(column)
        elif column in single_hot:
            self.dense_index = None
        else:
            raise ConfigError(
                f"train.trace_rows={column!r}: not a dense or single-hot sparse column of the data "
                f"(dense: {', '.join(schema.dense)}; single-hot: {', '.join(single_hot)})"
            )
        self.column, self.start = column, start
        self.path = Path(run_dir) / "trace" / f"rank-{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def rows(self, batch: Batch) -> list[int]:
        if batch.size == 0:  # a rank whose share of the epoch ran out
            return []
        if self.dense_index is not None:
            return batch.dense[:, self.dense_index].round().long().tolist()
        return batch.sparse[self.column].values().tolist()

    def write(self, progress: Progress, first_batch: int, batches: list[Batch]) -> None:
        """Record the step ``progress`` just completed, made of ``batches``."""
        rows = [r for b in batches for r in self.rows(b)]
        record = {"step": progress.global_step, "epoch": progress.epoch, "batch": first_batch,
                  "start": self.start, "rows": rows}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
