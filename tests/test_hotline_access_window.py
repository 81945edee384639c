"""A refresh window's lookups counted as stacked keys (embeddings/hotline/access_window.py):
the counts against a Python count of the ids, the hot set chosen from them against the
one chosen from a count per row (``HotProfile.build``), and the checkpoint's form."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from data.jagged import JaggedFeatures
from embeddings.hotline.access_window import AccessWindow, from_checkpoint, to_checkpoint
from embeddings.hotline.profile import HotProfile, count_accesses
from embeddings.optim import make_sparse_optimizer
from embeddings.table import TableSpec
from tests.test_embeddings import random_kjt, tables_fixture
from tests.test_hotline import FEATURES, rows_of

CPU = torch.device("cpu")


def python_counts(kjts: list[JaggedFeatures], tables: list[TableSpec]) -> dict[str, Counter]:
    """Per table, row id → lookups, one value at a time."""
    table_of = {f: t.name for t in tables for f in t.features}
    out: dict[str, Counter] = {t.name: Counter() for t in tables}
    for kjt in kjts:
        for feature, jt in kjt.to_dict().items():
            if feature in table_of:
                out[table_of[feature]].update(jt.values().tolist())
    return out


def as_counter(saved: dict[str, torch.Tensor]) -> dict[str, Counter]:
    return {name: Counter(dict(zip(rows_seen[0].tolist(), rows_seen[1].tolist(), strict=True)))
            for name, rows_seen in saved.items()}


def window_of(tables: list[TableSpec], chunk_keys: int) -> tuple[AccessWindow, ThreadPoolExecutor]:
    planner = ThreadPoolExecutor(max_workers=1)
    return AccessWindow(tables, CPU, planner, chunk_keys=chunk_keys), planner


@pytest.mark.parametrize("chunk_keys", [1, 7, 1 << 20])
def test_a_windows_counts_are_the_lookups_of_each_row(chunk_keys: int) -> None:
    """Counted in chunks merged on the planner thread (every add, every few, or once at
    the take), the counts equal a Python count of the ids; a shared table sums its
    features; a feature without a table is left out; a take starts a new window."""
    tables = tables_fixture()
    kjts = [random_kjt(FEATURES, rows_of(tables), batch=12, max_len=3, seed=s) for s in range(5)]
    stray = random_kjt(["a", "no_table"], {"a": 50, "no_table": 10**6}, batch=12, max_len=2, seed=9)
    window, planner = window_of(tables, chunk_keys)
    for kjt in [*kjts, stray]:
        window.add(kjt)
    keys, seen = window.take().result()
    assert keys.numel() and int(keys.min()) >= 0 and torch.equal(keys, torch.unique(keys))  # ascending, distinct
    got = to_checkpoint((keys, seen), tables)
    assert as_counter(got) == python_counts([*kjts, stray], tables)
    window.add(kjts[0])
    assert as_counter(to_checkpoint(window.take().result(), tables)) == python_counts(kjts[:1], tables)
    assert all(s.numel() == 0 for s in window.take().result())  # nothing since
    planner.shutdown()


def test_a_seeded_window_adds_its_lookups_to_the_seed() -> None:
    """A checkpoint's window (``by_table``, resumed by ``from_tables`` and ``seed``) goes
    on counting: the counts of both windows' batches."""
    tables = tables_fixture()
    kjts = [random_kjt(FEATURES, rows_of(tables), batch=8, max_len=3, seed=s) for s in range(4)]
    window, planner = window_of(tables, 5)
    for kjt in kjts[:2]:
        window.add(kjt)
    saved = to_checkpoint(window.take().result(), tables)
    resumed, planner2 = window_of(tables, 5)
    resumed.seed(from_checkpoint(saved, tables))
    for kjt in kjts[2:]:
        resumed.add(kjt)
    assert as_counter(to_checkpoint(resumed.take().result(), tables)) == python_counts(kjts, tables)
    planner.shutdown()
    planner2.shutdown()


@pytest.mark.parametrize("case", range(12))
def test_the_hot_set_chosen_from_a_window_is_the_one_a_count_per_row_chooses(case: int) -> None:
    """``HotProfile.chosen`` over the window's keys (what a refresh ranks, on the hot
    tier's device) equals ``HotProfile.build`` over a count per row of every table (what
    a refresh ranked before, on the host): the rows, the summary, with rows kept and the
    room filled or not, at budgets from none to every row."""
    g = torch.Generator().manual_seed(case)
    tables = [TableSpec(f"t{i}", rows=int(torch.randint(1, 40, (1,), generator=g)), dim=4,
                        features=(f"f{i}",)) for i in range(4)]
    features = [f for t in tables for f in t.features]
    rows = {t.features[0]: t.rows for t in tables}
    kjts = [random_kjt(features, rows, batch=6, max_len=3, seed=100 * case + s) for s in range(3)]
    optimizer = make_sparse_optimizer(["sgd", "rowwise_adagrad", "adam"][case % 3])
    budget = int(torch.randint(0, 60, (1,), generator=g)) * 16
    keep = {t.name: torch.unique(torch.randint(0, t.rows, (3,), generator=g)) for t in tables}
    window, planner = window_of(tables, 10)
    for kjt in kjts:
        window.add(kjt)
    keys, seen = window.take().result()
    for kept in (None, keep):
        for fill in (False, True):
            want = HotProfile.build(count_accesses(kjts, tables), tables, optimizer, budget, kept, fill)
            got = HotProfile.chosen(keys, seen, tables, optimizer, budget, kept, fill)
            assert {n: ids.tolist() for n, ids in got.hot.items()} == {n: ids.tolist() for n, ids in want.hot.items()}
            assert got.summary == want.summary
    planner.shutdown()


@pytest.mark.gpu
def test_a_window_on_cuda_counts_and_chooses_as_on_the_host() -> None:
    """The keys made on the step's stream from batches on the device, merged on the
    planner's stream (in chunks, while the step's stream goes on overwriting a buffer
    of its own): the counts equal the host's, and the hot set chosen there too."""
    tables = tables_fixture()
    kjts = [random_kjt(FEATURES, rows_of(tables), batch=64, max_len=3, seed=s) for s in range(20)]
    planner = ThreadPoolExecutor(max_workers=1)
    window = AccessWindow(tables, torch.device("cuda"), planner, chunk_keys=200)
    busy = torch.zeros(1 << 24, device="cuda")
    for kjt in kjts:
        dev = JaggedFeatures(kjt.keys(), kjt.values().cuda(non_blocking=True), kjt.lengths().cuda())
        window.add(dev)
        busy.add_(1.0)  # the step stream's own work between the adds
    keys, seen = window.take().result()
    assert keys.is_cuda
    assert as_counter(to_checkpoint((keys, seen), tables)) == python_counts(kjts, tables)
    optimizer = make_sparse_optimizer("rowwise_adagrad")
    with window.planner_stream():
        got = HotProfile.chosen(keys, seen, tables, optimizer, 40 * 20)
    want = HotProfile.build(count_accesses(kjts, tables), tables, optimizer, 40 * 20)
    assert {n: ids.tolist() for n, ids in got.hot.items()} == {n: ids.tolist() for n, ids in want.hot.items()}
    planner.shutdown()


def test_a_splits_stacked_ids_count_as_the_batchs_keys() -> None:
    """``add_keys`` of the Hotline split's stacked ids (the step's path: no keying ops)
    counts what ``add`` of the batch counts; with ``copy``, a buffer written again after
    (a split graph's) leaves the window's keys as they were."""
    from tests.test_hotline_ahead import _setup

    coll, batches, _ = _setup(False)
    by_batch, by_ids = window_of(coll.tables, 1 << 20)[0], window_of(coll.tables, 1 << 20)[0]
    for i, batch in enumerate(batches):
        by_batch.add(batch.sparse)
        ids = coll.split_on_device(batch.sparse, by_popularity=False).lookups.ids
        by_ids.add_keys(ids, copy=i % 2 == 0)
        if i % 2 == 0:
            ids.fill_(0)  # the next split's values, in a graph's buffer
    want, got = by_batch.take().result(), by_ids.take().result()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert as_counter(to_checkpoint(got, coll.tables)) == python_counts([b.sparse for b in batches], coll.tables)


@pytest.mark.parametrize("mixed", [False, True])
def test_the_hotline_steps_window_counts_each_batchs_lookups(mixed: bool) -> None:
    """The trainer's Hotline step (``HotlineSteps``, hotline.refresh_every on) keys each
    mini-batch's lookups into its window: one dtype from the split's stacked ids, several
    from the batch (each group's ids are stacked in its own tables). Either way the
    window's counts are a Python count of the batches' ids."""
    from types import SimpleNamespace

    from dlrm.config import load_config
    from dlrm.train.hotline import HotlineSteps
    from tests.conftest import TINY
    from tests.test_hotline_ahead import _setup

    coll, batches, _ = _setup(mixed)
    cfg = load_config(TINY, ["hotline.budget=1KB", "hotline.refresh_every=1000"])
    steps = HotlineSteps(SimpleNamespace(embeddings=coll), cfg)
    for i, batch in enumerate(batches):
        list(steps.micro_batches(batch, batches[i + 1] if i + 1 < len(batches) else None))
        steps.after_step(i + 1)
    counted = steps.window.take().result()
    assert as_counter(to_checkpoint(counted, coll.tables)) == python_counts([b.sparse for b in batches], coll.tables)
    steps.close()


@pytest.mark.gpu
def test_the_hotline_steps_window_on_cuda_counts_through_split_graphs() -> None:
    """On a GPU, single-hot mini-batches split by graph replays: the window copies each
    split's stacked ids out of the graph's buffers (written again two splits later)
    after the split stream's event; its counts are a Python count of the batches' ids."""
    from types import SimpleNamespace

    from dlrm.config import load_config
    from dlrm.train.hotline import HotlineSteps
    from embeddings.hotline.mixed import hotline_collection
    from tests.conftest import TINY
    from tests.test_hotline import profile_of, touched
    from tests.test_split_graphs import BATCH, single_hot

    tables = tables_fixture()
    seen = touched(tables, [random_kjt(FEATURES, rows_of(tables), batch=BATCH, max_len=1, seed=1)])
    coll = hotline_collection(tables, profile_of(tables, {n: ids[ids % 3 != 0] for n, ids in seen.items()}),
                              make_sparse_optimizer("sgd"), fused=False, seed=1, device="cuda")
    cfg = load_config(TINY, ["hotline.budget=1KB", "hotline.refresh_every=1000", f"data.batch_size={BATCH}"])
    steps = HotlineSteps(SimpleNamespace(embeddings=coll), cfg)
    batches = [single_hot(coll, s) for s in range(6)]
    for i, batch in enumerate(batches):
        list(steps.micro_batches(batch, batches[i + 1] if i + 1 < len(batches) else None))
        steps.after_step(i + 1)
    assert steps.split_graphs is not None and steps.split_graphs.replays >= 5
    counted = steps.window.take().result()
    assert as_counter(to_checkpoint(counted, coll.tables)) == python_counts([b.sparse for b in batches], coll.tables)
    steps.close()
