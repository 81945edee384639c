"""The Hotline step's host syncs and host<->device copies, counted on the CPU.

- The popular micro-batch (every lookup hot) runs forward + backward with no op that
  would make a CUDA step wait for the device (``tests/sync_audit.py``: data-dependent
  shapes, host reads, cross-device copies), and with ONE embedding_bag forward: no
  empty cold side.
- The trainer's path (a mini-batch classified once on the device, split.py): the
  classification, the compaction of the cold ids and the cutting into micro-batches
  issue no sync at all; the two micro-batches' forward + backward only the torch
  path's KV-gradient ``unique_consecutive`` of each hot side.
- The cold path's copies: the unique cold ids back to the host once, their rows to
  the device, their gradient rows back; nothing else is counted.

On the CPU the hot tier and the host are one device, so the copies are counted
where the code issues them (``LocalHostTier.copied``), not observed on a bus: this
proves what the code asks for, not what a CUDA driver does.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from dlrm.train.sync_audit import SyncAudit
from embeddings.hotline.lookups import ColdInFlight
from embeddings.hotline.split import Sizes
from embeddings.hotline.tiers import HOT_ONLY, HotlineEmbeddingCollection
from embeddings.interface import Prefetched
from embeddings.optim import make_sparse_optimizer
from embeddings.table import Pooling
from tests.test_embeddings import random_kjt, tables_fixture
from tests.test_hotline import FEATURES, profile_of, rows_of, touched


def _collection(pooling: Pooling = Pooling.SUM):
    tables = tables_fixture(pooling)
    kjt = random_kjt(FEATURES, rows_of(tables), batch=16, max_len=2, seed=3)
    # Hot: every touched row except a few, so some samples are popular and some not.
    hot = {name: ids[ids % 5 != 0] for name, ids in touched(tables, [kjt]).items()}
    coll = HotlineEmbeddingCollection(
        tables, profile_of(tables, hot), make_sparse_optimizer("adam"), fused=False, seed=1
    )
    mask = coll.split(kjt)
    assert 0 < int(mask.sum()) < mask.numel(), "the fixture needs both kinds of samples"
    popular = kjt.select(mask.nonzero().flatten())
    rest = kjt.select((~mask).nonzero().flatten())
    return coll, popular, rest


def test_popular_micro_batch_has_no_sync_and_no_cold_side() -> None:
    for pooling in (Pooling.SUM, Pooling.MEAN):
        coll, popular, _ = _collection(pooling)
        with SyncAudit() as forward:
            out = coll(Prefetched(popular, HOT_ONLY))
        with SyncAudit() as backward:
            out.sum().backward()
        assert forward.violations == [], forward.violations
        # the hot side only (embeddings/lookup.py passes the weight detached: the no-grad kernel)
        assert forward.ops["aten._embedding_bag_forward_only"] == 1, forward.ops
        # The torch path's KV gradient coalesces its ids (one unique_consecutive, the
        # one sync left on the popular side); the Triton sorted backward has none.
        assert backward.violations == ["aten.unique_consecutive"], backward.violations
        assert not coll.tier.has_kept()  # no (empty) cold gradient went home
        assert coll.tier.copied["copies"] == 0


def _device_split(coll, kjt):
    """The trainer's path: the mini-batch classified once, the header read, both parts."""
    split = coll.split_on_device(kjt)
    sizes = Sizes.read(split.header)
    return split, sizes, coll.micro_batch(split, sizes, 0), coll.micro_batch(split, sizes, 1)


def test_device_split_and_both_micro_batches_wait_only_for_the_hot_coalesce() -> None:
    """Classification, compaction and cutting: no sync at all; the two micro-batches'
    forward + backward: only the torch path's KV-gradient ``unique_consecutive`` of
    each hot side (the cold side's ids are known: ``covers``)."""
    for pooling in (Pooling.SUM, Pooling.MEAN):
        coll, _, _ = _collection(pooling)
        kjt = random_kjt(FEATURES, rows_of(coll.tables), batch=16, max_len=2, seed=3)
        with SyncAudit() as split_audit:
            split = coll.split_on_device(kjt)
        sizes = Sizes.read(split.header)  # the one host read (the trainer's, see hotline.py)
        with SyncAudit() as cut_audit:
            parts = [coll.micro_batch(split, sizes, group) for group in (0, 1)]
        assert split_audit.violations == [] and cut_audit.violations == []
        cold = coll.gather_cold(parts[1])  # the gather thread's work
        violations, lookups = [], 0
        for part, rows in ((parts[0], HOT_ONLY), (parts[1], cold)):
            with SyncAudit() as forward:
                out = coll(Prefetched(part, rows))
            with SyncAudit() as backward:
                out.sum().backward()
            violations += forward.violations + backward.violations
            lookups += forward.ops["aten._embedding_bag_forward_only"]  # (the backward's coalescing: not counted)
        assert violations == ["aten.unique_consecutive"] * 2, violations
        assert lookups == 3  # popular: hot only; non-popular: hot + cold


def test_cold_path_copies_only_cold_ids_rows_and_their_gradients() -> None:
    coll, _, _ = _collection()
    kjt = random_kjt(FEATURES, rows_of(coll.tables), batch=16, max_len=2, seed=3)
    dim = coll.dim
    _, _, popular, rest = _device_split(coll, kjt)
    coll(Prefetched(popular, HOT_ONLY)).sum().backward()
    cold = coll.gather_cold(rest)
    coll(Prefetched(rest, cold)).sum().backward()
    coll.step()
    table_of = {f: t.name for t in coll.tables for f in t.features}
    stacked = torch.cat([kjt[f].values() + coll.row_offsets[table_of[f]] for f in FEATURES])
    cold_ids = torch.unique(stacked[~torch.isin(stacked, coll.hot_ids)])
    u = cold_ids.numel()
    assert u > 0
    torch.testing.assert_close(cold.ids, cold_ids)
    torch.testing.assert_close(cold.host_ids, cold_ids)
    # to the device: the cold rows; back: their ids (once) and their gradient rows
    assert coll.tier.copied == {"h2d": u * dim * 4, "d2h": u * 8 + u * dim * 4, "copies": 3}


def test_threaded_gather_equals_index_select(monkeypatch) -> None:
    """The gather on this thread (the default), on 3 threads of ours, and as one
    index_select over torch's threads (``gather_threads=0``): the same rows."""
    coll, _, rest = _collection()
    tier = coll.tier
    assert tier.gather_threads == 1
    one = coll.gather_cold(rest)
    tier.gather_threads = 0
    torch.testing.assert_close(coll.gather_cold(rest).rows, one.rows, rtol=0, atol=0)
    tier.gather_threads = 3
    tier._gather_pool = ThreadPoolExecutor(3)
    monkeypatch.setattr(type(tier), "PARALLEL_ROWS", 1)
    source = tier.collection.weight.data
    ids = torch.randint(0, source.shape[0], (1000,), generator=torch.Generator().manual_seed(4))
    out = source.new_empty(1000, source.shape[1])
    tier._gather_rows(source, ids, out)
    torch.testing.assert_close(out, source.index_select(0, ids), rtol=0, atol=0)
    threaded = coll.gather_cold(rest)
    torch.testing.assert_close(threaded.rows, one.rows, rtol=0, atol=0)
    tier._gather_pool.shutdown()


def test_gather_waits_for_the_queued_host_update() -> None:
    """step() queues the cold update on the host-update thread and returns; the next
    gather of the same rows waits for it and reads the updated rows."""
    import threading

    coll, popular, rest = _collection()
    tier = coll.tier
    coll.set_lr(0.1)
    cold = coll.gather_cold(rest)
    coll(Prefetched(rest, cold)).sum().backward()
    coll(Prefetched(popular, HOT_ONLY)).sum().backward()
    gate = threading.Event()
    tier._later(gate.wait)  # hold the update thread: the update queues behind it
    coll.step()  # returns at once
    assert not tier._pending.done()
    result: list = []
    reader = threading.Thread(target=lambda: result.append(coll.gather_cold(rest)))
    reader.start()
    reader.join(timeout=0.3)
    waited = reader.is_alive() and not result
    gate.set()  # before asserting: a failure must not leave the update thread blocked
    assert waited  # the gather waits for the update
    reader.join()
    updated = tier._tables.weight.data.index_select(0, cold.ids)
    assert not torch.equal(updated, cold.rows.detach())  # the update changed them
    torch.testing.assert_close(result[0].rows.detach(), updated, rtol=0, atol=0)


def test_a_refreshs_leaving_rows_are_written_home_behind_the_queued_updates() -> None:
    """A refresh's swap queues the leaving rows' write home on the host-update thread
    (refresh.py, ``write_rows_later``) and returns while it waits there: then a
    gather of those rows reads them as written (it waits for the write, as for an
    update), and so does every other reader of the tables."""
    import threading

    coll, _, rest = _collection()
    tier = coll.tier
    cold = coll.gather_cold(rest)  # rows that are cold now: their ids and values
    ids = cold.ids
    written = cold.rows.detach() + 1.0
    gate = threading.Event()
    tier._later(gate.wait)  # hold the update thread: the write queues behind it
    tier.write_rows_later(ids, written, {})  # the weights alone (the state as it is)
    try:
        assert not tier._pending.done()
        assert torch.equal(tier._tables.weight.data.index_select(0, ids), cold.rows.detach())  # not yet
        result: list = []
        reader = threading.Thread(target=lambda: result.append(coll.gather_cold(rest)))
        reader.start()
        reader.join(timeout=0.3)
        waited = reader.is_alive() and not result
    finally:
        gate.set()  # a failure must not leave the update thread blocked
    assert waited  # the gather waits for the write
    reader.join()
    torch.testing.assert_close(result[0].rows.detach(), written, rtol=0, atol=0)
    torch.testing.assert_close(tier.collection.weight.data.index_select(0, ids), written, rtol=0, atol=0)


def test_covering_coalesce_equals_from_lookups_bit_for_bit() -> None:
    """The cold side's KV gradient (every row 0..U-1 used): the same sums as the
    general coalesce, bit for bit, with no op that waits for the device."""
    from embeddings.kv import KVGradient

    g = torch.Generator().manual_seed(2)
    rows = 7
    ids = torch.cat([torch.arange(rows), torch.randint(0, rows, (40,), generator=g)])
    ids = ids[torch.randperm(ids.numel(), generator=g)]
    grad = torch.randn(12, 5, generator=g)
    index = torch.randint(0, 12, (ids.numel(),), generator=g)
    weights = torch.rand(ids.numel(), generator=g)
    want = KVGradient.from_lookups(ids, grad, index, weights)
    with SyncAudit() as audit:
        got = KVGradient.from_covering_lookups(ids, grad, rows, index, weights)
    assert audit.violations == []
    assert torch.equal(got.ids, want.ids) and torch.equal(got.rows, want.rows)


def test_the_split_made_a_step_ahead_waits_for_nothing(monkeypatch) -> None:
    """The trainer's Hotline step (dlrm/train/hotline.py) with the next mini-batch split
    ahead: handing out this batch's pass (its split made during the previous step) and
    issuing the next batch's split issue no sync; the next batch's header is read once,
    after this batch's pass (its own read is not audited here)."""
    from types import SimpleNamespace

    from data.batch import Batch
    from dlrm.config import load_config
    from dlrm.train.hotline import AheadSplit, HotlineSteps
    from tests.conftest import TINY

    coll, _, _ = _collection()
    kjt = random_kjt(FEATURES, rows_of(coll.tables), batch=16, max_len=2, seed=3)  # both kinds of samples
    batches = [Batch(torch.zeros(16, 3), kjt, torch.zeros(16)) for _ in range(3)]  # three mini-batches
    cfg = load_config(TINY, ["hotline.budget=1KB"])
    steps = HotlineSteps(SimpleNamespace(embeddings=coll), cfg)
    list(steps.micro_batches(batches[0], batches[1]))  # batch 1 split ahead, its header read
    before = dict(coll.tier.copied)
    reads: list[Batch] = []
    read = AheadSplit.read
    monkeypatch.setattr(AheadSplit, "read",
                        lambda self: (self.sizes is None and reads.append(self.batch)) or read(self))
    with SyncAudit() as audit:
        handed = [what for _, what, _ in steps.micro_batches(batches[1], batches[2])]
    assert audit.violations == [], audit.violations
    assert len(handed) == 1 and isinstance(handed[0], ColdInFlight)  # one pass, its cold rows by the thread
    cold = handed[0].result()
    assert len(reads) == 1 and reads[0] is batches[2]  # the one host read: the next batch's header
    # the cold ids (copied ahead, at the end of the step before) counted once, with the rows
    u = cold.ids.numel()
    assert u > 0 and coll.tier.copied["d2h"] - before["d2h"] == u * 8
    assert coll.tier.copied["copies"] - before["copies"] == 2  # the ids, the rows
    steps.close()
