"""data.max_rows enforced while counting: a count floor per capped table, from the
sketch, checked after the exact pass (see data/fit_split.py).

A vocabulary capped at K = max_rows - 1 values keeps the K most frequent. After the
count-min sketch pass (:mod:`data.fit_sketch`, whose estimate never falls below a
value's true count), the exact pass may drop every value whose estimate is below a
floor f, and the vocabulary is still exact if at least K of the survivors have an
exact count >= f:

    then the K-th largest true count c_K >= f, so every value of the true top K (and
    every value tied with it at c_K) has a count >= f, its estimate too: it survived,
    with its exact count (a survivor is counted on every rank and worker alike, since
    the merged sketch and f are the same everywhere)

If fewer than K reach f, the capped tables are counted again with the plain
min_frequency floor (one more pass; the result is exact either way). f is chosen from
a fixed sample of row groups, the same on every rank: half the K-th largest estimate
among the sample's distinct values (1: no cut, when the sample holds fewer than K), so
the exact pass holds about the values that could make the top K, not the whole tail.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from data.errors import DataError, quoted
from data.fit_sketch import Sketch
from data.vocabulary import ValueCounter, flat_values

SAMPLE_GROUPS = 4  # row groups spread over the files, read by every rank


def floors(sketch: Sketch, groups: list[tuple[int, str, int]], columns: dict[str, str],
           caps: dict[str, int], min_frequency: int, skip: bool) -> dict[str, int]:
    """table → the count floor of its exact pass (min_frequency where nothing is cut)."""
    from data.files import LastOpened

    capped = {n: t for n, t in columns.items() if caps.get(t, 0) > 1 and t in sketch.tables}
    out = {t: min_frequency for t in columns.values()}
    if not capped:
        return out
    want = min(len(groups), SAMPLE_GROUPS)
    picks = sorted({int(i * len(groups) / want) for i in range(want)})
    seen: dict[str, ValueCounter] = {t: ValueCounter() for t in capped.values()}
    opened = LastOpened()
    for i in picks:
        _, path, g = groups[i]
        try:
            table = opened(path).read_row_group(g, columns=list(capped))
        except (pa.ArrowException, OSError) as e:
            if skip:
                continue
            raise DataError(f"cannot read ({quoted(e)})", file=path, row_group=g) from None
        for name, t in capped.items():
            seen[t].add(flat_values(table.column(name))[0])
    for t, counter in seen.items():
        distinct = counter.table()
        if distinct is None or distinct.num_rows < caps[t] - 1:
            continue
        est = np.sort(sketch.estimates(t, distinct["value"].combine_chunks()))[::-1]
        out[t] = max(min_frequency, int(est[caps[t] - 2]) // 2)
    return out


def holds(counter: ValueCounter, floor: int, cap: int) -> bool:
    """Whether at least ``cap - 1`` values reach ``floor`` exactly (the cut was safe)."""
    if len(counter.ints):
        counts = counter.ints.arrays()[1]
    else:
        table = counter.table()
        counts = np.zeros(0) if table is None else table["count"].to_numpy()
    return int(np.count_nonzero(counts >= floor)) >= cap - 1
