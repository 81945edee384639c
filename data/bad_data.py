"""Bad input under ``data.on_error``: stop at it, or drop it and say exactly what was dropped.

    fail (default)  the first bad value, row group or file stops the run: a DataError naming
                    file, column, row group and row (where there is one)
    skip            it is dropped and kept here as a BadRecord; the run goes on

What a record covers::

    a bad value     file, row_group, column, row        rows = 1          (its whole row dropped)
    a row group     file, row_group, row = first row    rows = slice size (unreadable, vanished,
                    of the slice this rank read                            or changed while read)
    a whole file    file, row = 0                       rows = its rows   (columns or types differ
                                                        (None: unknown)    from the schema; footer
                                                                           unreadable, truncated)

A file left out at the start never enters the reader's layout; everything else is dropped
where the layout put it: steps per epoch, which rank reads which row and every other row's
batch are those of the same files without the drop, so every rank and a resumed run drop
the same rows (batches just come out shorter, possibly empty).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass

ON_ERROR = ("fail", "skip")


@dataclass(frozen=True)
class BadRecord:
    """One bad value, row-group slice or file; see the module docstring."""

    file: str
    reason: str
    row_group: int | None = None
    column: str | None = None
    row: int | None = None  # within the file
    rows: int | None = None  # rows covered from ``row`` on (None: unknown)

    def __post_init__(self) -> None:
        # Python ints: a count or index worked out in numpy (a row group's slice) is an
        # np.int64, which json cannot write (the run then ended at its final save, its
        # bad-data record lost; found 2026-12-07)
        for name in ("row_group", "row", "rows"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, int(value))

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> BadRecord:
        return BadRecord(**{k: d.get(k) for k in BadRecord.__dataclass_fields__})


class BadDataLog:
    """The distinct records found so far, in the order found (safe to add from any thread)."""

    def __init__(self, records: Iterable[BadRecord] = ()) -> None:
        self._records: dict[BadRecord, None] = dict.fromkeys(records)
        self._lock = threading.Lock()

    def add(self, records: Iterable[BadRecord]) -> None:
        with self._lock:
            self._records.update(dict.fromkeys(records))

    @property
    def records(self) -> list[BadRecord]:
        with self._lock:
            return list(self._records)

    def __len__(self) -> int:
        return len(self._records)


def count(records: Iterable[BadRecord]) -> dict[str, int]:
    """``rows``: distinct rows the records cover (files of unknown size count none);
    ``row_groups``: distinct (file, row group) with a bad row or slice; ``files``:
    whole files left out."""
    spans: dict[str, list[tuple[int, int]]] = {}
    groups, files = set(), set()
    for r in records:
        if r.row_group is not None:
            groups.add((r.file, r.row_group))
        else:
            files.add(r.file)
        if r.row is not None and r.rows:
            spans.setdefault(r.file, []).append((r.row, r.row + r.rows))
    rows = 0
    for intervals in spans.values():
        end = -1
        for a, b in sorted(intervals):  # union of [a, b): count what is new past ``end``
            rows += max(0, b - max(a, end))
            end = max(end, b)
    return {"rows": rows, "row_groups": len(groups), "files": len(files)}
