"""Frequency vocabularies for the Criteo converter: hashed ids → small dense ids.

    count_ids(tables, columns)         one streaming pass: per column, value → count
    FrequencyVocabulary(values, counts, min_frequency)
        .map(ids)                      0 → 0 (empty), kept value → 2 + its rank by
                                       falling count, anything else → 1 (out of vocabulary)

Criteo's categoricals are 32-bit hashes, so tables sized by the largest id need up to
2^32 rows while a column holds at most tens of millions of distinct values. Counting
runs in pyarrow (``value_counts`` per block, partial counts merged by ``group_by``),
mapping in numpy (``searchsorted`` over the kept values): no Python loop per row.
Memory is one (value, count) pair per distinct value of a column, 16 bytes, plus the
unmerged block counts (at most ``_MERGE_AT`` pairs per column).

This is the converter's own mapping, fitted on the train rows only; ``dlrm train``'s
``data.encoding`` does the same for any Parquet (data/preprocess.py) when the ids
it is given are not already dense.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

EMPTY = 0  # an empty field: its own row, as in data.criteo
OOV = 1  # rare in the train rows, or never seen there
FIRST = 2  # the most frequent kept value
_MERGE_AT = 1 << 22  # pending (value, count) pairs per column before they are merged


def count_ids(tables: Iterable[pa.Table], columns: list[str]
              ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per column, (distinct values [V] int64, their counts [V] int64), values sorted."""
    pending: dict[str, list[pa.Table]] = {c: [] for c in columns}
    sizes = dict.fromkeys(columns, 0)
    for table in tables:
        for c in columns:
            pending[c].append(_value_counts(table.column(c)))
            sizes[c] += len(pending[c][-1])
            if sizes[c] > _MERGE_AT and len(pending[c]) > 1:
                pending[c] = [_merge(pending[c])]
                sizes[c] = len(pending[c][0])
    out = {}
    for c in columns:
        merged = _merge(pending[c]).sort_by("value")
        out[c] = (merged.column("value").to_numpy(), merged.column("count").to_numpy())
    return out


def _value_counts(column: pa.ChunkedArray) -> pa.Table:
    import pyarrow as pa
    import pyarrow.compute as pc

    vc = pc.value_counts(column)
    return pa.table({"value": vc.field("values").cast(pa.int64()),
                     "count": vc.field("counts").cast(pa.int64())})


def _merge(parts: list[pa.Table]) -> pa.Table:
    import pyarrow as pa

    if not parts:
        return pa.table({"value": pa.array([], pa.int64()), "count": pa.array([], pa.int64())})
    if len(parts) == 1:
        return parts[0]
    summed = pa.concat_tables(parts).group_by("value").aggregate([("count", "sum")])
    return summed.select(["value", "count_sum"]).rename_columns(["value", "count"])


class FrequencyVocabulary:
    """The values seen at least ``min_frequency`` times (the empty id 0 aside), ranked
    by falling count (ties by value), so the most used rows get the smallest ids."""

    def __init__(self, values: np.ndarray, counts: np.ndarray, min_frequency: int = 1) -> None:
        import numpy as np

        keep = (counts >= min_frequency) & (values != EMPTY)
        values, counts = values[keep], counts[keep]
        ranked = np.lexsort((values, -counts))  # by count, descending; ties by value
        ids = np.empty(len(values), dtype=np.int64)
        ids[ranked] = np.arange(FIRST, FIRST + len(values), dtype=np.int64)
        order = np.argsort(values, kind="stable")
        self._keys = values[order]
        self._ids = ids[order]

    def save(self, path: str) -> None:
        """Its lookup arrays as ``path.keys.npy`` and ``path.ids.npy`` (:meth:`load`)."""
        import numpy as np

        np.save(f"{path}.keys.npy", self._keys)
        np.save(f"{path}.ids.npy", self._ids)

    @classmethod
    def load(cls, path: str) -> FrequencyVocabulary:
        """A vocabulary :meth:`save` wrote, its arrays mapped read-only: the converter's
        writer processes share one copy in the page cache."""
        import numpy as np

        vocab = cls.__new__(cls)
        vocab._keys = np.load(f"{path}.keys.npy", mmap_mode="r")
        vocab._ids = np.load(f"{path}.ids.npy", mmap_mode="r")
        return vocab

    @property
    def rows(self) -> int:
        """The table rows the mapped ids need: the kept values plus EMPTY and OOV."""
        return len(self._keys) + FIRST

    def map(self, ids: np.ndarray) -> np.ndarray:
        """Raw ids [n] int64 → table rows [n] int64 in [0, rows)."""
        import numpy as np

        out = np.full(len(ids), OOV, dtype=np.int64)
        if len(self._keys):
            pos = np.minimum(np.searchsorted(self._keys, ids), len(self._keys) - 1)
            hit = self._keys[pos] == ids
            out[hit] = self._ids[pos[hit]]
        out[ids == EMPTY] = EMPTY
        return out
