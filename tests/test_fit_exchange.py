"""The ranks' integer counts merged by value range (data/fit_exchange.py) equal
``collections.Counter`` over every rank's values: W ranks simulated by threads whose
gather and all-to-all meet at a barrier, with empty shares, one repeated value, fewer
distinct values than ranks, negative values and Zipf-like ids."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest

from data.fit_exchange import merged_by_range
from data.int_counts import run_lengths


def _run_ranks(world: int, shares: list[dict[str, np.ndarray]]) -> list[dict]:
    """merged_by_range on ``world`` threads, rank r counting ``shares[r]``."""
    barrier = threading.Barrier(world)
    board: list[object] = [None] * world

    def meet(rank: int, obj: object) -> list[object]:
        board[rank] = obj
        barrier.wait()
        seen = list(board)
        barrier.wait()  # nobody writes the next round's board before all have read
        return seen

    out: list[dict] = [None] * world
    errors = []

    def rank_main(rank: int) -> None:
        try:
            tables = {n: run_lengths(np.sort(v)) for n, v in sorted(shares[rank].items())}
            out[rank] = merged_by_range(
                tables, world, lambda o: meet(rank, o),
                lambda send: [s[rank] for s in meet(rank, send)])
        except BaseException as e:  # noqa: BLE001 - surfaced below; a dead thread would hang the others
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_merged_by_range_equals_counter(world: int) -> None:
    rng = np.random.default_rng(world)

    def zipf(n: int) -> np.ndarray:
        return (rng.zipf(1.3, n) % 100_000).astype(np.int64) - 50

    shares = []
    for r in range(world):
        shares.append({
            "zipf": zipf(int(rng.integers(0, 5000))),
            "empty_on_0": np.zeros(0, np.int64) if r == 0 else zipf(300),
            "one_value": np.full(7 + r, 1 << 40, np.int64),
            "two_values": np.array([-3, 9][: 1 + r % 2], np.int64),
        })
    for rank, merged in enumerate(_run_ranks(world, shares)):
        for name in shares[0]:
            want = Counter(v for s in shares for v in s[name].tolist())
            values, counts = merged[name]
            assert values.tolist() == sorted(want), (rank, name)
            assert counts.tolist() == [want[v] for v in sorted(want)], (rank, name)
