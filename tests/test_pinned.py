"""data/pinned.py: tensors copied into one block, each a view of it, equal to the
tensors themselves (pinned or not: the layout and copies are the same; CUDA runs pin)."""

from __future__ import annotations

import pytest
import torch

from data.batch import Batch
from data.jagged import JaggedFeatures
from data.pinned import one_block, pinned_copies, to_device


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(37, 13, generator=g), torch.rand(37, generator=g),
            torch.randint(0, 1 << 40, (101,), generator=g), torch.randint(0, 9, (74,), generator=g).int(),
            torch.randn(5, 3, generator=g).to(torch.bfloat16), torch.empty(0, 13), torch.tensor(True)]


def test_copies_equal_the_tensors_in_one_block() -> None:
    tensors = _tensors()
    copies = pinned_copies(tensors, pin=False)
    storage = {c.untyped_storage().data_ptr() for c in copies}
    assert len(storage) == 1  # one block
    for t, c in zip(tensors, copies, strict=True):
        assert c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, t)
        if t.numel():  # (an empty tensor has no address)
            assert c.data_ptr() % 64 == 0 and c.data_ptr() != t.data_ptr()
    tensors[0].zero_()  # copies, not views of the sources
    assert not torch.equal(copies[0], tensors[0])


def test_a_tensor_not_contiguous_is_copied_apart() -> None:
    wide = torch.arange(40.0).view(4, 10)
    part, whole = wide[:, :3], torch.arange(6)
    copies = pinned_copies([part, whole], pin=False)
    assert torch.equal(copies[0], part) and torch.equal(copies[1], whole)
    assert copies[0].untyped_storage().data_ptr() != copies[1].untyped_storage().data_ptr()


def test_no_tensors() -> None:
    assert pinned_copies([], pin=False) == []


@pytest.mark.gpu  # page-locked memory needs CUDA
def test_batch_pin_memory_is_pinned_and_equal() -> None:
    tensors = _tensors()
    sparse = JaggedFeatures(["a", "b"], tensors[2], torch.full((74,), 1), 37)
    sparse.offsets()  # cached: pinned too
    batch = Batch(tensors[0], sparse, tensors[1])
    pinned = batch.pin_memory()
    for t, p in ((batch.dense, pinned.dense), (batch.labels, pinned.labels),
                 (sparse.values(), pinned.sparse.values()), (sparse.offsets(), pinned.sparse.offsets())):
        assert p.is_pinned() and torch.equal(p, t)
    again = pinned.pin_memory()  # pinned already: the same tensors, as torch's pin_memory()
    assert again.dense is pinned.dense and again.sparse.values() is pinned.sparse.values()


def test_nothing_to_copy_allocates_no_block(monkeypatch) -> None:
    """Tensors kept as they are (pinned already: here, as a CPU build cannot pin, the
    non-contiguous one copied apart) make no block: an empty pinned one cost ~68 us."""
    made = []
    real = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: made.append(a) or real(*a, **k))
    wide = torch.arange(40.0).view(4, 10)
    (copy,) = pinned_copies([wide[:, :3]], pin=False)
    assert torch.equal(copy, wide[:, :3]) and made == []


def _one_block_batch() -> Batch:
    """A batch whose tensors view one uint8 block, as the reader's slots lay them out
    (data/shm_batch.py), the first of them not at the block's start."""
    tensors = _tensors()
    dense, labels, values = tensors[0], tensors[1], tensors[2]
    lengths = torch.full((74,), 1)
    block = torch.zeros(64 + sum(-(-t.numel() * t.element_size() // 64) * 64 for t in (dense, labels, values, lengths)),
                        dtype=torch.uint8)
    views, at = [], 4  # 4: the first tensor starts off a cache line and off 8 bytes
    for t in (dense, labels, values, lengths):
        size = t.numel() * t.element_size()
        view = block[at:at + size].view(t.dtype).view(t.shape)
        view.copy_(t)
        views.append(view)
        at = -(-(at + size) // 64) * 64
    return Batch(views[0], JaggedFeatures(["a", "b"], views[2], views[3], 37), views[1])


def _all(batch: Batch) -> list[torch.Tensor]:
    return [batch.dense, batch.labels, *batch.sparse.tensors()]


def test_one_block_finds_the_views_of_one_storage() -> None:
    batch = _one_block_batch()
    tensors = [batch.dense, batch.labels, batch.sparse.values(), batch.sparse.lengths(), torch.empty(0)]
    block, starts = one_block(tensors)
    assert block.untyped_storage().data_ptr() == batch.dense.untyped_storage().data_ptr()
    fresh = block.clone()  # a block of its own, as on the device: the views keep their alignment
    for t, at in zip(tensors, starts, strict=True):
        size = t.numel() * t.element_size()
        assert torch.equal(fresh[at:at + size].view(t.dtype).view(t.shape), t)
    assert one_block([batch.dense, torch.zeros(3)]) is None  # another storage
    arena = torch.zeros(1 << 20)
    assert one_block([arena[:10], arena[-10:]]) is None  # far apart: the span is not theirs to copy
    assert one_block([arena[:10], arena[16:26]])[0].numel() == 26 * 4
    assert one_block([batch.dense.t()]) is None  # not contiguous
    assert one_block([torch.empty(0)]) is None


@pytest.mark.parametrize("made", ["one block", "apart", "not contiguous"])
def test_to_device_gives_views_of_one_block_equal_to_the_tensors(made: str) -> None:
    """CPU to CPU: the layout ``to_device`` makes for a GPU (one block, views of it),
    the copy itself being torch's ``to`` of that block."""
    batch = _one_block_batch()
    tensors = [batch.dense, batch.labels, batch.sparse.values(), batch.sparse.lengths()]
    if made == "apart":
        tensors = [t.clone() for t in tensors] + [torch.empty(0, 13)]
    elif made == "not contiguous":
        tensors = [torch.arange(40.0).view(4, 10)[:, :3], *tensors]
    moved = to_device(tensors, torch.device("cpu"), non_blocking=False)
    assert len({m.untyped_storage().data_ptr() for m in moved if m.numel()}) == 1
    for t, m in zip(tensors, moved, strict=True):
        assert m.dtype == t.dtype and m.shape == t.shape and torch.equal(m, t)


def test_record_stream_once_a_storage(monkeypatch) -> None:
    recorded = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: recorded.append(self))
    one = _one_block_batch()
    one.sparse.offsets()  # made on the host: a storage of its own
    one.record_stream(None)
    assert len(recorded) == 2
    recorded.clear()
    tensors = _tensors()
    Batch(tensors[0], JaggedFeatures(["a", "b"], tensors[2], torch.full((74,), 1), 37), tensors[1]).record_stream(None)
    assert len(recorded) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("made", ["one block", "apart"])
def test_batch_to_cuda_is_one_copy_of_one_block(made: str, monkeypatch) -> None:
    batch = _one_block_batch()
    if made == "one block":  # the reader's: pinned, one block already
        batch = batch.pin_memory()
        assert len({t.untyped_storage().data_ptr() for t in _all(batch)}) == 1
    else:
        tensors = _tensors()
        batch = Batch(tensors[0], JaggedFeatures(["a", "b"], tensors[2], torch.full((74,), 1), 37), tensors[1])
    batch.sparse.offsets()
    copies = []
    real = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: copies.append(self) or real(self, *a, **k))
    moved = batch.to(torch.device("cuda"), non_blocking=True)
    assert len(copies) == 1
    torch.cuda.synchronize()
    assert len({t.untyped_storage().data_ptr() for t in _all(moved)}) == 1
    for t, m in zip(_all(batch), _all(moved), strict=True):
        assert m.is_cuda and torch.equal(m.cpu(), t)


def test_a_block_copied_from_is_held_until_its_copy_is_done(monkeypatch) -> None:
    """``to_device`` holds a caller's block (a registered decode-worker slot: nothing
    else keeps it) until an event after its copy has passed; oldest first, so one whose
    copy ended behind one still running waits for it. CUDA's events are stand-ins here."""
    import gc
    import weakref
    from collections import deque

    from data import pinned

    passed: list[bool] = []

    class Event:
        def __init__(self) -> None:
            self.n = len(passed)
            passed.append(False)

        def record(self, stream: object = None) -> None:
            pass

        def query(self) -> bool:
            return passed[self.n]

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(pinned, "_IN_FLIGHT", deque())
    blocks = [torch.zeros(64, dtype=torch.uint8) for _ in range(3)]
    held = [weakref.ref(b) for b in blocks]
    for b in blocks:
        pinned._keep_until_copied(b)
    del blocks, b
    gc.collect()
    assert all(ref() is not None for ref in held)  # every copy still running
    passed[0] = passed[2] = True
    pinned._keep_until_copied(torch.zeros(1, dtype=torch.uint8))  # a later copy lets go of what passed
    gc.collect()
    assert held[0]() is None and held[1]() is not None and held[2]() is not None
    passed[1] = True
    pinned._keep_until_copied(torch.zeros(1, dtype=torch.uint8))
    gc.collect()
    assert held[1]() is None and held[2]() is None
