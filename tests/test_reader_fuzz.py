"""Fuzzing the Parquet reader: random schemas, column types, nulls, NaN/inf, ids in and out
of range, bags (empty, null, with null ids), row groups, zero-row, truncated and drifted
files, read by 1-3 simulated ranks under every policy.

The reference is plain Python over the values the test wrote (it never reads the files):
which files a reader may use, which rows are valid, and what each valid row becomes
(float32 label and dense, ids mapped by the id policy). The reader must yield exactly
those rows (as a multiset, over all ranks; under "fail" only when nothing is bad), or
raise the documented DataError naming a bad file (and a bad row where the bad thing is a
row), and never anything else, never hang. Fixed seed, fixed number of examples.
"""

from __future__ import annotations

import math
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from data.errors import DataError
from data.reader import ParquetReader
from data.schema import Schema, SparseFeature
from tests.data_helpers import within
from tests.test_reader import _splitmix64

pytestmark = pytest.mark.slow  # 800 hypothesis examples

FLOATS = (pa.float32(), pa.float64())
INTS = (pa.int32(), pa.int64())
SPECIAL = (None, math.nan, math.inf, -math.inf, 1e39)  # 1e39 overflows float32


@dataclass
class Column:
    name: str
    role: str  # "label", "dense", "single", "bag"
    type: pa.DataType
    rows: int = 0  # table rows (sparse)


@dataclass
class File:
    values: dict[str, list[Any]]
    types: dict[str, pa.DataType]
    row_group: int
    truncate: float = 0.0  # keep this share of the bytes (0: whole file)

    @property
    def n(self) -> int:
        return len(next(iter(self.values.values()))) if self.values else 0


@dataclass
class Case:
    columns: list[Column]
    files: list[File]
    params: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- strategies


def value(draw: st.DrawFn, col: Column, dirty: bool, wide: bool) -> Any:
    """A value for ``col``: a valid one, or (``dirty``: one time in four) anything;
    ``wide``: ids beyond the table too (valid under id_policy modulo and hash)."""
    if col.role == "single" or col.role == "bag":
        t = col.type.value_type if col.role == "bag" else col.type
        big = 2**40 if t == pa.int64() else 2**31 - 1
        good = (st.one_of(st.integers(0, col.rows + 3), st.just(big)) if wide
                else st.integers(0, col.rows - 1))
        ids = st.one_of(st.integers(-2, col.rows + 2), st.just(big), st.none())
        pick = ids if dirty and draw(st.integers(0, 3)) == 0 else good
        if col.role == "single":
            return draw(pick)
        return draw(st.one_of(st.none(), st.lists(pick, max_size=3)))
    if not dirty or draw(st.integers(0, 3)):
        if col.role == "label":
            return draw(st.sampled_from([0, 1]))
        return draw(st.floats(-1e3, 1e3, width=32) if col.type in FLOATS
                    else st.integers(-1000, 1000))
    if col.role == "label":
        return draw(st.sampled_from([2, -1, None] + ([0.5, math.nan] if col.type in FLOATS
                                                     else [])))
    return draw(st.sampled_from(SPECIAL if col.type in FLOATS else (None,)))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    columns = [Column("label", "label", draw(st.sampled_from(FLOATS + INTS)))]
    for j in range(draw(st.integers(0, 2))):
        columns.append(Column(f"d{j}", "dense", draw(st.sampled_from(FLOATS + INTS))))
    for j in range(draw(st.integers(1, 3))):
        bag = draw(st.booleans())
        t = draw(st.sampled_from(INTS))
        columns.append(Column(f"s{j}", "bag" if bag else "single", pa.list_(t) if bag else t,
                              draw(st.integers(1, 6))))
    files = []
    dirty, wide = draw(st.booleans()), draw(st.booleans())  # not dirty: every value valid
    for _ in range(draw(st.integers(1, 3))):
        n = draw(st.integers(0, 9))
        values = {c.name: [value(draw, c, dirty, wide) for _ in range(n)] for c in columns}
        f = File(values, {c.name: c.type for c in columns}, draw(st.integers(1, 4)))
        fault = draw(st.sampled_from(["none"] * 9 + ["truncate", "missing", "retype"]))
        victim = draw(st.sampled_from(columns))
        if fault == "truncate":
            f.truncate = draw(st.floats(0.05, 0.95))
        elif fault == "missing":
            del f.values[victim.name], f.types[victim.name]
        elif fault == "retype":
            retype(f, victim)
        files.append(f)
    params = {
        "on_error": draw(st.sampled_from(["fail", "skip"])),
        "id_policy": draw(st.sampled_from(["error", "modulo", "hash"])),
        "dense_nan": draw(st.sampled_from(["error", "zero"])),
        "world_size": draw(st.integers(1, 3)),
        "extra": draw(st.integers(0, 5)),
        "shuffle": draw(st.booleans()),
        "shuffle_buffer": draw(st.integers(1, 8)),
        "prefetch": draw(st.sampled_from([0, 2])),
    }
    return Case(columns, files, params)


def retype(f: File, col: Column) -> None:
    """Write ``col`` of file f with another type: one of another kind (refused), or a
    float of another width (drift between files: read as the same values)."""
    vals = f.values[col.name]
    if col.role in ("label", "dense"):
        if col.type in FLOATS:
            other = pa.float64() if col.type == pa.float32() else pa.float32()
            f.types[col.name] = other
        else:
            f.values[col.name] = [None if v is None else str(v) for v in vals]
            f.types[col.name] = pa.string()
    elif col.role == "single":
        f.values[col.name] = [None if v is None else [v] for v in vals]
        f.types[col.name] = pa.list_(pa.int64())
    else:
        f.values[col.name] = [None if not v else v[0] for v in vals]
        f.types[col.name] = pa.int64()


# --------------------------------------------------------------------------- reference


def _kind_fits(col: Column, t: pa.DataType) -> bool:
    if col.role in ("label", "dense"):
        return pa.types.is_floating(t) or pa.types.is_integer(t)
    if col.role == "single":
        return pa.types.is_integer(t)
    return pa.types.is_list(t) and pa.types.is_integer(t.value_type)


def usable_files(case: Case) -> list[bool]:
    """Footer checks: readable, every column there, of a fitting kind. Widths may differ
    between files (float64 beside float32, int32 beside int64: the same values), so a
    fitting kind is all it takes (ids here are all ints, dense and labels all numbers)."""
    return [not f.truncate and all(c.name in f.types and _kind_fits(c, f.types[c.name])
                                   for c in case.columns) for f in case.files]


def _f32(v: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(v))


def _id(v: int, rows: int, policy: str) -> int | None:
    """The id the reader yields for v, or None if v makes its row bad."""
    if v < 0 or (v >= rows and policy == "error"):
        return None
    if v < rows:
        return v
    return v % rows if policy == "modulo" else _splitmix64(v) % rows


def reference_row(case: Case, f: File, i: int) -> tuple | None:
    """Row i of file f as the reader yields it: (label, dense..., bags...), None if bad."""
    p = case.params
    out: list[Any] = []
    for c in case.columns:
        v = f.values[c.name][i]
        if c.role == "label":
            if v is None or not 0 <= _f32(v) <= 1:  # NaN fails the comparison too
                return None
            out.append(_f32(v))
        elif c.role == "dense":
            x = None if v is None else _f32(v)
            if x is None or not math.isfinite(x):
                if p["dense_nan"] == "error":
                    return None
                x = 0.0
            out.append(x)
        else:
            ids = [] if v is None else [v] if c.role == "single" else v
            if c.role == "single" and v is None:
                return None
            mapped = [None if x is None else _id(x, c.rows, p["id_policy"]) for x in ids]
            if None in mapped:
                return None
            out.append(tuple(mapped))
    return tuple(out)


# --------------------------------------------------------------------------- the test


def write(case: Case, root: Path) -> list[str]:
    paths = []
    for k, f in enumerate(case.files):
        path = root / f"f{k}.parquet"
        table = pa.table({name: pa.array(v, type=f.types[name]) for name, v in f.values.items()})
        pq.write_table(table, path, row_group_size=max(f.row_group, 1))
        if f.truncate:
            data = path.read_bytes()
            path.write_bytes(data[: int(len(data) * f.truncate)])
        paths.append(str(path))
    return paths


def rows_of(batch: Any, case: Case) -> list[tuple]:
    """(label, dense..., bags...) of every sample of a batch."""
    b = batch.size
    lengths = batch.sparse.lengths().tolist()
    values = batch.sparse.values().tolist()
    bags, at = [], 0
    for n in lengths:
        bags.append(tuple(values[at:at + n]))
        at += n
    n_sparse = sum(c.role in ("single", "bag") for c in case.columns)
    assert len(bags) == n_sparse * b
    return [
        (float(batch.labels[i]), *map(float, batch.dense[i].tolist()),
         *(bags[j * b + i] for j in range(n_sparse)))
        for i in range(b)
    ]


@settings(max_examples=800, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases())
def test_reader_yields_exactly_the_valid_rows_or_raises_data_error(case: Case) -> None:
    check(case, workers=0)


@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases(), workers=st.sampled_from([0, 2]))
def test_the_same_holds_with_decode_workers(case: Case, workers: int) -> None:
    """A few cases at data.workers 0 or 2 (each worker count spawns processes)."""
    check(case, workers)


def check(case: Case, workers: int) -> None:
    """The reader at ``workers`` yields exactly the case's valid rows (each once, over
    all ranks), records each dropped row, or raises a DataError naming a bad one."""
    p = case.params
    w = p["world_size"]
    schema = Schema(
        "label",
        tuple(c.name for c in case.columns if c.role == "dense"),
        tuple(SparseFeature(c.name, c.rows, multi_hot=c.role == "bag")
              for c in case.columns if c.role in ("single", "bag")),
    )
    usable = usable_files(case)
    valid: list[tuple] = []
    bad_rows: set[tuple[int, int]] = set()
    for k, f in enumerate(case.files):
        for i in range(f.n if usable[k] else 0):
            row = reference_row(case, f, i)
            if row is None:
                bad_rows.add((k, i))
            else:
                valid.append(row)
    usable_rows = sum(f.n for k, f in enumerate(case.files) if usable[k])
    skip = p["on_error"] == "skip"

    with tempfile.TemporaryDirectory() as d:
        paths = write(case, Path(d))

        def read() -> tuple[list[tuple], list[int], list]:
            readers = [ParquetReader(paths, schema, w + p["extra"], rank=r, world_size=w,
                                     shuffle=p["shuffle"], seed=3,
                                     shuffle_buffer=p["shuffle_buffer"], prefetch=p["prefetch"],
                                     id_policy=p["id_policy"], dense_nan=p["dense_nan"],
                                     on_error=p["on_error"], workers=workers)
                       for r in range(w)]
            got, steps = [], []
            for reader in readers:
                batches = list(reader.epoch(0))
                steps.append(len(batches))
                got += [row for b in batches for row in rows_of(b, case)]
            return got, steps, [rec for r in readers for rec in r.bad_data.records]

        try:
            got, steps, records = within(120 if workers else 60, read)
        except DataError as e:
            event(f"{p['on_error']}: DataError")
            if usable_rows == 0:  # nothing to read: refused in either policy
                return
            assert not skip, f"skip raised {e}"
            bad_files = {paths[k] for k, ok in enumerate(usable) if not ok}
            if bad_files:  # footers are checked first, in file order
                assert e.file == paths[usable.index(False)], (str(e), bad_files)
                return
            k = paths.index(e.file)
            assert e.row is not None and (k, e.row) in bad_rows, (str(e), bad_rows)
            return

    event(f"{p['on_error']}: read, {len(bad_rows)} bad rows, {usable.count(False)} bad files")
    assert usable_rows > 0, "a dataset without usable rows was accepted"
    if not skip:
        assert all(usable) and not bad_rows, "fail accepted bad data"
    assert len(set(steps)) == 1  # every rank yields the same number of batches
    assert Counter(got) == Counter(valid)
    by_row = {(r.file, r.row) for r in records if r.row_group is not None}
    assert by_row == {(paths[k], i) for k, i in bad_rows}
    left_out = {r.file for r in records if r.row_group is None}
    assert left_out == {paths[k] for k, ok in enumerate(usable) if not ok}
