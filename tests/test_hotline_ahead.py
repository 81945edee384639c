"""The trainer's Hotline step splits the next mini-batch a step ahead (dlrm/train/hotline.py).

- The split made ahead gives the same passes (lookups, dense rows, labels, gathered
  cold rows) as a split made at the step (reference: a ``HotlineSteps`` that never
  splits ahead), for one dtype and for several (``split_jointly``).
- Order: batch t+1 is split before batch t's pass is handed out and its header is read
  after it; at step t+1 nothing is split or read for it.
  Its cold ids were copied to the host then too, and its gather uses that copy.
- A refresh between the split and its step: the split is made again against the new
  hot set (the stale one's sizes differ: it would have cut the lookups otherwise);
  another batch than the one split ahead: split at its step.
- Training with a refresh stays equal to ordinary training: tests/test_hotline_train.py
  (``resplits`` counted there).
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch

from data.batch import Batch
from dlrm.config import load_config
from dlrm.train.hotline import AheadSplit, HotlineSteps
from embeddings.hotline.lookups import HOT_ONLY, ColdInFlight
from embeddings.hotline.mixed import GroupCold, MixedMicro, hotline_collection
from embeddings.interface import Prefetched
from embeddings.optim import make_sparse_optimizer
from tests.conftest import TINY
from tests.test_embeddings import random_kjt, tables_fixture
from tests.test_hotline import FEATURES, profile_of, rows_of, touched

BATCH = 16
DTYPES = {"t0": "bf16", "t_shared": "fp32", "t2": "fp16"}


def _setup(mixed: bool):
    """A Hotline collection (several dtypes if ``mixed``), 4 batches, and a second hot set."""
    tables = tables_fixture()
    if mixed:
        tables = [dataclasses.replace(t, dtype=DTYPES[t.name]) for t in tables]
    kjts = [random_kjt(FEATURES, rows_of(tables), batch=BATCH, max_len=2, seed=3 + s) for s in range(4)]
    g = torch.Generator().manual_seed(0)
    batches = [Batch(torch.randn(BATCH, 3, generator=g), kjt, torch.rand(BATCH, generator=g)) for kjt in kjts]
    seen = touched(tables, kjts)
    first = {n: ids[ids % 5 != 0] for n, ids in seen.items()}
    second = {n: ids[ids % 2 == 0] for n, ids in seen.items()}
    coll = hotline_collection(tables, profile_of(tables, first), make_sparse_optimizer("adam"),
                              fused=False, seed=1)
    return coll, batches, profile_of(tables, second)


def _steps(coll) -> HotlineSteps:
    cfg = load_config(TINY, ["hotline.budget=1KB"])
    return HotlineSteps(SimpleNamespace(embeddings=coll), cfg)


def _run(steps: HotlineSteps, batch: Batch, upcoming: Batch | None = None) -> list:
    return list(steps.micro_batches(batch, upcoming))


def _assert_same(got, want, label: str) -> None:
    """Tensors equal bit for bit, other values equal, dataclasses field by field."""
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want), label
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), label
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_same(a, b, f"{label}[{i}]")
    elif isinstance(want, MixedMicro):
        _assert_same(got.parts, want.parts, f"{label}.parts")
    elif dataclasses.is_dataclass(want):
        assert type(got) is type(want), label
        for f in dataclasses.fields(want):
            # events, timings, and the cold ids a split made ahead copied (checked apart)
            if f.name not in ("ready", "gather_s", "transfer_s", "cold_host_ids", "cold_host_ready"):
                _assert_same(getattr(got, f.name), getattr(want, f.name), f"{label}.{f.name}")
    else:
        assert got == want, label


def _assert_same_parts(got: list, want: list, label: str) -> None:
    assert len(got) == len(want) == 1, label  # one pass per mini-batch
    for (part, cold, last), (part_w, cold_w, last_w) in zip(got, want):
        cold, cold_w = (c.result() if isinstance(c, ColdInFlight) else c for c in (cold, cold_w))
        assert last == last_w, label
        _assert_same([part.dense, part.labels], [part_w.dense, part_w.labels], f"{label} rows")
        _assert_same(part.sparse, part_w.sparse, f"{label} lookups")
        if cold_w is HOT_ONLY:
            assert cold is HOT_ONLY, label
        else:
            parts = cold_w.parts if isinstance(cold_w, GroupCold) else [cold_w]
            got_parts = cold.parts if isinstance(cold, GroupCold) else [cold]
            _assert_same([(c.ids, c.rows, c.host_ids) for c in got_parts],
                         [(c.ids, c.rows, c.host_ids) for c in parts], f"{label} cold rows")


def _assert_cold_ids_copied_ahead(handed: list, ahead: bool) -> None:
    """The pass of a split made ahead carries its cold ids, copied to the host at the
    end of the step before, and its gather used those (not a copy of
    its own); a split made at the step carries none."""
    part, cold = handed[-1][0], handed[-1][1]
    if isinstance(cold, ColdInFlight):
        cold = cold.result()
    micros = part.sparse.parts if isinstance(part.sparse, MixedMicro) else [part.sparse]
    colds = cold.parts if isinstance(cold, GroupCold) else [cold]
    for micro, rows in zip(micros, colds, strict=True):
        if ahead:
            assert torch.equal(micro.cold_host_ids, micro.cold_ids) and rows.host_ids is micro.cold_host_ids
        else:
            assert micro.cold_host_ids is None


def _spy(monkeypatch, coll, batches: list[Batch]) -> list[tuple[str, int]]:
    """Events: ("split", batch index) per classification, ("read", i) per header read."""
    events: list[tuple[str, int]] = []
    index = {id(b.sparse): i for i, b in enumerate(batches)}
    split = coll.split_on_device

    def splitting(sparse, by_popularity=True, host=None):
        events.append(("split", index[id(host)]))
        return split(sparse, by_popularity, host=host)

    read = AheadSplit.read

    def reading(self):
        if self.sizes is None:
            events.append(("read", index[id(self.batch.sparse)]))
        return read(self)

    monkeypatch.setattr(coll, "split_on_device", splitting)
    monkeypatch.setattr(AheadSplit, "read", reading)
    return events


@pytest.mark.parametrize("mixed", [False, True])
def test_split_ahead_equals_a_split_at_the_step(mixed: bool, monkeypatch) -> None:
    coll, batches, _ = _setup(mixed)
    want = [_run(_steps(coll), b) for b in batches]  # every batch split at its own step
    ahead = _steps(coll)
    events = _spy(monkeypatch, coll, batches)
    for i, batch in enumerate(batches):
        upcoming = batches[i + 1] if i + 1 < len(batches) else None
        handed: list = []
        for item in ahead.micro_batches(batch, upcoming):
            events.append(("micro-batch", i))
            handed.append(item)
        _assert_same_parts(handed, want[i], f"batch {i} mixed={mixed}")
        _assert_cold_ids_copied_ahead(handed, ahead=i > 0)
    # batch 0 at its step; every later one split during the step before, before that
    # step's pass, and its header read after it
    runs = [[("micro-batch", i)] for i in range(4)]
    assert events == [("split", 0), ("read", 0),
                      ("split", 1), *runs[0], ("read", 1),
                      ("split", 2), *runs[1], ("read", 2),
                      ("split", 3), *runs[2], ("read", 3),
                      *runs[3]]
    stats = ahead.stats()
    assert stats["split_ahead"] == 3 / 4 and stats["resplits"] == 0
    ahead.close()


@pytest.mark.parametrize("mixed", [False, True])
def test_a_refresh_between_the_split_and_its_step_makes_it_again(mixed: bool) -> None:
    coll, batches, second = _setup(mixed)
    steps = _steps(coll)
    _run(steps, batches[0], batches[1])
    stale = steps._ahead
    assert stale is not None and stale.sizes is not None  # split and read during step 0
    coll.refresh(second)  # what after_step does at a refresh boundary
    got = _run(steps, batches[1])
    want = _run(_steps(coll), batches[1])  # split at the step, against the new hot set
    _assert_same_parts(got, want, f"after the refresh mixed={mixed}")
    _assert_cold_ids_copied_ahead(got, ahead=False)  # not the stale split's
    fresh = _steps(coll)
    assert fresh._issue(batches[1]).read() != stale.sizes  # the stale split would cut others
    assert steps.stats()["resplits"] == 1
    steps.close()


def test_another_batch_than_the_one_split_ahead_is_split_at_its_step() -> None:
    coll, batches, _ = _setup(False)
    steps = _steps(coll)
    _run(steps, batches[0], batches[1])
    got = _run(steps, batches[2])  # not the batch split ahead
    _assert_same_parts(got, _run(_steps(coll), batches[2]), "another batch")
    assert steps.stats()["resplits"] == 1
    steps.close()


def test_lookahead_shows_the_next_item_and_still_hands_it_out() -> None:
    """The trainer's batch iterator (dlrm/train/lookahead.py): ``peek`` takes nothing
    away; the items come out in their order, then ``peek`` is None."""
    import itertools

    from dlrm.train.lookahead import Lookahead

    items = Lookahead(iter("abc"))
    assert items.peek() == "a" and items.peek() == "a"
    assert list(itertools.islice(items, 2)) == ["a", "b"]
    assert items.peek() == "c"
    assert list(items) == ["c"]
    assert items.peek() is None and list(items) == []


def _train_pass(coll, handed: list) -> None:
    """Forward and backward of every handed pass, then the collection's step (the host
    update queued): what the trainer does before ``after_step``."""
    coll.set_lr(0.5)
    for part, cold, _ in handed:
        (coll(Prefetched(part.sparse, cold)) ** 2).sum().backward()
    coll.step()


@pytest.mark.parametrize("mixed", [False, True])
def test_the_next_gather_starts_after_the_update_and_reads_its_rows(mixed: bool) -> None:
    """One pass: ``after_step`` submits the next mini-batch's cold gather right after
    the step's update was queued (``gather_ahead``), and the next pass takes that
    gather. Its rows are the host rows after that update: equal, bit for bit, to a
    gather made at the step by a ``HotlineSteps`` that never splits ahead (the
    reference), and different from the rows before the update (so the update is
    really read)."""
    coll, batches, _ = _setup(mixed)
    steps = _steps(coll)
    handed = list(steps.micro_batches(batches[0], batches[1]))
    before = _run(_steps(coll), batches[1])[0][1]  # batch 1's cold rows before step 0's update
    _train_pass(coll, handed)
    steps.after_step(1)
    early = steps._ahead.gather
    assert isinstance(early, ColdInFlight)  # submitted at the end of step 0
    got = list(steps.micro_batches(batches[1]))
    assert got[0][1] is early
    want = _run(_steps(coll), batches[1])  # gathered at the step, after the update
    _assert_same_parts(got, want, f"early gather mixed={mixed}")
    rows = [c.rows for c in (_cold_parts(early.result()))]
    stale = [c.rows for c in _cold_parts(before.result())]
    assert any(not torch.equal(a, b) for a, b in zip(rows, stale))
    steps.close()


def test_no_early_gather_for_a_split_a_refresh_made_stale() -> None:
    """A refresh swapped in at the step boundary: the split made ahead is stale, so no
    gather starts for it; the next step splits and gathers again."""
    coll, batches, second = _setup(False)
    steps = _steps(coll)
    _train_pass(coll, list(steps.micro_batches(batches[0], batches[1])))
    coll.refresh(second)  # what after_step's swap does
    steps.after_step(1)
    assert steps._ahead is not None and steps._ahead.gather is None
    got = list(steps.micro_batches(batches[1]))
    _assert_same_parts(got, _run(_steps(coll), batches[1]), "after a refresh")
    assert steps.stats()["resplits"] == 1
    steps.close()


def _cold_parts(cold) -> list:
    return cold.parts if isinstance(cold, GroupCold) else [cold]


def test_the_gather_waits_only_for_the_updates_of_the_rows_it_reads(monkeypatch) -> None:
    """The previous step's host update is slow (held back here): the next gather reads
    every row at once, while that update runs, and reads again after it only the rows it
    wrote (the cold rows the two batches share). The rows gathered equal, bit for bit,
    a gather made after the update, and ``late_rows`` counts the shared rows."""
    import threading

    coll, batches, _ = _setup(False)
    tier = coll.tier
    steps = _steps(coll)
    handed = list(steps.micro_batches(batches[0], batches[1]))
    first = handed[0][1].result()
    release = threading.Event()
    apply = tier._apply
    monkeypatch.setattr(tier, "_apply", lambda *args: (release.wait(10), apply(*args))[1])
    seen: list[bool] = []  # at each row gather: whether the update had ended
    gather = tier._gather_rows
    monkeypatch.setattr(tier, "_gather_rows", lambda *a: seen.append(release.is_set()) or gather(*a))
    before_rows = _run(_steps(coll), batches[1])[0][1].result().rows  # batch 1's rows before the update
    _train_pass(coll, handed)
    steps.after_step(1)  # the next gather starts; the update is held
    early = steps._ahead.gather
    threading.Timer(0.3, release.set).start()
    got = early.result()
    assert seen and seen[0] is False  # the first gather ran while the update was held
    monkeypatch.setattr(tier, "_gather_rows", gather)
    want = _run(_steps(coll), batches[1])[0][1].result()  # after the update
    assert torch.equal(got.host_ids, want.host_ids) and torch.equal(got.rows, want.rows)
    shared = torch.isin(got.host_ids, first.host_ids)
    assert int(shared.sum()) > 0 and got.late_rows == int(shared.sum())
    assert not torch.equal(got.rows[shared], before_rows[shared])  # the update really wrote them
    steps.close()


def test_the_update_writes_the_rows_the_next_gather_reads_first(monkeypatch) -> None:
    """``announce_next_reads``: the step's host update applies the next mini-batch's cold
    rows first and the next gather waits for that part only. With the rest of the
    update held back, the gather ends; its rows equal a gather made after the whole
    update (the shared rows read again); and the host tables after the update equal,
    bit for bit, those of the same step applied in one part (Adam's step counted once)."""
    import threading

    coll, batches, _ = _setup(False)
    tier, steps = coll.tier, _steps(coll)
    handed = list(steps.micro_batches(batches[0], batches[1]))
    tables = tier.collection
    apply, rest_applied = tables.apply_gradient, threading.Event()

    def held(grad, row_sq_mean=None, count=True):  # the update's second part waits
        if not count:
            time.sleep(1.0)
        apply(grad, row_sq_mean, count)
        if not count:
            rest_applied.set()

    monkeypatch.setattr(tables, "apply_gradient", held)
    coll.set_lr(0.5)
    for part, cold, _ in handed:
        (coll(Prefetched(part.sparse, cold)) ** 2).sum().backward()
    steps.announce_next_reads()
    coll.step()
    steps.after_step(1)
    got = steps._ahead.gather.result()
    assert not rest_applied.is_set()  # the gather did not wait for the update's second part
    tier.wait_updates()
    assert rest_applied.is_set()
    monkeypatch.undo()
    want = _run(_steps(coll), batches[1])[0][1].result()  # after the whole update
    assert torch.equal(got.host_ids, want.host_ids) and torch.equal(got.rows, want.rows)
    assert got.late_rows > 0  # rows both batches read: written by the first part, read again

    ref, _, _ = _setup(False)  # the same step, its update in one part
    ref_steps = _steps(ref)
    _train_pass(ref, list(ref_steps.micro_batches(batches[0], batches[1])))
    for name, tensor in {"weight": ref.tier.collection.weight.data, **ref.tier.collection.state}.items():
        mine = tables.weight.data if name == "weight" else tables.state[name]
        assert torch.equal(mine, tensor), name
    steps.close()
    ref_steps.close()


def test_a_static_steps_cold_gradient_outlives_its_buffer() -> None:
    """``receive_rows`` is handed a view of the static step's ``cold_grad`` buffer, which
    the next step's backward writes again while the host update of this one may still
    read it (the update's second part runs after the next gather is let go). The tier
    takes its own copy (on CUDA the D2H copy; on the CPU, where moving home is no copy,
    a clone): the update applies the rows as they were when sent."""
    applied = []
    for overwrite in (False, True):
        coll, _, _ = _setup(False)
        tier = coll.tier
        dim = tier.collection.dim
        ids = torch.tensor([1, 5, 9])
        buffer = torch.arange(4 * dim, dtype=torch.float32).view(4, dim) / 100
        coll.set_lr(0.5)
        tier.receive_rows(ids, buffer[:3])
        if overwrite:  # the next static step's backward, before the update ran
            buffer.fill_(1e6)
        tier.step()
        tier.wait_updates()
        applied.append(tier.collection.weight.detach().clone())
    torch.testing.assert_close(applied[1], applied[0], rtol=0, atol=0)


def test_the_host_wait_for_each_header_is_counted_once(monkeypatch) -> None:
    """``header_wait_ms`` (the step loop's wait for the next split's sizes; on a GPU the
    split stream's work): each header's read is timed once, the read ahead and the read
    at its step together, whatever reads it again (``gather_ahead``, the step)."""
    from embeddings.hotline.split import DeviceSplit

    coll, batches, _ = _setup(False)
    steps = _steps(coll)
    read_sizes = DeviceSplit.read_sizes

    def slow(self, header):
        time.sleep(0.05)
        return read_sizes(self, header)

    monkeypatch.setattr(DeviceSplit, "read_sizes", slow)
    for i, batch in enumerate(batches):
        upcoming = batches[i + 1] if i + 1 < len(batches) else None
        for _ in steps.micro_batches(batch, upcoming):
            pass
        steps.gather_ahead()  # reads the next header again: free
    waited = steps.stats()["header_wait_ms"]  # 4 headers in 4 steps: 50 ms a step
    assert 50 <= waited < 90, waited


def _spin(seconds: float) -> None:
    """CPU time of this thread (a busy wait: thread_time counts it, as it counts no sleep)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_threads_cpu_a_step_is_told_from_the_loops_wall(monkeypatch) -> None:
    """The GPU session reads from these whether a host-bound step computes or waits:
    the step loop's CPU a step beside its wall (here 20 ms computed, 40 ms asleep a
    step), the gather thread's CPU (20 ms spun in each gather) and the update thread's
    (20 ms in each queued update), each counted on its own thread."""
    from embeddings.hotline.host_local import LocalHostTier
    from embeddings.hotline.tiers import HotlineEmbeddingCollection

    coll, batches, _ = _setup(False)
    steps = _steps(coll)
    gather, apply = HotlineEmbeddingCollection.gather_cold, LocalHostTier._apply
    monkeypatch.setattr(HotlineEmbeddingCollection, "gather_cold", lambda self, m: (_spin(0.02), gather(self, m))[1])
    monkeypatch.setattr(LocalHostTier, "_apply", lambda self, *a: (apply(self, *a), _spin(0.02))[0])
    for i, batch in enumerate(batches):
        for _ in steps.micro_batches(batch, batches[i + 1] if i + 1 < len(batches) else None):
            pass
        coll.step()  # Adam: the update thread counts the step, whatever the gradient
        coll.tier.wait_updates()
        _spin(0.02)
        time.sleep(0.04)
    stats = steps.stats()
    assert stats["loop_wall_ms"] >= 60 and 18 <= stats["loop_cpu_ms"] <= stats["loop_wall_ms"] - 35, stats
    assert 18 <= stats["gather_cpu_ms"] < 60 and 18 <= stats["update_cpu_ms"] < 60, stats
