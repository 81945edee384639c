"""DevicePrefetcher: the same batches as plain ``Batch.to`` copies, one batch ahead.

The reference is the reader's own batches moved with ``.to(device)``. On CUDA (marker
``gpu``) the copies must also run on the prefetcher's side stream, not the default one.
"""

from __future__ import annotations

import pytest
import torch

from data.batch import Batch
from data.reader import ParquetReader
from data.schema import Schema
from dlrm.train.device_prefetch import DevicePrefetcher
from tests.data_helpers import tiny_dataset
from tests.test_reader_workers import assert_same


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Schema]:
    return tiny_dataset(tmp_path_factory.mktemp("tiny"))


def reader_batches(tiny: tuple[list[str], Schema]) -> list[Batch]:
    files, schema = tiny
    return list(ParquetReader(files, schema, 16, shuffle=True, seed=1, prefetch=0).epoch(0))


def static_like(batch: Batch, device: torch.device) -> Batch:
    """Caller-owned tensors of ``batch``'s shapes, filled with junk."""
    out = batch.to(device)
    junk = Batch(out.dense.clone().fill_(-7), out.sparse.__class__(
        out.sparse.keys(), out.sparse.values().clone().fill_(-7),
        out.sparse.lengths().clone().fill_(9), out.sparse.stride()), out.labels.clone().fill_(-7))
    junk.sparse.offsets()  # cached: the copy must refresh it
    return junk


def test_cpu_prefetch_returns_the_same_batches(tiny) -> None:
    want = reader_batches(tiny)
    got = list(DevicePrefetcher(iter(reader_batches(tiny)), "cpu"))
    assert_same(got, want)


def test_into_copies_into_the_callers_tensors(tiny) -> None:
    want = reader_batches(tiny)
    prefetcher = DevicePrefetcher(iter(want), "cpu")
    static = static_like(want[0], torch.device("cpu"))
    got = prefetcher.next(into=static)
    assert got is static
    assert_same([got], [want[0]])
    assert torch.equal(static.sparse.offsets(), want[0].sparse.offsets())
    with pytest.raises(ValueError, match="static batch tensor of shape"):
        prefetcher.next(into=Batch(torch.zeros(1, 2), want[1].sparse, torch.zeros(1)))


def test_close_stops_the_source(tiny) -> None:
    taken = []

    def source():
        for b in reader_batches(tiny):
            taken.append(b)
            yield b

    prefetcher = DevicePrefetcher(source(), "cpu")
    next(prefetcher)
    prefetcher.close()
    assert len(taken) == 2  # the one handed out and the one prefetched, nothing more
    with pytest.raises(StopIteration):
        next(prefetcher)


@pytest.mark.gpu
def test_cuda_prefetch_equals_plain_copies_on_a_side_stream(tiny, monkeypatch) -> None:
    device = torch.device("cuda")
    want = [b.to(device) for b in reader_batches(tiny)]
    streams = []
    real_to = Batch.to

    def spying_to(self: Batch, dev, non_blocking: bool = False) -> Batch:
        streams.append((torch.cuda.current_stream(), non_blocking, self.dense.is_pinned()))
        return real_to(self, dev, non_blocking)

    monkeypatch.setattr(Batch, "to", spying_to)
    prefetcher = DevicePrefetcher(iter(reader_batches(tiny)), device)
    got = []
    for batch in prefetcher:
        got.append(batch)
        torch.cuda.current_stream().synchronize()
    monkeypatch.undo()  # before the checks' own copies to the host, which it would record
    assert_same([b.to("cpu") for b in got], [b.to("cpu") for b in want])
    default = torch.cuda.default_stream()
    assert streams and all(s != default and nb and pinned for s, nb, pinned in streams), streams
    static = static_like(want[0], device)
    first = DevicePrefetcher(iter(reader_batches(tiny)), device).next(into=static)
    torch.cuda.synchronize()
    assert first is static and torch.equal(static.sparse.offsets(), want[0].sparse.offsets())
    assert_same([static.to("cpu")], [want[0].to("cpu")])


@pytest.mark.parametrize("workers,prefetch", [(0, 2), (2, 2)])
def test_the_reader_pins_batches_off_the_consumers_thread(tiny, monkeypatch, workers: int,
                                                          prefetch: int) -> None:
    """``pin_memory=True`` (training on CUDA): every batch goes through ``Batch.pin_memory``
    in a reader thread, not the thread that takes the batches, and the batches are those
    of a reader that does not pin. (This CPU build cannot page-lock: the spy stands in
    for the copy; the gpu test below checks real pinned batches.)"""
    import threading

    files, schema = tiny
    threads = []

    def spying_pin(self: Batch) -> Batch:
        threads.append(threading.current_thread())
        return Batch(self.dense.clone(), self.sparse, self.labels.clone())

    want = list(ParquetReader(files, schema, 16, shuffle=True, seed=1, workers=workers,
                              prefetch=prefetch).epoch(0))
    monkeypatch.setattr(Batch, "pin_memory", spying_pin)
    reader = ParquetReader(files, schema, 16, shuffle=True, seed=1, workers=workers, prefetch=prefetch,
                           pin_memory=True)
    got = list(reader.epoch(0))
    reader.close()
    assert_same(got, want)
    assert len(threads) == len(want) > 0
    assert threading.current_thread() not in threads


@pytest.mark.gpu
@pytest.mark.parametrize("workers", [0, 2])
def test_cuda_reader_hands_out_pinned_batches(tiny, workers: int) -> None:
    """In the reader's thread (data/pinned.py's numpy copies) and from decode workers'
    shared memory (the slot's one numpy copy into a pinned block): the same batches."""
    files, schema = tiny
    want = reader_batches(tiny)
    reader = ParquetReader(files, schema, 16, shuffle=True, seed=1, prefetch=2, pin_memory=True,
                           workers=workers)
    try:
        got = list(reader.epoch(0))
    finally:
        reader.close()
    assert all(b.dense.is_pinned() and b.sparse.values().is_pinned() and b.labels.is_pinned() for b in got)
    assert_same(got, want)


def test_a_pinning_reader_left_early_serves_the_next_epoch_and_closes(tiny, monkeypatch) -> None:
    """With workers the pin stage is a thread of its own between the workers' batches
    and the trainer: an epoch left after one batch (a preemption, an early stop) stops
    it, the next epoch's batches are the plain reader's, and close() ends the workers."""
    from tests.test_reader_workers import within

    files, schema = tiny
    monkeypatch.setattr(Batch, "pin_memory", lambda self: Batch(self.dense.clone(), self.sparse, self.labels))
    kw = {"shuffle": True, "seed": 3, "shuffle_buffer": 24}
    want = list(ParquetReader(files, schema, 12, **kw).epoch(1))
    reader = ParquetReader(files, schema, 12, workers=2, prefetch=2, pin_memory=True, **kw)
    left = reader.epoch(0)
    within(120, lambda: next(left))
    left.close()
    assert_same(within(120, lambda: list(reader.epoch(1))), want)
    assert len(reader.worker_pids()) == 2
    reader.close()
    assert reader.worker_pids() == []


@pytest.mark.gpu
@pytest.mark.parametrize("take_thread", [True, False])
def test_cuda_batches_straight_from_registered_slots_equal_the_readers(tiny, monkeypatch, take_thread: bool) -> None:
    """CUDA: decode workers' blocks registered as page-locked (data/shm_batch.py), each
    batch's H2D copy queued straight from its slot, the next batch taken while it runs:
    the device batches equal the reader's, none overwritten by a worker's next batch
    in its slot while the copy read it (data/pinned.py keeps the slot until the copy
    ends). Twice through the epoch, one batch a worker held, so slots are reused. No
    batch is copied into a pinned block on the way: a slot's four arrays are one block.
    Taken on the reader's thread, or (DLRM_TAKE_THREAD=0) on the consumer's."""
    from data import batch, pinned, shm_batch
    from data import reader as reader_module

    monkeypatch.setattr(reader_module, "TAKE_THREAD", take_thread)

    files, schema = tiny
    want = reader_batches(tiny)
    copies = []
    real = pinned.pinned_copies
    for module in (batch, pinned):  # Batch.pin_memory's and to_device's
        monkeypatch.setattr(module, "pinned_copies", lambda *a, **k: copies.append(1) or real(*a, **k))
    reader = ParquetReader(files, schema, 16, shuffle=True, seed=1, prefetch=2, pin_memory=True, workers=2,
                           worker_depth=1)
    try:
        for _ in range(2):
            got = list(DevicePrefetcher(reader.epoch(0), torch.device("cuda")))  # no wait between them
            torch.cuda.synchronize()
            assert_same([b.to("cpu") for b in got], want)
        assert any(m.registered for m in shm_batch._MAPS.values())  # the slots were registered
        assert copies == []  # not by Batch.pin_memory, nor by to_device
        assert shm_batch._DEVICE == torch.cuda.current_device()  # on the trainer's device
    finally:
        reader.close()
