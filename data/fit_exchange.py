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
                    exchange: Exchange, rank: int | None = None) -> dict[str, Table]:
    """Every rank's ``tables`` merged (the same on every rank): each rank merges the
    values of its range, then the ranges are shared. ``tables`` must have the same
    names, in the same order, on every rank; it is emptied as it is sent. ``rank``
    (this rank's, where known): its own parts stay here, not packed and unpacked (an
    empty message to itself)."""
    names = list(tables)
    cut = bounds(tables, world, gather)
    send: list[list[np.ndarray]] = [[] for _ in range(world)]
    for name in names:
        values, counts = tables.pop(name)
        edges = np.concatenate([[0], np.searchsorted(values, cut[name], side="left"), [len(values)]])
        for k in range(world):
            send[k] += [values[edges[k]:edges[k + 1]], counts[edges[k]:edges[k + 1]]]
    got = _exchanged(send, exchange, rank)
    del send
    owned = []  # this rank's range of each table, merged over the ranks
    for k in range(len(names)):
        owned += merged_counts([(g[2 * k], g[2 * k + 1]) for g in got])
    del got
    shared = _exchanged([owned] * world, exchange, rank)
    return {name: (np.concatenate([s[2 * k] for s in shared]),
                   np.concatenate([s[2 * k + 1] for s in shared]))
            for k, name in enumerate(names)}


def _exchanged(send: list[list[np.ndarray]], exchange: Exchange, rank: int | None) -> list[list[np.ndarray]]:
    """``send[k]``'s arrays to rank k; what each rank sent here, in rank order. Packed
    once per distinct list (the shared ranges: one list to every rank); this rank's own
    kept as it is where ``rank`` is known."""
    packed: dict[int, np.ndarray] = {}
    messages = []
    for k, parts in enumerate(send):
        if k == rank:
            messages.append(np.zeros(1, np.int64))  # no arrays
        else:
            if id(parts) not in packed:
                packed[id(parts)] = _packed(parts)
            messages.append(packed[id(parts)])
    got = exchange(messages)
    return [send[k] if k == rank else _unpacked(g) for k, g in enumerate(got)]


# How an array travels (``_packed``): whole int64s, or 4 bytes an entry where it fits,
# as the gaps between neighbours (a table's values: sorted, each once) or as itself (counts)
_RAW, _NARROW, _GAPS = 0, 1, 2
_U32 = 1 << 32


def _packed(arrays: list[np.ndarray]) -> np.ndarray:
    """int64 arrays as one int64 message (one per rank pair):

        [n, (length, how, first) per array..., bodies...]   each body padded to 8 bytes

    A body is the array's int64s, or 4 bytes an entry: its gaps after ``first`` when it
    ascends by less than 2^32 a step (a table's values), else the values themselves
    when each is in [0, 2^32) (counts). Half the bytes of a typical table: the exchange
    is the costliest part of a split fit's merge (2 ranks on loopback gloo, 12M rows:
    0.6 s of 1.0)."""
    head, bodies = [len(arrays)], []
    for a in arrays:
        a = a.astype(np.int64, copy=False)
        how, first, body = _narrowed(a)
        head += [len(a), how, first]
        bodies.append(body)
    return np.concatenate([np.array(head, np.int64)] + bodies)


def _narrowed(a: np.ndarray) -> tuple[int, int, np.ndarray]:
    """(how, first, body as int64 words) of one array (``_packed``)."""
    if len(a) > 1:
        gaps = np.diff(a)
        if int(gaps.min()) >= 0 and int(gaps.max()) < _U32:
            return _GAPS, int(a[0]), _words(gaps.astype(np.uint32))
    if len(a) and int(a.min()) >= 0 and int(a.max()) < _U32:
        return _NARROW, 0, _words(a.astype(np.uint32))
    return _RAW, 0, a


def _words(narrow: np.ndarray) -> np.ndarray:
    """uint32 entries as int64 words (the last padded with a zero)."""
    if len(narrow) % 2:
        narrow = np.concatenate([narrow, np.zeros(1, np.uint32)])
    return narrow.view(np.int64)


def _unpacked(flat: np.ndarray) -> list[np.ndarray]:
    n = int(flat[0])
    head = flat[1:1 + 3 * n].reshape(n, 3)
    out, at = [], 1 + 3 * n
    for length, how, first in head.tolist():
        if how == _RAW:
            out.append(flat[at:at + length])
            at += length
            continue
        entries = length - 1 if how == _GAPS else length
        words = (entries + 1) // 2
        narrow = flat[at:at + words].view(np.uint32)[:entries]
        at += words
        if how == _NARROW:
            out.append(narrow.astype(np.int64))
        else:
            values = np.empty(length, np.int64)
            values[0] = first
            np.cumsum(narrow, dtype=np.int64, out=values[1:])
            values[1:] += first
            out.append(values)
    return out
