"""The vocabulary pass split over ranks and worker processes: each counts a disjoint
share of the row groups, the exact counts merge.

    row groups (i, file, g) ──rank r takes groups[r::W]──► its share
    share ──round robin over N workers (or this process)──► Counted: (value, count) per
            table; dense statistics (integer parts summed) and row group i's float sums
    gather (every rank's Counted, rank order) ──► ValueCounter.add_table ──► the same
            table of (value, count) as one process, so the same vocabulary bit for bit;
            float sums added in row-group order i, as one process adds them

Each rank reads only its share, dense columns included: the dense statistics' counts,
extremes and histograms are integers or min/max (any order), and their float sums are
kept per row group and added in file order, so standardize's mean and std are the same
bits as one process's (which adds each row group's sum in turn, DenseStats.add).

Counts are integers, so the merge does not depend on which rank or worker saw which
row: the vocabulary's order depends only on the counts and the values. ``gather`` is
given by the caller (dlrm/train/inputs.py: ``all_gather_object`` over the run's
process group), since data/ does not import dlrm/. A share that cannot be read gives
its error line to every rank through the gather, so every rank stops with it.

With ``min_frequency > 1`` a first pass builds a count-min sketch (:mod:`data.fit_sketch`),
merged over ranks and workers like the counts; the exact pass then drops each value
whose sketch estimate is below ``min_frequency``. The sketch never underestimates,
so every value that reaches ``min_frequency`` survives with its exact count, and the
vocabulary is the same: only the memory of the long tail is saved. A table capped by
data.max_rows is cut the same way, at a higher floor checked after the pass
(:mod:`data.fit_cap`).

Workers are started with ``spawn`` (the parent may hold torch's and arrow's threads,
which ``fork`` would copy mid-state).
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from data import fit_cap
from data.dense_transform import DenseStats
from data.errors import DataError, quoted
from data.fit_exchange import Exchange, merged_by_range
from data.fit_sketch import Sketch
from data.int_counts import int64_values, plain_numpy
from data.schema import Schema
from data.vocabulary import ValueCounter, flat_values
from data.worker_tasks import run_tasks

Gather = Callable[[object], list[object]]
Group = tuple[int, str, int]  # (global index, file, row group)


@dataclass
class Split:
    """Who counts what: this rank of ``world`` (``gather`` joins the ranks), ``workers``
    processes on this rank, the sketch pre-filter for ``sketch_tables``."""

    rank: int = 0
    world: int = 1
    gather: Gather | None = None
    workers: int = 0
    min_frequency: int = 1
    sketch_tables: set[str] = field(default_factory=set)
    progress: bool = False
    caps: dict[str, int] = field(default_factory=dict)  # table → max_rows (data/fit_cap.py)
    exchange: Exchange | None = None  # int64 all-to-all of the ranks (data/fit_exchange.py)

    def sketching(self, tables: set[str]) -> bool:
        """Whether the pass over ``tables`` starts with the sketch: min_frequency > 1, or
        a capped table, among the sketched ones."""
        mine = self.sketch_tables & tables
        return bool(mine) and (self.min_frequency > 1 or any(self.caps.get(t, 0) > 1 for t in mine))


@dataclass
class Counted:
    """One share's result: (value, count) tables per table (a list, so that shares
    concatenate), the dense columns' statistics without their float sums, each row
    group's float sums by its global index (added in that order, as one process
    would), and the rows read."""

    tables: dict[str, list[pa.Table]] = field(default_factory=dict)
    dense: dict[str, DenseStats] = field(default_factory=dict)
    sums: list[tuple[int, np.ndarray]] = field(default_factory=list)  # [totals, squares]
    rows: int = 0

    def add(self, other: Counted) -> Counted:
        for t, counted in other.tables.items():
            self.tables[t] = self.tables.get(t, []) + counted
        for n, st in other.dense.items():
            self.dense.setdefault(n, DenseStats()).absorb(st)
        self.sums += other.sums
        self.rows += other.rows
        return self

    def stats(self, names: list[str]) -> dict[str, DenseStats]:
        """The dense statistics of ``names``, float sums added in row-group order."""
        out = {n: self.dense.get(n, DenseStats()) for n in names}
        for _, sums in sorted(self.sums, key=lambda s: s[0]):
            for k, n in enumerate(names):
                out[n].total += float(sums[0, k])
                out[n].squares += float(sums[1, k])
        return out


def count_split(files: list[str], schema: Schema, tables: set[str], skip: bool,
                split: Split) -> tuple[dict[str, ValueCounter], dict[str, DenseStats], int]:
    """Counters of ``tables`` over all row groups of ``files``, this rank counting
    ``groups[rank::world]``, the counts of all ranks merged; the dense statistics of the
    same pass, and the rows read."""
    from data.files import footer

    groups, rows = [], []
    for f in files:
        meta = footer(f).metadata
        for g in range(meta.num_row_groups):
            if meta.row_group(g).num_rows:  # an empty group holds nothing (and may type columns null)
                groups.append((len(groups), f, g))
                rows.append(meta.row_group(g).num_rows)
    mine = groups[split.rank::split.world]
    mine_rows = rows[split.rank::split.world]
    columns = {f.name: f.table_name for f in schema.sparse if f.table_name in tables}
    sketch, floor = None, {t: split.min_frequency for t in tables}
    sketched = {n: t for n, t in columns.items() if t in split.sketch_tables}
    if split.sketching(tables):
        width = Sketch.width_for(sum(rows) * len(sketched))
        parts = _run(mine, mine_rows, ("sketch", sketched, [], skip, width, None, {}), split)
        sketch = Sketch.merged(_gathered(parts, split), width, set(sketched.values()))
        floor = fit_cap.floors(sketch, groups, columns, split.caps, split.min_frequency, skip)
    job = ("count", columns, list(schema.dense), skip, 0, sketch, floor)
    whole, counters = _everyone(_run(mine, mine_rows, job, split), tables, split)
    cut = {t for t in tables if floor[t] > split.min_frequency
           and not fit_cap.holds(counters[t], floor[t], split.caps[t])}
    if cut:  # a floor above the top K's counts: count those tables again, uncut
        floor.update({t: split.min_frequency for t in cut})
        again = {n: t for n, t in columns.items() if t in cut}
        job = ("count", again, [], skip, 0, sketch, floor)
        counters.update(_everyone(_run(mine, mine_rows, job, split), cut, split)[1])
    return counters, whole.stats(list(schema.dense)), whole.rows


def _everyone(result: Counted | str, tables: set[str], split: Split
              ) -> tuple[Counted, dict[str, ValueCounter]]:
    """Every rank's ``result`` (this rank's share, or its error line) as one: the dense
    statistics and rows gathered, each table's counter merged. With ``split.exchange``,
    integer tables are merged by value range (:mod:`data.fit_exchange`: each rank
    merges 1/W of the values) and only the rest goes through the object gather."""
    if split.exchange is None or split.world == 1 or isinstance(result, str):
        whole = Counted()
        for r in _gathered(result, split):
            whole.add(r)
        return whole, _merged(whole, tables, split.workers)
    ints = {}
    for t, counter in sorted(_merged(result, tables, split.workers).items()):
        table = counter.table()
        if table is not None and pa.types.is_integer(table["value"].type):
            ints[t] = (int64_values(table["value"]), int64_values(table["count"]))
        elif table is not None:
            result.tables[t] = [table]
    whole, named = Counted(), set()
    for r, names in _gathered((result, sorted(ints)), split):
        whole.add(r)
        named.update(names)
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    ints = {t: ints.get(t, empty) for t in sorted(named)}  # the same names on every rank
    merged = merged_by_range(ints, split.world, split.gather, split.exchange, split.rank)
    counters = _merged(whole, tables - set(merged))
    counters.update({t: ValueCounter.of_sorted(*vc) for t, vc in merged.items()})
    return whole, counters


def _merged(whole: Counted, tables: set[str], threads: int = 1) -> dict[str, ValueCounter]:
    """Each table's counter over every rank's and worker's parts (one part: it is the
    table, no copy); ``threads`` tables at a time (numpy's sorts release the GIL)."""
    parts = {t: whole.tables.pop(t, []) for t in sorted(tables)}

    def merge(table: str) -> ValueCounter:
        return ValueCounter.of_parts(parts[table]) if parts[table] else ValueCounter()

    if threads <= 1:
        return {t: merge(t) for t in parts}
    with ThreadPoolExecutor(threads) as pool:
        return dict(zip(parts, pool.map(merge, parts)))


def _gathered(result: object, split: Split) -> list:
    """Every rank's result (rank order); an error line on any rank stops every rank."""
    results = [result] if split.gather is None or split.world == 1 else split.gather(result)
    for r in results:
        if isinstance(r, str):
            raise DataError(r)
        if isinstance(r, tuple) and isinstance(r[0], str):
            raise DataError(r[0])
    return results


def _run(share: list[Group], rows: list[int], job: tuple, split: Split) -> object:
    """``job`` over ``share``: in this process, or over ``split.workers`` processes, one
    task each (so each worker folds its whole share into one table, and this process
    merges N tables, not one per task), results merged. The bar follows a shared row
    counter the workers add to. An error: its line. One worker counts here: this
    process would only wait for it, so a worker process adds nothing but its start-up
    and the pickled result (measured: 2 ranks x 1 worker 0.65-0.77 of 2 cores' worth,
    2 ranks counting themselves 0.76-0.87)."""
    bar = _bar(sum(rows), job[0], split.progress)
    if split.workers <= 1:
        return _do((share, *job), bar)
    ctx = mp.get_context("spawn")
    jobs = [(share[k::split.workers], *job) for k in range(split.workers) if share[k::split.workers]]
    # rows read, one slot per task and no lock (the bar only): a worker killed while it
    # held a shared counter's lock hung the other workers and this process for ever
    done = ctx.Array("q", max(len(jobs), 1), lock=False)
    # a worker killed (the OOM killer): a line, not a traceback, and no hang (data/worker_tasks.py)
    results = run_tasks(ctx, _do_in_slot, [(done, k, j) for k, j in enumerate(jobs)],
                        f"a fit worker process died (killed, perhaps for memory: try fewer "
                        f"data.fit_workers than {split.workers})",
                        None if bar is None else lambda: bar.update(sum(done) - bar.n))
    merged: object = None
    for result in results:
        if isinstance(result, str):
            return result
        merged = _merge(merged, result)
    if bar is not None:
        bar.close()
    return merged if merged is not None else (Counted() if job[0] == "count" else {})


_rows_read = None  # the workers' rows-read slots (set by _do_in_slot)
_slot = 0  # this task's slot in them


def _do_in_slot(counter, slot: int, job: tuple) -> object:
    """:func:`_do` in a worker, counting its rows in ``counter``'s slot ``slot`` (its
    own: no lock)."""
    global _rows_read, _slot
    _rows_read, _slot = counter, slot
    return _do(job)


def _merge(a: object, b: object) -> object:
    if a is None:
        return b
    return a.add(b)


def _bar(total: int, what: str, on: bool):
    if not on:
        return None
    from tqdm import tqdm

    label = "fit: sketch" if what == "sketch" else "fit: counting"
    return tqdm(total=total, desc=label, unit=" rows", unit_scale=True, smoothing=0.1,
                disable=None)


def _do(job: tuple, bar=None) -> object:
    """One share: its sketch, or its :class:`Counted`; or the error line."""
    share, what, columns, dense, skip, width, sketch, floor = job
    from data.files import LastOpened

    out = Sketch(width) if what == "sketch" else Counted()
    counters: dict[str, ValueCounter] = {}
    opened = LastOpened()
    for index, path, g in share:
        try:
            table = opened(path).read_row_group(g, columns=list(columns) + dense)
        except (pa.ArrowException, OSError) as e:
            if skip:
                continue
            return f"{path}: row group {g}: cannot read ({quoted(e)})"
        except DataError as e:
            return str(e)
        for name, t in columns.items():
            values = flat_values(table.column(name))[0]
            if isinstance(out, Sketch):
                out.add(t, values)
            elif sketch is not None and t in sketch.tables and floor[t] > 1:
                counters.setdefault(t, ValueCounter()).add(sketch.survivors(t, values, floor[t]))
            else:
                counters.setdefault(t, ValueCounter()).add(values)
        if isinstance(out, Counted):
            _dense(out, table, index, dense)
        if bar is not None:
            bar.update(table.num_rows)
        if _rows_read is not None:
            _rows_read[_slot] += table.num_rows
    if bar is not None:
        bar.close()
    if isinstance(out, Counted):
        out.tables = {t: [c.table()] for t, c in counters.items() if c.table() is not None}
    return out


def _dense(out: Counted, table: pa.Table, index: int, dense: list[str]) -> None:
    """Row group ``index``'s dense statistics into ``out`` (float sums kept apart)."""
    sums = np.zeros((2, len(dense)))
    for k, n in enumerate(dense):
        st = DenseStats.of(plain_numpy(table.column(n)).astype(np.float32, copy=False))
        sums[:, k] = st.total, st.squares
        out.dense.setdefault(n, DenseStats()).absorb(st, sums=False)
    out.sums.append((index, sums))
    out.rows += table.num_rows
