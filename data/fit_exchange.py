"""The ranks' integer counts merged by value range, not gathered whole.

Each rank ends its share of the pass with, per table, its values sorted (each once) and
their counts. Gathering every rank's table on every rank would have each rank receive
and merge W tables: at Criteo 1TB's 178M distinct values over 8 ranks, gigabytes per
rank, all merged W times over. Instead each rank owns a range of values:

    rank r's table   [ 3 7 9 | 12 15 | 40 41 ]      split at the agreed bounds (9 | 15)
                       to 0    to 1    to 2          (all-to-all)
    rank 1 receives  every rank's [12 15]-range part ──merge (k-way, exact sums)──► its range
    every rank       ranges 0, 1, 2 of the merged table (all-to-all, the same to each)
                     concatenated in rank order: sorted by value, as one process's table

The bounds come from every rank's quantiles of its own values (gathered: W - 1 values
a table per rank), the same list on every rank, so every rank splits at the same
values; any bounds give the same merged table, they only balance the work. The counts
are integers, so the result does not depend on which rank counted which row: it is the
one-process table bit for bit.

``exchange`` is given by the caller (data/ does not depend on the trainer's process
group): int64 arrays, ``send[k]`` to rank k, returning what each rank sent here, in
rank order (dlrm/parallel/distributed.py ``all_to_all_arrays``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from data.int_counts import merged_counts

Exchange = Callable[[list[np.ndarray]], list[np.ndarray]]
Gather = Callable[[object], list[object]]
Table = tuple[np.ndarray, np.ndarray]  # (values sorted, each once; counts)


def bounds(tables: dict[str, Table], world: int, gather: Gather) -> dict[str, np.ndarray]:
    """The W - 1 values each table is split at (rank k owns [bound k-1, bound k)),
    agreed by every rank: each rank's quantiles of its values, gathered, sorted, and
    every W-th taken."""
    mine = {}
    for name, (values, _) in tables.items():
        at = (np.arange(1, world) * len(values)) // world
        mine[name] = values[at] if len(values) else np.zeros(0, np.int64)
    everyone = gather(mine)
    out = {}
    for name in tables:
        seen = np.sort(np.concatenate([g[name] for g in everyone]))
        if len(seen) < world - 1:  # too few values anywhere to split: all to the last ranks
            seen = np.concatenate([np.full(world - 1 - len(seen), np.iinfo(np.int64).min), seen])
        out[name] = seen[(np.arange(1, world) * len(seen)) // world]
    return out


def merged_by_range(tables: dict[str, Table], world: int, gather: Gather,
                    exchange: Exchange) -> dict[str, Table]:
    """Every rank's ``tables`` merged (the same on every rank): each rank merges the
    values of its range, then the ranges are shared. ``tables`` must have the same
    names, in the same order, on every rank; it is emptied as it is sent."""
    names = list(tables)
    cut = bounds(tables, world, gather)
    send: list[list[np.ndarray]] = [[] for _ in range(world)]
    for name in names:
        values, counts = tables.pop(name)
        edges = np.concatenate([[0], np.searchsorted(values, cut[name], side="left"), [len(values)]])
        for k in range(world):
            send[k] += [values[edges[k]:edges[k + 1]], counts[edges[k]:edges[k + 1]]]
    got = [_unpacked(g) for g in exchange([_packed(parts) for parts in send])]
    del send
    owned = []  # this rank's range of each table, merged over the ranks
    for k in range(len(names)):
        owned += merged_counts([(g[2 * k], g[2 * k + 1]) for g in got])
    del got
    shared = [_unpacked(s) for s in exchange([_packed(owned)] * world)]
    return {name: (np.concatenate([s[2 * k] for s in shared]),
                   np.concatenate([s[2 * k + 1] for s in shared]))
            for k, name in enumerate(names)}


def _packed(arrays: list[np.ndarray]) -> np.ndarray:
    """int64 arrays as one: [count, len each..., data...] (one message per rank pair)."""
    head = np.array([len(arrays)] + [len(a) for a in arrays], np.int64)
    return np.concatenate([head] + [a.astype(np.int64, copy=False) for a in arrays])


def _unpacked(flat: np.ndarray) -> list[np.ndarray]:
    n = int(flat[0])
    lengths = flat[1:1 + n]
    return np.split(flat[1 + n:], np.cumsum(lengths)[:-1]) if n else []
