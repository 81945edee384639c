"""The ranks' integer counts merged by value range (data/fit_exchange.py) equal
``collections.Counter`` over every rank's values: W ranks simulated by threads whose
gather and all-to-all meet at a barrier, with empty shares, one repeated value, fewer
distinct values than ranks, negative values and Zipf-like ids."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest

from data.fit_exchange import _packed, _unpacked, merged_by_range
from data.int_counts import run_lengths


def _run_ranks(world: int, shares: list[dict[str, np.ndarray]], own: bool = True) -> list[dict]:
    """merged_by_range on ``world`` threads, rank r counting ``shares[r]`` (``own``: each
    told its rank, its own parts kept, not sent)."""
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
                lambda send: [s[rank] for s in meet(rank, send)], rank if own else None)
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


@pytest.mark.parametrize("own", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_merged_by_range_equals_counter(world: int, own: bool) -> None:
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
    for rank, merged in enumerate(_run_ranks(world, shares, own)):
        for name in shares[0]:
            want = Counter(v for s in shares for v in s[name].tolist())
            values, counts = merged[name]
            assert values.tolist() == sorted(want), (rank, name)
            assert counts.tolist() == [want[v] for v in sorted(want)], (rank, name)


def test_a_message_gives_back_every_array_it_packed() -> None:
    """``_packed`` narrows what fits in 4 bytes an entry (a table's values as gaps,
    counts as themselves); ``_unpacked`` gives back the same int64s, whatever fits:
    gaps of 2^32 and more, negative values, the int64 extremes, odd and empty lengths."""
    rng = np.random.default_rng(7)
    big = np.iinfo(np.int64)
    arrays = [
        np.zeros(0, np.int64), np.array([5]), np.array([-3]), np.array([1 << 40]),
        np.arange(11, dtype=np.int64) + (1 << 40),  # ascending, small gaps: narrowed
        np.array([0, (1 << 32) - 1, 1 << 32]),  # gaps just below 2^32, then counts' range
        np.array([0, 1 << 32]),  # a gap of 2^32: whole int64s
        np.array([3, 1, 2]), np.array([(1 << 32) - 1, 0]), np.array([1 << 32, 0]),
        np.array([big.min, big.max]), np.array([big.max, big.min]),  # a gap that wraps
        np.sort(rng.integers(-(1 << 62), 1 << 62, 1001)), rng.integers(1, 50, 1000),
    ]
    message = _packed(arrays)
    assert message.dtype == np.int64
    back = _unpacked(message)
    assert len(back) == len(arrays)
    for want, got in zip(arrays, back, strict=True):
        assert got.dtype == np.int64 and got.tolist() == want.tolist(), want
    # a typical table (values ascending by small gaps, counts small): about half the bytes
    values = np.cumsum(rng.integers(1, 1000, 100_000)) + (1 << 40)
    counts = rng.integers(1, 100, 100_000)
    assert _packed([values, counts]).nbytes < 0.51 * (values.nbytes + counts.nbytes)
