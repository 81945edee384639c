"""A hot-set refresh (embeddings/hotline/refresh.py, dlrm/train/hotline.py) moves only the
rows that change, is exact, and is planned off the step loop.

- The plan: rows that stay keep their device values (old slot → new slot); only the
  rows that leave are written home and only those that enter are read from the host.
- Exact: after the swap the collection holds the same tables and optimizer state as
  before, and training on equals a single-process collection (every optimizer).
- Read ahead: the entering rows are read on the host when the plan is made; at the
  swap exactly those a cold update wrote since are read again (exact).
- The trainer's refresh: the plan is built on the planner thread at a refresh step;
  the hot set changes at the NEXT step boundary, to that plan.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from dlrm.config import load_config
from dlrm.train.hotline import HotlineSteps
from embeddings.collection import LocalEmbeddingCollection
from embeddings.hotline.tiers import HotlineEmbeddingCollection
from embeddings.optim import make_sparse_optimizer
from tests.conftest import TINY
from tests.test_embeddings import random_kjt, tables_fixture
from tests.test_hotline import FEATURES, LR, assert_same_tables, profile_of, rows_of, touched


def _sets(tables, kjts):
    """Two overlapping hot sets: A = ids % 3 != 0, B = ids % 2 == 0 (of the touched rows)."""
    seen = touched(tables, kjts)
    return ({n: ids[ids % 3 != 0] for n, ids in seen.items()}, {n: ids[ids % 2 == 0] for n, ids in seen.items()})


def _stacked(coll, hot: dict[str, torch.Tensor]) -> set[int]:
    return {int(i) + coll.row_offsets[name] for name, ids in hot.items() for i in ids}


def _step(colls: tuple, kjt, up: torch.Tensor) -> None:
    for c in colls:
        c.set_lr(LR)
        (c(kjt) * up).sum().backward()
        c.step()


def _two_collections(kind: str) -> tuple:
    """Tables, 4 batches and upstream gradients, hot sets a and b, and the reference
    collection beside a Hotline one hot on a (same seed)."""
    tables = tables_fixture()
    kjts = [random_kjt(FEATURES, rows_of(tables), batch=10, max_len=3, seed=s) for s in range(4)]
    ups = [torch.randn(10, 16, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    a, b = _sets(tables, kjts)
    ref = LocalEmbeddingCollection(tables, make_sparse_optimizer(kind), fused=False, seed=3)
    coll = HotlineEmbeddingCollection(tables, profile_of(tables, a), make_sparse_optimizer(kind),
                                      fused=False, seed=3)
    return tables, kjts, ups, a, b, ref, coll


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adagrad", "adam"])
def test_swap_moves_only_the_changed_rows_and_stays_exact(kind: str, monkeypatch) -> None:
    tables, kjts, ups, a, b, ref, coll = _two_collections(kind)
    moved: dict[str, set[int]] = {"read": set(), "write": set()}
    tier = coll.tier
    read, write = tier.read_rows, tier.write_rows_later  # the swap's write home: queued (refresh.py)
    monkeypatch.setattr(tier, "read_rows", lambda ids, dev: moved["read"].update(ids.tolist()) or read(ids, dev))
    monkeypatch.setattr(tier, "write_rows_later",
                        lambda ids, w, s: moved["write"].update(ids.tolist()) or write(ids, w, s))
    for i, (kjt, up) in enumerate(zip(kjts, ups)):
        _step((ref, coll), kjt, up)
        if i == 1:
            before = coll.export_tables()
            moved["read"].clear()
            moved["write"].clear()
            plan = coll.plan_refresh(profile_of(tables, b))
            coll.refresh(plan)
            old, new = _stacked(coll, a), _stacked(coll, b)
            assert moved == {"read": new - old, "write": old - new}  # not the rows that stay
            assert plan.moved_rows == len(old ^ new) > 0
            assert set(coll.hot_ids.tolist()) == new
            assert_same_tables(coll.export_tables(), before)  # nothing changed by the swap
            host = coll.host.weight.detach()
            torch.testing.assert_close(coll.hot_weight.detach(), host.index_select(0, coll.hot_ids), rtol=0, atol=0)
    assert_same_tables(coll.export_tables(), ref.export_tables())


@pytest.mark.parametrize("kind", ["rowwise_adagrad", "adam"])
def test_entering_rows_read_ahead_and_the_touched_ones_again(kind: str, monkeypatch) -> None:
    """The plan's entering rows are read at step 1's boundary; step 2 trains (its cold
    update writes some of them); the swap at step 2's boundary reads again exactly
    the entering rows step 2 touched, and training stays exact."""
    tables, kjts, ups, _, b, ref, coll = _two_collections(kind)
    table_of = {f: t.name for t in tables for f in t.features}
    reads: list[set[int]] = []
    read = coll.tier.read_rows
    monkeypatch.setattr(coll.tier, "read_rows", lambda ids, dev: reads.append(set(ids.tolist())) or read(ids, dev))
    plan = None
    for i, (kjt, up) in enumerate(zip(kjts, ups)):
        _step((ref, coll), kjt, up)
        if i == 1:
            plan = coll.plan_refresh(profile_of(tables, b))
            coll.prefetch_entering(plan)
            assert reads[-1] == set(plan.enter_ids.tolist())
        if i == 2:
            touched = torch.cat([kjt[f].values() + coll.row_offsets[table_of[f]] for f in FEATURES])
            stale = set(plan.enter_ids.tolist()) & set(touched.tolist())
            reads.clear()
            coll.refresh(plan, touched)
            assert stale and reads == [stale]  # only the entering rows step 2 wrote
    assert_same_tables(coll.export_tables(), ref.export_tables())


def test_a_plan_from_another_hot_set_is_refused() -> None:
    tables = tables_fixture()
    kjts = [random_kjt(FEATURES, rows_of(tables), batch=10, max_len=3, seed=0)]
    a, b = _sets(tables, kjts)
    coll = HotlineEmbeddingCollection(tables, profile_of(tables, a), make_sparse_optimizer("sgd"))
    stale = coll.plan_refresh(profile_of(tables, b))
    coll.refresh(profile_of(tables, {n: ids[:1] for n, ids in b.items()}))
    with pytest.raises(RuntimeError, match="another hot set"):
        coll.refresh(stale)


def test_the_rows_written_over_a_long_window_reach_the_swap_once_each(monkeypatch) -> None:
    """A plan waits a whole window of steps for its swap, and each step's cold update
    hands over the host rows it wrote: kept as one unique set every 64 steps (memory
    bounded by the rows, not the steps), the swap gets each row written once."""
    tables = tables_fixture()
    kjts = [random_kjt(FEATURES, rows_of(tables), batch=10, max_len=3, seed=s) for s in range(2)]
    a, _ = _sets(tables, kjts)
    coll = HotlineEmbeddingCollection(tables, profile_of(tables, a), make_sparse_optimizer("sgd"))
    cfg = load_config(TINY, ["hotline.refresh_every=200", "hotline.budget=1KB"])
    steps = HotlineSteps(SimpleNamespace(embeddings=coll), cfg)
    swapped: list[torch.Tensor] = []
    refresh = coll.refresh

    def spy(plan, touched_rows):
        swapped.append(touched_rows)
        return refresh(plan, touched_rows)

    monkeypatch.setattr(coll, "refresh", spy)
    for kjt in kjts:
        steps.window.add(kjt)
    steps.after_step(200)  # plans
    written = [torch.arange(s % 50, s % 50 + 20) for s in range(150)]  # 150 steps' rows, overlapping
    for ids in written:
        steps._touch(SimpleNamespace(host_ids=ids))
    assert len(steps._touched) < 64
    steps.window.add(kjts[0])
    steps.after_step(400)  # swaps
    assert len(swapped) == 1
    assert torch.equal(torch.unique(swapped[0]), torch.unique(torch.cat(written)))
    assert swapped[0].numel() < sum(ids.numel() for ids in written) / 2  # not every step's copy
    steps.close()


def test_trainer_plans_in_the_background_and_swaps_at_the_next_refresh_step(monkeypatch) -> None:
    """A refresh step (every refresh_every) plans the next hot set on the planner thread
    and swaps it in at the next refresh step, not the next step: the plan has a window
    of steps to finish (on the 2026-11-27 H200 a plan due at the next step made that
    step wait 292 ms)."""
    tables = tables_fixture()
    kjts = [random_kjt(FEATURES, rows_of(tables), batch=10, max_len=3, seed=s) for s in range(2)]
    a, _ = _sets(tables, kjts)
    coll = HotlineEmbeddingCollection(tables, profile_of(tables, a), make_sparse_optimizer("adam"), fused=False)
    cfg = load_config(TINY, ["hotline.refresh_every=2", "hotline.budget=1KB", "optim.sparse=adam"])
    steps = HotlineSteps(SimpleNamespace(embeddings=coll), cfg)
    planned_on: list[str] = []
    plan_refresh = coll.plan_refresh

    def spy(profile):
        planned_on.append(threading.current_thread().name)
        return plan_refresh(profile)

    monkeypatch.setattr(coll, "plan_refresh", spy)
    for kjt in kjts:
        steps.window.add(kjt)
    first = coll.hot_ids.clone()
    steps.after_step(2)  # a refresh step: the plan starts
    assert torch.equal(coll.hot_ids, first)  # not swapped yet
    plan = steps._next_hot.result()
    assert planned_on and planned_on[0].startswith("hotline-refresh")
    steps.after_step(3)  # not a refresh step: the plan waits, done or not
    assert torch.equal(coll.hot_ids, first) and steps.stats()["refreshes"] == 0
    steps.window.add(kjts[0])
    steps.after_step(4)  # the next refresh step: swapped in, and the next one planned
    assert torch.equal(coll.hot_ids, plan.ids) and not torch.equal(plan.ids, first)
    assert steps._next_hot is not None
    assert steps.stats()["refreshes"] == 1
    steps.close()


@pytest.mark.parametrize("kind", ["rowwise_adagrad", "adam"])
def test_a_refresh_to_a_hot_set_of_the_same_size_keeps_the_tensors(kind: str) -> None:
    """A hot set of the size held is copied into the hot tier's tensors (what a captured
    Hotline step reads by address stays valid: no capture again); another size makes
    new ones and says so (``storage_version``). Training stays exact either way."""
    tables, kjts, ups, a, _, ref, coll = _two_collections(kind)
    seen = touched(tables, kjts)
    gen = torch.Generator().manual_seed(5)
    # the same number of hot rows per table as a, other rows (a shuffled draw of the seen ones)
    same_size = {n: ids[torch.randperm(ids.numel(), generator=gen)[:a[n].numel()]].sort().values
                 for n, ids in seen.items()}
    smaller = {n: ids[: max(ids.numel() // 2, 1)] for n, ids in seen.items()}
    hot = coll.hot
    for i, (kjt, up) in enumerate(zip(kjts, ups)):
        _step((ref, coll), kjt, up)
        addresses = [hot.weight.data_ptr(), hot.ids.data_ptr(), *(t.data_ptr() for t in hot.state.values())]
        version, before = hot.storage_version, coll.export_tables()
        if i == 0:
            coll.refresh(coll.plan_refresh(profile_of(tables, same_size)))
            assert set(coll.hot_ids.tolist()) == _stacked(coll, same_size) != _stacked(coll, a)
            assert hot.storage_version == version
            assert [hot.weight.data_ptr(), hot.ids.data_ptr(), *(t.data_ptr() for t in hot.state.values())] \
                == addresses
        if i == 1:
            coll.refresh(coll.plan_refresh(profile_of(tables, smaller)))
            assert hot.storage_version == version + 1 and hot.weight.data_ptr() != addresses[0]
        assert_same_tables(coll.export_tables(), before)  # nothing changed by a swap
    assert_same_tables(coll.export_tables(), ref.export_tables())


def test_a_short_refresh_window_keeps_the_hot_set_at_its_size(tiny_data, tmp_path, monkeypatch) -> None:
    """A refresh every 2 steps sees about half the rows the budget holds: the rows hot
    now fill the room (choose_hot_rows' ``keep``), so the hot set keeps its size, each
    refresh is copied into the hot tier's tensors (a captured step replays on) and
    the budget stays used. Before, the set shrank to the window's rows (2,352 to
    about 1,250 rows here) and every refresh made new tensors. ``fill_unseen`` off: its
    fill would keep the size too, with unseen rows instead of the hot ones."""
    from embeddings.hotline.hot_tier import HotTier
    from tests.test_hotline_train import run

    loads: list[tuple[int, int]] = []
    load = HotTier.load

    def recorded(self, ids, weight, state):
        before = self.storage_version
        load(self, ids, weight, state)
        loads.append((ids.numel(), self.storage_version - before))

    monkeypatch.setattr(HotTier, "load", recorded)
    summary = run(tiny_data, tmp_path / "hot", "train.max_steps=8", "optim.sparse=rowwise_adagrad",
                  "embeddings.placement=hotline", "hotline.budget=160KB", "hotline.refresh_every=2",
                  "hotline.fill_unseen=false", "data.batch_size=32")
    # refresh steps 2, 4, 6, 8: swaps at 4, 6, 8 (each the plan of the one before)
    assert summary["hotline"]["refreshes"] == 3 and len(loads) == 4, loads
    first, *refreshes = loads
    assert first[1] == 1 and all(r == (first[0], 0) for r in refreshes), loads
