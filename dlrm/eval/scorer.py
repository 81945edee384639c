"""Scoring rows held in memory, from Python: a trained run's model (or an export's)
behind one call, with the run's own preprocessing.

    from dlrm.eval.scorer import Scorer

    with Scorer("runs/ctr") as scorer:          # a run directory (newest checkpoint) or
        p = scorer.score(frame)                  #   a `dlrm export` directory
                                                 # frame: pandas DataFrame, pyarrow Table
                                                 #   or RecordBatch with the data's columns
                                                 # p: float64 [rows], click probabilities

    raw columns ──decode_table (data/reader.py)──► Batch ──model──► sigmoid ──► p
                  the reader's own decoding: vocabularies, hashing, dense transforms,
                  type and value checks; unseen ids as `dlrm eval` takes them

A score here is the score `dlrm eval --scores` writes for the same row: the same
decoding and the same model, in batches of ``data.eval_batch_size``. The label column
may be absent, or hold anything (rows not labelled yet: NaN, None): it is not read, as
``dlrm predict`` does not read it; other columns beside the data's are ignored. The
model is loaded once, on ``device`` (default cpu), in this process alone: a serving
process under torchrun does not join its job. A bad value is one DataError naming the
column and the row (counted within the rows given).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Self

import numpy as np
import torch

from data.errors import DataError, UserError
from data.reader import decode_table
from data.schema import column_kind
from dlrm.eval.evaluate import open_scored
from dlrm.eval.model import eval_model
from dlrm.eval.predict import predict
from dlrm.parallel.distributed import DistInfo
from dlrm.train.inputs import eval_id_policy


class Scorer:
    """A run's or an export's model, loaded once, scoring rows given in memory."""

    def __init__(self, path: str | Path, device: str = "cpu", strict_ids: bool = False) -> None:
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise UserError(f"device {device}: this machine has no CUDA device; score on the CPU (device cpu)")
        with contextlib.ExitStack() as hold:  # the checkpoint stays while it is read
            cfg, self.schema, self._prep, fill, self.source = open_scored(Path(path), hold)
            cfg.data.eval_strict_ids = strict_ids
            self.device = torch.device(device)
            info = DistInfo(device=self.device)
            self.model = eval_model(cfg, self.schema, info)
            fill(self.model, info)
        self.batch_size = cfg.data.eval_batch_size
        self._id_policy, self._dense_nan = eval_id_policy(cfg), cfg.data.dense_nan
        self.unseen_ids: dict[str, int] = {}  # ids past their trained table, by column (all calls)

    def score(self, rows: Any) -> np.ndarray:
        """Click probabilities (float64 [n]) of ``rows``: a pandas DataFrame, a pyarrow
        Table or RecordBatch holding the data's columns (the label may be left out)."""
        table = self._table(rows)
        batches = (decode_table(table.slice(a, self.batch_size), self.schema, id_policy=self._id_policy,
                                dense_nan=self._dense_nan, preprocess=self._prep,
                                row0=a, unseen=self.unseen_ids)
                   for a in range(0, table.num_rows, self.batch_size))
        scores, _ = predict(self.model, batches, self.device)
        return scores.numpy()

    def _table(self, rows: Any) -> Any:
        """``rows`` as a pyarrow Table with every column of the schema (the label, never
        scored, replaced by zeros: the reader refuses a null one). A dictionary of
        numbers (a pandas ``category`` column of ids) is taken as its values; the reader
        takes only strings dictionary-encoded, as it reads them."""
        import pyarrow as pa

        if isinstance(rows, pa.RecordBatch):
            table = pa.Table.from_batches([rows])
        elif isinstance(rows, pa.Table):
            table = rows
        else:  # pandas, or anything pyarrow takes as columns
            table = pa.Table.from_pandas(rows, preserve_index=False) if hasattr(rows, "iloc") else pa.table(rows)
        for i, field in enumerate(table.schema):  # pandas "category" columns of numbers
            if pa.types.is_dictionary(field.type) and column_kind(field.type.value_type) != "category":
                table = table.set_column(i, field.name, table.column(i).cast(field.type.value_type))
        label = self.schema.label
        if label in table.column_names:
            table = table.drop_columns([label])
        table = table.append_column(label, pa.array(np.zeros(table.num_rows, np.float32)))
        names = set(table.column_names)  # a set: column_names is a list built per call
        missing = [c for c in self.schema.columns if c not in names]
        if missing:
            raise DataError(f"column is missing from the rows to score (the model reads "
                            f"{len(self.schema.columns) - 1}: the run's dense and sparse features)",
                            column=missing[0])
        return table

    def close(self) -> None:
        self.model.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

