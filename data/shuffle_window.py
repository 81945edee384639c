"""``data.shuffle_buffer``: the rows of a shuffle window, ``auto`` read from the footers.

    rank's range   |     window 0      |     window 1      |     window 2      | ...
    row groups      [g7   ][g2   ][g11  ][g4   ][g0   ][g9   ][g3   ][g5   ][g8...
                                        ^ g4 straddles windows 0 and 1

A window is the unit of the reader's shuffle and of its decode workers
(data/decode_workers.py: window k goes to worker k mod N). pyarrow decodes whole row
groups, so a row group that straddles two windows is decoded twice once those windows
go to two workers (one process keeps the last row group for the next window). Each
window boundary costs at most one row group, the largest at worst, so
``auto`` = ``ROW_GROUPS_PER_WINDOW`` x the largest row group of the files (at least
``MIN_ROWS``) bounds the rows decoded to about ``1 + 1 / ROW_GROUPS_PER_WINDOW`` times
the rows read, at any worker count (the window is rounded down to whole batches, so a
little more where a rank's batch is a large part of it); at the old fixed 65,536 and
64k-row groups it was up to twice. ``MAX_BYTES`` caps a window's records where row groups are huge (a 1M-row
group would ask for 4M rows, a GB per worker): there windows hold fewer row groups.

The value depends on nothing but the files' footers (the same on every rank, for every
epoch and on resume), never on the worker count: batches stay the same at any
``data.workers``. A run saves the value it resolved in RUN/config.yaml and in every
checkpoint, and ``auto`` on resume takes the checkpoint's (dlrm/train/inputs.py), so
a run written under an older default keeps its batches.
"""

from __future__ import annotations

from data.schema import Schema

AUTO = "auto"
ROW_GROUPS_PER_WINDOW = 4
MIN_ROWS = 65536  # the fixed default before auto (small row groups: windows as before)
MAX_BYTES = 256 << 20  # a window's records at most (one window per decode worker)


def row_bytes(schema: Schema) -> int:
    """A window's bytes per row at most: its record at its widest (ids int64, dense and
    label float32, whole int64s; data/rows.py narrows the ids to int32 where the tables
    allow, and the cap stays this, so the windows and thus the batches never depend on
    the tables' sizes) and its place in the shuffle's permutation (int64). Bags of
    multi-hot features are held beside the records, 8 bytes per id, and not counted here."""
    record = 8 * len(schema.sparse) + 4 * len(schema.dense) + 4
    return -(-record // 8) * 8 + 8


def auto_rows(row_groups: list[list[int]], schema: Schema) -> int:
    """``auto``: ROW_GROUPS_PER_WINDOW x the largest row group of ``row_groups`` (rows
    of each row group of each file, from the footers), at least MIN_ROWS, at most
    MAX_BYTES of records (but never under MIN_ROWS)."""
    largest = max((n for sizes in row_groups for n in sizes), default=0)
    cap = max(MIN_ROWS, MAX_BYTES // row_bytes(schema))
    return max(MIN_ROWS, min(ROW_GROUPS_PER_WINDOW * largest, cap))


def setting(value: int | str) -> int | str:
    """``data.shuffle_buffer`` as the reader takes it: ``"auto"`` or a row count."""
    if value == AUTO:
        return AUTO
    try:
        rows = int(value)
    except ValueError:
        rows = 0
    if rows < 1:
        raise ValueError(f"shuffle_buffer {value!r}: expected 'auto' or a row count >= 1")
    return rows


def resolve(value: int | str, row_groups: list[list[int]], schema: Schema) -> int:
    """The rows of ``value`` (``"auto"`` or a count) for files of ``row_groups``."""
    value = setting(value)
    return auto_rows(row_groups, schema) if value == AUTO else int(value)
