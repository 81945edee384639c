"""Which row of an old run's table holds the value a row of a new run's table holds.

A warm start (``warm_start.py``) copies rows by value. A table's row of value v
(data/preprocess.py):

    identity     row v
    vocabulary   v's place in the run's vocabulary, from row 1; row 0 is out-of-vocabulary
    hash         1 + splitmix64(v) % (rows - 1): a value keeps its row only between
                 tables of as many rows (then row i is row i)

    new table: vocabulary (run 2)      old table: identity, ids 0..7 (run 1)
    row 0  OOV     ─────────────────►  -1  (the old table has no OOV row: initialised)
    row 1  id 7    ─────────────────►   7
    row 2  id 12   ─────────────────►  -1  (beyond the old table: initialised)
    row 3  id 3    ─────────────────►   3

Between two vocabularies the OOV row 0 is copied to row 0. A :class:`RowMap` answers
for a range of new rows at a time (a shard's, a chunk at a time), so a table of a
billion rows needs no billion-entry array.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from data.preprocess import Preprocessing
from data.schema import Schema
from data.vocabulary import Vocabulary

NONE = -1  # a new row no old row holds the value of


@dataclass(frozen=True)
class Side:
    """One run's table: its encoding, rows and (vocabulary) its values in row order."""

    encoding: str  # identity | vocabulary | hash
    rows: int
    vocabulary: Vocabulary | None = None

    @property
    def ints(self) -> bool:
        """Whether its values are integers (identity ids, or an integer vocabulary)."""
        return self.vocabulary is None or pa.types.is_integer(self.vocabulary.values.type)


@dataclass(frozen=True)
class RowMap:
    """New rows → old rows of the same value (see the module docstring)."""

    new: Side
    old: Side

    def old_rows(self, start: int, stop: int) -> np.ndarray:
        """int64 [stop - start]: the old row of new rows start..stop-1 (-1: none)."""
        if self.new.encoding == "hash" or (self.new.encoding == self.old.encoding == "identity"):
            rows = np.arange(start, stop, dtype=np.int64)
            return np.where(rows < self.old.rows, rows, NONE)
        out = np.full(stop - start, NONE, np.int64)
        first = start
        if self.new.encoding == "vocabulary":
            if start == 0:  # the OOV row: only another vocabulary has one
                out[0] = 0 if self.old.encoding == "vocabulary" else NONE
                first = 1
            if first >= stop:
                return out
            assert self.new.vocabulary is not None
            values = self.new.vocabulary.values.slice(first - 1, stop - first)
        else:
            values = pa.array(np.arange(start, stop, dtype=np.int64))
        out[first - start:] = self._old_rows_of(values)
        return out

    def _old_rows_of(self, values: pa.Array) -> np.ndarray:
        """The old rows of distinct, non-null ``values`` (-1: none)."""
        if self.old.encoding == "identity":
            v = values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
            return np.where((v >= 0) & (v < self.old.rows), v, NONE)
        assert self.old.vocabulary is not None
        rows = self.old.vocabulary.lookup(values, distinct=True)
        return np.where(rows > 0, rows, NONE)


def row_map(new: Side, old: Side) -> tuple[RowMap | None, str]:
    """The map between two runs' tables of one name; or None and why none can be made."""
    if "hash" in (new.encoding, old.encoding):
        if new.encoding != old.encoding:
            return None, f"{old.encoding} there, {new.encoding} here"
        if new.rows != old.rows:
            return None, f"hashed into {old.rows:,} rows there, {new.rows:,} here"
        return RowMap(new, old), ""
    for side, where in ((new, "here"), (old, "there")):
        if side.encoding == "vocabulary" and side.vocabulary is None:
            return None, f"no vocabulary {where}"
        if side.encoding not in ("identity", "vocabulary"):
            return None, f"encoding {side.encoding} {where}"
    if new.ints != old.ints:
        kinds = {True: "integer", False: "string"}
        return None, f"{kinds[old.ints]} values there, {kinds[new.ints]} here"
    return RowMap(new, old), ""


def sides(schema: Schema, preprocess: Preprocessing | None) -> dict[str, Side]:
    """Each table of ``schema`` (by table name) as a :class:`Side`."""
    vocabularies = preprocess.vocabularies if preprocess is not None else {}
    return {f.table_name: Side(f.encoding, f.rows, vocabularies.get(f.table_name))
            for f in schema.sparse}
