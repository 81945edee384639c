"""The vocabulary pass split over worker processes: each counts a disjoint share of
the row groups, the parent merges the exact counts.

    row groups (file, g) ──round robin──► worker k: ValueCounter per table ──► (value, count)
    parent: ValueCounter.add_counts / add_table of every worker's tables ──► the same
            table of (value, count) as one process, so the same vocabulary bit for bit

Counts are integers, so the merge does not depend on which worker saw which row: the
vocabulary's order depends only on the counts and the values. Workers are started with
``spawn`` (the parent may hold torch's and arrow's threads, which ``fork`` would copy
mid-state). A row group a worker cannot read stops the pass with the file and row
group named, or, under ``skip``, is left out as in the one-process pass.
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

import pyarrow as pa

from data.errors import DataError
from data.schema import Schema
from data.vocabulary import ValueCounter, flat_values


def count_split(files: list[str], schema: Schema, tables: set[str], skip: bool,
                workers: int) -> dict[str, ValueCounter]:
    """Counters of ``tables`` over all row groups of ``files``, counted by ``workers``
    processes over disjoint shares."""
    from data.files import open_parquet

    groups = [(f, g) for f in files for g in range(open_parquet(f).metadata.num_row_groups)]
    columns = {f.name: f.table_name for f in schema.sparse if f.table_name in tables}
    shares = [groups[k::workers] for k in range(workers)]
    counters = {t: ValueCounter() for t in tables}
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        for result in pool.map(_count_share, [(s, columns, skip) for s in shares if s]):
            if isinstance(result, str):
                raise DataError(result)
            for table, counted in result.items():
                counters[table].add_table(counted)
    return counters


def _count_share(job: tuple[list[tuple[str, int]], dict[str, str], bool]
                 ) -> dict[str, pa.Table] | str:
    """One worker: its row groups' counts per table, or the error line."""
    share, columns, skip = job
    from data.files import open_parquet

    counters: dict[str, ValueCounter] = {}
    for path, g in share:
        try:
            table = open_parquet(path).read_row_group(g, columns=list(columns))
        except (pa.ArrowException, OSError) as e:
            if skip:
                continue
            return f"{path}: row group {g}: cannot read ({str(e)[:200]})"
        except DataError as e:
            return str(e)
        for name, t in columns.items():
            counters.setdefault(t, ValueCounter()).add(flat_values(table.column(name))[0])
    return {t: c.table() for t, c in counters.items() if c.table() is not None}
