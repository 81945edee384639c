"""A count-min sketch of (table, value) counts: the min_frequency pre-filter of the
vocabulary pass (see data/fit_split.py).

    key = value_keys(value) ^ table's salt ──splitmix64──► h
    row 0 counter h mod w, row 1 counter (h >> 32) mod w   (uint8, saturating at 255)
    estimate = min of the two counters  >=  the true count

A counter only ever adds the counts of every key that hashes to it, so the estimate
never falls below the true count (saturation keeps 255, read as "at least 255").
Memory is 2 bytes per counter, whatever the number of distinct values: the width is
sized from the footers' row counts (about one counter per two values counted, at
most :data:`MAX_WIDTH`), so the long tail (values seen once or twice) mostly lands in
counters too low to reach min_frequency and is dropped before exact counting.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data.hashing import splitmix64
from data.vocabulary import value_keys

MAX_WIDTH = 1 << 27  # counters per row: 256 MiB for both rows
_SAT = 255


def _salt(table: str) -> np.uint64:
    return np.uint64(int.from_bytes(table.encode()[:8].ljust(8, b"\0"), "little") * 0x9E3779B1
                     % (1 << 64))


class Sketch:
    """Two rows of ``width`` saturating uint8 counters over (table, value) keys."""

    def __init__(self, width: int, tables: set[str] | None = None) -> None:
        self.width = width
        self.counts = np.zeros((2, width), np.uint8)
        self.tables = tables or set()

    @staticmethod
    def width_for(values: int) -> int:
        """A power of two near ``values`` / 2, between 1024 and :data:`MAX_WIDTH`."""
        return int(min(MAX_WIDTH, max(1024, 1 << max(0, (values // 2 - 1).bit_length()))))

    @staticmethod
    def merged(parts: list, width: int, tables: set[str]) -> Sketch:
        """The sum of the ``parts`` that are sketches (another rank's empty share gives {})."""
        sketches = [p for p in parts if isinstance(p, Sketch)]
        out = sketches[0] if sketches else Sketch(width)
        for p in sketches[1:]:
            out.add(p)
        out.tables = tables
        return out

    def _index(self, table: str, values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        keys = value_keys(pc.drop_null(values)).view(np.uint64) ^ _salt(table)
        h = splitmix64(keys)
        mask = np.uint64(self.width - 1)
        return (h & mask).astype(np.int64), ((h >> np.uint64(32)) & mask).astype(np.int64)

    def add(self, other_or_table, values: pa.Array | None = None) -> Sketch:
        """Count ``values`` of ``table`` (``add(table, values)``), or add another sketch."""
        if isinstance(other_or_table, Sketch):  # saturating, in place, 1M counters at a time
            for a, b in zip(self.counts.reshape(-1, min(self.width, 1 << 20)),
                            other_or_table.counts.reshape(-1, min(self.width, 1 << 20))):
                a[:] = np.minimum(a.astype(np.uint16) + b, _SAT)
            return self
        for row, idx in enumerate(self._index(other_or_table, values)):
            u, c = np.unique(idx, return_counts=True)
            self.counts[row, u] = np.minimum(self.counts[row, u].astype(np.int64) + c, _SAT)
        return self

    def estimates(self, table: str, values: pa.Array) -> np.ndarray:
        """uint8 [non-null values]: each value's estimate (at least its true count, 255
        read as "at least 255")."""
        i0, i1 = self._index(table, values)
        return np.minimum(self.counts[0, i0], self.counts[1, i1])

    def survivors(self, table: str, values: pa.Array, min_frequency: int) -> pa.Array:
        """The non-null ``values`` whose estimate can reach ``min_frequency``."""
        values = pc.drop_null(values)
        return values.filter(pa.array(self.estimates(table, values) >= min(min_frequency, _SAT)))
