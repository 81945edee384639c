"""ParquetReader: coverage over simulated ranks, shuffling, seeking, layout, validation.

Ranks are simulated in one process (one reader per rank). Dense column I1 holds
each row's global number, so every sample can be traced back to its row, and
compared with pandas reading the same files.
"""

from __future__ import annotations

import gc
import math
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from data.batch import Batch
from data.errors import DataError, UserError
from data.reader import ParquetReader
from data.schema import Schema, SparseFeature
from tests.data_helpers import tiny_dataset, write_parquet

N_ROWS = 7 + 0 + 130 + 33


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Schema, pd.DataFrame]:
    files, schema = tiny_dataset(tmp_path_factory.mktemp("tiny"))
    frame = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    return files, schema, frame


def _epochs(files: list[str], schema: Schema, batch_size: int, world_size: int,
            epoch: int = 0, **kw: object) -> list[list[Batch]]:
    """Every rank's batches of one epoch."""
    return [
        list(ParquetReader(files, schema, batch_size, rank=r, world_size=world_size, **kw)
             .epoch(epoch))
        for r in range(world_size)
    ]


def _row_ids(batch: Batch) -> list[int]:
    return batch.dense[:, 0].long().tolist()


def _bags(batch: Batch, schema: Schema) -> dict[str, list[list[int]]]:
    """The KJT's ids per feature and sample, split by hand from values and lengths."""
    b = batch.size
    lengths = batch.sparse.lengths().numpy()
    values = batch.sparse.values().numpy()
    assert lengths.shape == (len(schema.sparse) * b,)
    assert values.shape == (lengths.sum(),)
    ends = np.cumsum(lengths)
    bags = [values[e - n : e].tolist() for n, e in zip(lengths, ends)]
    return {f.name: bags[i * b : (i + 1) * b] for i, f in enumerate(schema.sparse)}


def _same(a: list[Batch], b: list[Batch]) -> bool:
    return len(a) == len(b) and all(
        x.dense.equal(y.dense) and x.labels.equal(y.labels)
        and x.sparse.values().equal(y.sparse.values())
        and x.sparse.lengths().equal(y.sparse.lengths())
        for x, y in zip(a, b)
    )


# --------------------------------------------------------------------------- coverage


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_row_exactly_once_over_ranks(tiny, world_size: int, shuffle: bool) -> None:
    files, schema, _ = tiny
    batch_size = 11
    ranks = _epochs(files, schema, batch_size, world_size, shuffle=shuffle, shuffle_buffer=30)
    steps = {len(batches) for batches in ranks}
    expect_steps = max(
        math.ceil((N_ROWS * (r + 1) // world_size - N_ROWS * r // world_size)
                  / (batch_size // world_size + (r < batch_size % world_size)))
        for r in range(world_size)
    )
    assert steps == {expect_steps}
    seen = []
    for r, batches in enumerate(ranks):
        mine = [i for b in batches for i in _row_ids(b)]
        lo, hi = N_ROWS * r // world_size, N_ROWS * (r + 1) // world_size
        assert len(mine) == hi - lo  # balanced to ±1 row
        if not shuffle:
            assert mine == list(range(lo, hi))  # file order, contiguous range
        b_r = batch_size // world_size + (r < batch_size % world_size)
        sizes = [b.size for b in batches]
        full = (hi - lo) // b_r
        assert sizes[:full] == [b_r] * full and sum(sizes) == hi - lo
        seen += mine
    assert sorted(seen) == list(range(N_ROWS))
    if shuffle:
        assert seen != list(range(N_ROWS))


def test_values_match_pandas_rows(tiny) -> None:
    files, schema, frame = tiny
    for batches in _epochs(files, schema, 16, 2, shuffle=True, shuffle_buffer=40):
        for batch in batches:
            rows = frame.iloc[_row_ids(batch)]
            assert batch.dense.dtype == batch.labels.dtype == torch.float32
            np.testing.assert_array_equal(batch.labels.numpy(), rows["label"].to_numpy())
            np.testing.assert_array_equal(batch.dense.numpy(), rows[["I1", "I2"]].to_numpy())
            assert batch.sparse.keys() == ["C1", "C2", "C3"]
            assert batch.sparse.values().dtype == batch.sparse.lengths().dtype == torch.int64
            bags = _bags(batch, schema)
            for f in ("C1", "C2"):
                assert bags[f] == [[v] for v in rows[f]]
            want = [[] if v is None else list(v) for v in rows["C3"]]
            assert bags["C3"] == want


def test_bags_include_empty_and_null_lists(tiny) -> None:
    files, schema, frame = tiny
    (batches,) = _epochs(files, schema, 64, 1)
    lengths = [len(bag) for b in batches for bag in _bags(b, schema)["C3"]]
    assert frame["C3"].isna().any() and 0 in lengths and max(lengths) == 3


def test_empty_batches_when_a_rank_runs_out(tiny) -> None:
    files, schema, _ = tiny
    # N_r = 56, 57, 57 and b_r = 3, 3, 2: ranks 0 and 1 need 19 steps, rank 2 needs 29.
    ranks = _epochs(files, schema, 8, 3)
    assert [len(b) for b in ranks] == [29, 29, 29]
    assert [b.size for b in ranks[0][17:21]] == [3, 2, 0, 0]
    empty = ranks[0][-1]
    assert tuple(empty.dense.shape) == (0, 2) and tuple(empty.labels.shape) == (0,)
    assert empty.sparse.keys() == ["C1", "C2", "C3"] and empty.sparse.stride() == 0
    assert empty.sparse.values().numel() == 0 and empty.sparse.lengths().numel() == 0


@settings(max_examples=20, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 25), min_size=1, max_size=4).filter(lambda s: sum(s) > 0),
    row_group=st.integers(1, 9),
    world_size=st.integers(1, 4),
    extra=st.integers(0, 12),
    shuffle=st.booleans(),
    buffer=st.integers(1, 40),
)
def test_coverage_property(sizes: list[int], row_group: int, world_size: int, extra: int,
                           shuffle: bool, buffer: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        files, schema = tiny_dataset(d, tuple(sizes), row_group, sparse=2, multi_hot=1)
        ranks = _epochs(files, schema, world_size + extra, world_size, shuffle=shuffle,
                        shuffle_buffer=buffer, prefetch=0)
    assert len({len(b) for b in ranks}) == 1
    seen = sorted(i for batches in ranks for b in batches for i in _row_ids(b))
    assert seen == list(range(sum(sizes)))


# --------------------------------------------------------------------------- shuffle, seek


def test_shuffle_is_reproducible_and_depends_on_seed_and_epoch(tiny) -> None:
    files, schema, _ = tiny

    def order(seed: int, epoch: int) -> list[int]:
        (batches,) = _epochs(files, schema, 16, 1, epoch=epoch, shuffle=True, seed=seed,
                             shuffle_buffer=48)
        return [i for b in batches for i in _row_ids(b)]

    assert order(3, 0) == order(3, 0)
    assert order(3, 0) != order(4, 0)
    assert order(3, 0) != order(3, 1)
    assert sorted(order(3, 1)) == list(range(N_ROWS))


@pytest.mark.parametrize("shuffle", [False, True])
def test_start_step_resumes_an_uninterrupted_epoch(tiny, shuffle: bool) -> None:
    files, schema, _ = tiny
    for rank in range(2):
        reader = ParquetReader(files, schema, 10, rank=rank, world_size=2, shuffle=shuffle,
                               seed=7, shuffle_buffer=15)
        full = list(reader.epoch(2))
        assert len(full) == reader.steps_per_epoch() == 17
        for k in (1, 3, 7, 16, 17):
            assert _same(list(reader.epoch(2, start_step=k)), full[k:]), k


def test_prefetch_off_gives_the_same_batches(tiny) -> None:
    files, schema, _ = tiny
    kw = {"shuffle": True, "seed": 1, "shuffle_buffer": 20}
    assert _same(_epochs(files, schema, 9, 2, prefetch=0, **kw)[1],
                 _epochs(files, schema, 9, 2, prefetch=3, **kw)[1])


# --------------------------------------------------------------------------- the worker thread


def _reader_threads() -> int:
    return sum(t.name == "ParquetReader" and t.is_alive() for t in threading.enumerate())


def _wait_for_no_threads() -> bool:
    for _ in range(100):
        if _reader_threads() == 0:
            return True
        time.sleep(0.02)
    return False


def test_abandoning_the_iterator_stops_the_thread(tiny) -> None:
    files, schema, _ = tiny
    reader = ParquetReader(files, schema, 2, prefetch=2)
    it = reader.epoch(0)
    next(it)
    assert _reader_threads() == 1
    it.close()
    assert _wait_for_no_threads()
    for _ in reader.epoch(0):
        break
    gc.collect()
    assert _wait_for_no_threads()


def test_worker_errors_reraise_in_the_consumer(tmp_path: Path) -> None:
    good = {"label": [0.0] * 30, "I1": [1.0] * 30, "C1": [1] * 30}
    bad = dict(good, C1=[1] * 25 + [-4] + [1] * 4)
    files = [write_parquet(tmp_path / "a.parquet", good, 10),
             write_parquet(tmp_path / "b.parquet", bad, 10)]
    schema = Schema("label", ("I1",), (SparseFeature("C1", 5),))
    it = ParquetReader(files, schema, 10, prefetch=2, shuffle_buffer=10).epoch(0)
    got = [next(it) for _ in range(5)]  # a.parquet and b's first two row groups are fine
    assert [b.size for b in got] == [10] * 5
    with pytest.raises(DataError, match="b.parquet.*'C1'.*row group 2.*row 25.*negative id -4"):
        next(it)
    assert _wait_for_no_threads()


# --------------------------------------------------------------------------- validation


def _one(tmp_path: Path, name: str, cols: dict, types: dict | None = None, rows: int = 10,
         multi: bool = False, **kw: object) -> list[Batch]:
    """Read a file whose bad value sits in its second row group (rows 4..7)."""
    base = {"label": [0.0] * 8, "I1": [1.0] * 8, "C1": [[1]] * 8 if multi else [1] * 8}
    path = write_parquet(tmp_path / f"{name}.parquet", {**base, **cols}, 4, types)
    schema = Schema("label", ("I1",), (SparseFeature("C1", rows, multi_hot=multi),))
    return list(ParquetReader([path], schema, 8, prefetch=0, **kw).epoch(0))


BAD = {
    "null_label": ({"label": [0.0] * 5 + [None] + [0.0] * 2}, "label", "null label"),
    "label_range": ({"label": [0.0] * 5 + [2.0] + [0.0] * 2}, "label", "outside"),
    "dense_nan": ({"I1": [1.0] * 5 + [float("nan")] + [1.0] * 2}, "I1", "nan"),
    "dense_inf": ({"I1": [1.0] * 5 + [float("inf")] + [1.0] * 2}, "I1", "inf"),
    "dense_null": ({"I1": [1.0] * 5 + [None] + [1.0] * 2}, "I1", "null dense"),
    "negative_id": ({"C1": [1] * 5 + [-1] + [1] * 2}, "C1", "negative id"),
    "null_id": ({"C1": [1] * 5 + [None] + [1] * 2}, "C1", "null id"),
    "big_id": ({"C1": [1] * 5 + [10] + [1] * 2}, "C1", "id 10 >= table rows 10"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_values_name_file_column_row_group_and_row(tmp_path: Path, case: str) -> None:
    cols, column, words = BAD[case]
    with pytest.raises(DataError) as e:
        _one(tmp_path, case, cols)
    msg = str(e.value)
    assert f"{case}.parquet" in msg and f"column {column!r}" in msg, msg
    assert "row group 1" in msg and "row 5" in msg and words in msg.lower(), msg


def test_bad_ids_inside_bags(tmp_path: Path) -> None:
    bags = [[1], [], [2, 3], None, [4], [1, 1, 1, -2], [0], [0]]
    with pytest.raises(DataError, match=r"'C1', row group 1, row 5: negative id -2"):
        _one(tmp_path, "bag_neg", {"C1": bags}, multi=True)
    bags[5] = [1, None]
    with pytest.raises(DataError, match=r"'C1', row group 1, row 5: null id inside a bag"):
        _one(tmp_path, "bag_null", {"C1": bags}, multi=True)


def test_type_differing_from_schema(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"t.parquet, column 'C1'.*list<int64>"):
        _one(tmp_path, "t", {"C1": [[1]] * 8})
    with pytest.raises(DataError, match=r"u.parquet, column 'I1'.*string"):
        _one(tmp_path, "u", {"I1": ["a"] * 8})


def test_dense_nan_zero_and_integer_columns_cast(tmp_path: Path) -> None:
    vals = [1.0, float("nan"), None, float("-inf"), 2.5, 3.0, 4.0, 5.0]
    (batch,) = _one(tmp_path, "z", {"I1": vals}, dense_nan="zero")
    assert batch.dense[:, 0].tolist() == [1.0, 0.0, 0.0, 0.0, 2.5, 3.0, 4.0, 5.0]
    (batch,) = _one(tmp_path, "ints", {"I1": list(range(8)), "label": [0, 1] * 4})
    assert batch.dense.dtype == batch.labels.dtype and batch.dense[:, 0].tolist() == list(range(8))
    assert batch.labels.tolist() == [0.0, 1.0] * 4


def _splitmix64(x: int) -> int:
    """Reference SplitMix64 finaliser in plain Python integers."""
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


@pytest.mark.parametrize("multi", [False, True])
def test_id_policies_modulo_and_hash(tmp_path: Path, multi: bool) -> None:
    ids = [3, 10, 57, 9, 123456789012, 0, 10, 1]
    col = [[i] for i in ids] if multi else ids
    for policy, expect in [
        ("modulo", [i % 10 if i >= 10 else i for i in ids]),
        ("hash", [_splitmix64(i) % 10 if i >= 10 else i for i in ids]),
    ]:
        (batch,) = _one(tmp_path, f"{policy}{multi}", {"C1": col}, id_policy=policy, multi=multi)
        assert batch.sparse.values().tolist() == expect
    assert [_splitmix64(i) % 10 for i in (10, 57)] != [0, 7]  # hash differs from modulo here
    with pytest.raises(DataError, match="negative id"):
        _one(tmp_path, "neg", {"C1": [[-1]] * 8 if multi else [-1] * 8}, id_policy="hash",
             multi=multi)


def test_batch_size_smaller_than_world_is_a_user_error(tiny) -> None:
    files, schema, _ = tiny
    with pytest.raises(UserError, match="batch size 2"):
        ParquetReader(files, schema, 2, rank=0, world_size=3)


def test_global_batch_size_is_the_sum_of_rank_batches(tmp_path) -> None:
    from data.reader import ParquetReader
    from tests.data_helpers import tiny_dataset

    files, schema = tiny_dataset(tmp_path)
    for world_size in (1, 2, 3):
        readers = [ParquetReader(files, schema, 16, rank=r, world_size=world_size, prefetch=0)
                   for r in range(world_size)]
        per_rank = [[b.size for b in rd.epoch(0)] for rd in readers]
        for step in range(readers[0].steps_per_epoch()):
            assert readers[0].global_batch_size(step) == sum(sizes[step] for sizes in per_rank)


def test_batch_select_takes_whole_samples(tmp_path) -> None:
    import torch

    from data.reader import ParquetReader
    from tests.data_helpers import tiny_dataset

    files, schema = tiny_dataset(tmp_path)
    batch = next(iter(ParquetReader(files, schema, 40, prefetch=0).epoch(0)))
    index = torch.tensor([5, 0, 39, 5])
    part = batch.select(index)
    assert part.size == 4 and torch.equal(part.dense, batch.dense[index])
    assert torch.equal(part.labels, batch.labels[index])
    whole, sub = batch.sparse.to_dict(), part.sparse.to_dict()
    for key in whole:
        want = [whole[key].to_dense()[i].tolist() for i in index.tolist()]
        assert [row.tolist() for row in sub[key].to_dense()] == want
    empty = batch.select(torch.zeros(0, dtype=torch.int64))
    assert empty.size == 0 and empty.sparse.values().numel() == 0


# --------------------------------------------------------------------------- record width


@pytest.mark.parametrize("rows", [2**31, 2**31 + 1, 2**40])
def test_ids_at_the_edge_of_int32_come_out_whole(tmp_path: Path, rows: int) -> None:
    """A window's records hold single-hot ids as int32 where every table has at most 2^31
    rows (data/rows.py Layout), else int64; either way a batch's ids are the file's
    int64 ids, shuffled or not. Here the largest id a table of ``rows`` takes, beside
    a small table's ids; the reference is pandas' rows."""
    n = 40
    top = [rows - 1 - i for i in range(n)]
    cols = {"label": [float(i % 2) for i in range(n)], "I1": [float(i) for i in range(n)],
            "C1": top, "C2": [i % 7 for i in range(n)]}
    path = write_parquet(tmp_path / "edge.parquet", cols, 16)
    schema = Schema("label", ("I1",), (SparseFeature("C1", rows), SparseFeature("C2", 7)))
    frame = pd.read_parquet(path)
    reader = ParquetReader([path], schema, 8, shuffle=True, prefetch=0, shuffle_buffer=32)
    assert reader.layout.id_dtype == (np.int32 if rows <= 2**31 else np.int64)
    seen = []
    for batch in reader.epoch(0):
        picked = frame.set_index("I1").loc[batch.dense[:, 0].numpy().astype(np.float64)]
        ids = batch.sparse.values().numpy().reshape(2, -1)
        np.testing.assert_array_equal(ids[0], picked["C1"].to_numpy())
        np.testing.assert_array_equal(ids[1], picked["C2"].to_numpy())
        seen += batch.dense[:, 0].tolist()
    assert sorted(seen) == list(range(n))


def test_an_id_past_int32_in_a_skipped_row_leaves_the_others_whole(tmp_path: Path) -> None:
    """on_error=skip writes a row's values into its record before the row is dropped: an
    id of 2^33 in an int32 record is cut there, and the row never leaves the window."""
    cols = {"label": [0.0] * 8, "I1": [float(i) for i in range(8)], "C1": [i for i in range(8)]}
    cols["C1"][5] = 2**33
    batches = _one(tmp_path, "past", cols, on_error="skip")
    assert [b.dense[:, 0].tolist() for b in batches] == [[0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 7.0]]
    assert batches[0].sparse.values().tolist() == [0, 1, 2, 3, 4, 6, 7]


def test_a_mapped_features_ids_are_bounded_by_its_mapping_not_the_schema() -> None:
    """A vocabulary or hash feature's rows come from the fit (data/preprocess.py): a
    schema not yet given them (rows 1) still gets int64 records where the mapping's
    table has over 2^31 rows; an identity feature is bounded by its own rows."""
    from types import SimpleNamespace

    from data.reader import reader_layout

    schema = Schema("label", (), (SparseFeature("C1", 1, encoding="hash"), SparseFeature("C2", 10)))
    assert reader_layout(schema, "error").id_dtype == np.int32
    assert reader_layout(schema, "error", SimpleNamespace(rows={"C1": 2**33})).id_dtype == np.int64
    assert reader_layout(schema, "error", SimpleNamespace(rows={"C1": 2**31})).id_dtype == np.int32
    assert reader_layout(schema, "error", SimpleNamespace(rows={"C2": 2**33})).id_dtype == np.int32  # identity
