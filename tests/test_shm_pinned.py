"""With CUDA, the trainer registers the decode workers' shared-memory blocks as
page-locked memory (data/shm_batch.py): a batch is handed out as views of its slot,
no copy, and its H2D copy reads the slot itself. Here CUDA's registration calls are a
recording stand-in (tests/test_device_prefetch.py runs them on a GPU): each block is
registered once, at its first batch; a grown block's older mapping and a closed
pool's mappings are unregistered; a failed registration falls back to the copies and
is not tried again; DLRM_SHM_PIN=0 registers nothing."""

from __future__ import annotations

import gc
import mmap
import multiprocessing as mp
import threading

import numpy as np
import pytest
import torch

from data import pinned, shm_batch
from data.batch import Batch
from data.jagged import JaggedFeatures
from data.pinned import one_block
from data.rows import batch_specs
from data.shm_batch import Receiver, SlotRing, forget_maps, new_prefix, unlink_blocks


class FakeCudart:
    """``torch.cuda.cudart()``'s two calls, recorded; registration succeeds if ``ok``."""

    def __init__(self, ok: bool = True) -> None:
        self.ok, self.calls, self.threads = ok, [], set()

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size, flags))
        self.threads.add(threading.current_thread().name)
        return 0 if self.ok else 2

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        self.threads.add(threading.current_thread().name)
        return 0


@pytest.fixture
def cudart(monkeypatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: fake.calls.append(("synchronize", device)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: fake.calls.append(
        ("set_device", device, threading.current_thread().name)))
    monkeypatch.setattr(shm_batch, "_PIN_SLOTS", True)
    monkeypatch.setattr(shm_batch, "_DEVICE", None)
    return fake


def _send(ring: SlotRing, rows: int, value: float) -> shm_batch.SharedBatch:
    """A batch of ``rows`` rows, 3 single-hot features, written into a slot and packed."""
    dense, labels, values, lengths = ring.alloc(batch_specs(rows, 2, 3 * rows, 3))
    dense.fill(value)
    labels.fill(value)
    values[:] = np.arange(3 * rows)
    lengths.fill(1)
    batch = Batch(torch.from_numpy(dense), JaggedFeatures(["a", "b", "c"], torch.from_numpy(values),
                                                          torch.from_numpy(lengths), rows), torch.from_numpy(labels))
    return ring.pack(batch)


def _address(name: str) -> int:
    return int(np.frombuffer(shm_batch._attach(name), np.uint8).ctypes.data)


def test_a_registered_slot_is_handed_out_as_views_registered_once(cudart: FakeCudart) -> None:
    prefix = new_prefix()
    state = mp.RawArray("b", 4)
    ring = SlotRing(state, f"{prefix}-w0")
    receiver = Receiver(state, hold=2, pin=True)
    try:
        handle = _send(ring, 4, 1.0)
        batch = receiver.take(handle)
        block = _address(handle.name)
        assert block <= batch.dense.data_ptr() < block + len(shm_batch._attach(handle.name))  # a view: no copy
        span = one_block(batch._tensors())  # one storage: to_device copies it once, from the slot
        assert span is not None and span[0].data_ptr() == block and span[0].numel() <= handle.nbytes()
        assert torch.equal(batch.sparse.values(), torch.arange(12)) and batch.dense.eq(1.0).all()
        pages = -(-len(shm_batch._attach(handle.name)) // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages
        assert cudart.calls == [("register", block, pages, 1)]  # portable
        del batch, span
        gc.collect()  # the slot is free again: the next batch is written there
        again = _send(ring, 4, 2.0)
        assert again.name == handle.name
        batch = receiver.take(again)
        assert batch.dense.eq(2.0).all() and len(cudart.calls) == 1  # the same block: not again
        del batch
        gc.collect()
        grown = _send(ring, 64, 3.0)  # a bigger batch: the slot's block is made anew
        assert grown.name != handle.name and grown.slot == handle.slot
        batch = receiver.take(grown)
        assert cudart.calls[1:3] == [("synchronize", None), ("unregister", block)]  # the older one let go
        assert cudart.calls[3][:2] == ("register", _address(grown.name))
        assert batch.labels.eq(3.0).all()
        forget_maps(prefix)  # the pool closed: its mappings are unregistered
        assert cudart.calls[4:] == [("synchronize", None), ("unregister", cudart.calls[3][1])]
        assert batch.labels.eq(3.0).all()  # a batch still held stays valid, as ordinary memory
        # on a thread of their own: a failed call's CUDA error stays in that thread's
        # last-error state, where no kernel launch of the trainer's finds it
        assert len(cudart.threads) == 1 and cudart.threads.pop().startswith("cuda-register")
    finally:
        ring.close()
        forget_maps(prefix)
        unlink_blocks(prefix)


@pytest.mark.parametrize("how", ["fails", "off"])
def test_a_block_not_registered_is_copied_and_none_is_tried_again(cudart: FakeCudart, monkeypatch,
                                                                   how: str) -> None:
    if how == "fails":
        cudart.ok = False
    else:
        monkeypatch.setattr(shm_batch, "_PIN_SLOTS", False)
    prefix = new_prefix()
    rings = [SlotRing(mp.RawArray("b", 2), f"{prefix}-w{i}") for i in range(2)]
    try:
        handles = [_send(ring, 4, 1.0) for ring in rings]
        for h in handles:
            shm_batch._attach(h.name)
            assert not shm_batch._registered(h.name)  # the receiver then copies (into pinned memory)
        assert [c[0] for c in cudart.calls] == (["register"] if how == "fails" else [])
        forget_maps(prefix)
        assert [c[0] for c in cudart.calls] == (["register"] if how == "fails" else [])  # nothing to unregister
    finally:
        for ring in rings:
            ring.close()
        forget_maps(prefix)
        unlink_blocks(prefix)


def test_blocks_are_registered_and_waited_for_on_the_trainers_device(cudart: FakeCudart) -> None:
    """A rank on GPU 3: its registration thread is put on device 3 before each call (a new
    thread is on device 0, where every rank would make a CUDA context), and the wait
    before unregistering is for device 3's copies."""
    shm_batch.register_for(3)
    prefix = new_prefix()
    state = mp.RawArray("b", 4)
    ring = SlotRing(state, f"{prefix}-w0")
    receiver = Receiver(state, hold=2, pin=True)
    try:
        batch = receiver.take(_send(ring, 4, 1.0))
        forget_maps(prefix)
        thread = "cuda-register"
        kinds = [(c[0], c[1]) if c[0] in ("set_device", "synchronize") else (c[0],) for c in cudart.calls]
        assert kinds == [("set_device", 3), ("register",), ("synchronize", 3), ("set_device", 3), ("unregister",)]
        assert all(c[2].startswith(thread) for c in cudart.calls if c[0] == "set_device")
        assert batch.dense.eq(1.0).all()
    finally:
        ring.close()
        forget_maps(prefix)
        unlink_blocks(prefix)


def test_no_registration_call_meets_a_capture(cudart: FakeCudart) -> None:
    """While a CUDA graph is captured (any thread), a device synchronize breaks the
    capture, so a slot let go then (its block grew) is unregistered at the next mapping
    made after the capture, and a new block is not registered during one (its batch is
    copied) but at its next use after (the 2026-12-07 review)."""
    prefix = new_prefix()
    state = mp.RawArray("b", 4)
    ring = SlotRing(state, f"{prefix}-w0")
    receiver = Receiver(state, hold=2, pin=True)
    try:
        first = _send(ring, 4, 1.0)
        receiver.take(first)
        gc.collect()
        assert [c[0] for c in cudart.calls] == ["register"]
        with pinned.capturing():
            grown = _send(ring, 64, 2.0)  # the slot's block made anew: the older one let go
            assert grown.name != first.name
            shm_batch._attach(grown.name)
            assert not shm_batch._registered(grown.name)  # copied this time
            assert [c[0] for c in cudart.calls] == ["register"]  # no synchronize, no unregister
        assert shm_batch._registered(grown.name)  # registered at its next use
        assert [c[0] for c in cudart.calls] == ["register", "register"]
        other = SlotRing(state, f"{prefix}-w1")
        shm_batch._attach(_send(other, 4, 3.0).name)  # the next mapping: the one put off goes
        assert [c[0] for c in cudart.calls] == ["register", "register", "synchronize", "unregister"]
        assert cudart.calls[3][1] == cudart.calls[0][1]  # the first block's
        other.close()
    finally:
        ring.close()
        forget_maps(prefix)
        unlink_blocks(prefix)


def test_captures_wait_for_no_registration_and_nest_on_one_thread() -> None:
    """``when_no_capture`` runs its call only between captures; a capture's own thread
    may ask (a finalizer run by the capture's garbage collection) and is told not now."""
    assert pinned.when_no_capture(lambda: 7) == (True, 7)
    with pinned.capturing():
        assert pinned.when_no_capture(lambda: 7) == (False, None)
        with pinned.capturing():
            pass
        assert pinned.when_no_capture(lambda: 7) == (False, None)
    assert pinned.when_no_capture(lambda: 7) == (True, 7)


@pytest.mark.parametrize("site", ["graphs", "split_graphs", "dense_graphs"])
def test_every_capture_marks_itself(monkeypatch, site: str) -> None:
    """Each place that captures a CUDA graph does it inside ``capturing``."""
    import contextlib

    from dlrm.train import dense_graphs, graphs, split_graphs

    seen = []

    @contextlib.contextmanager
    def graph(g, **kwargs):
        seen.append(pinned.when_no_capture(lambda: None)[0])
        yield

    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    if site == "graphs":
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        graphs.capture(lambda static: torch.zeros(()), None, opt)
    else:
        with {"split_graphs": split_graphs, "dense_graphs": dense_graphs}[site]._cuda_capture(object()):
            pass
    assert seen == [False]


@pytest.mark.parametrize("shapes,dtypes", [
    ([(5, 3), (5,), (17,), (15,)], ["<f4", "<f4", "<i8", "<i4"]),  # int64 ids after float32s
    ([(4, 0), (4,), (0,), (0,)], ["<f4", "<f4", "<i4", "<i8"]),  # no dense column, no id
    ([(2, 1), (2,), (6,), (6,)], ["<f4", "<f4", "<i4", "<i4"]),
    ([(0, 2), (0,), (0,), (0,)], ["<f4", "<f4", "<i8", "<i4"]),  # a batch of no rows: a 1-byte block
])
def test_a_batchs_tensors_are_numpys_layout_of_one_block(shapes, dtypes) -> None:
    """``SharedBatch.tensors`` (``as_strided`` over the block in each type, from a layout
    worked out once per shape) gives what numpy's views of the same block hold, each
    starting where numpy's does, all on the block's one storage: in the slot's memory,
    in a copy of its used bytes, and in a block that starts inside its storage."""
    handle = shm_batch.SharedBatch("unused", 0, ["a"], 1, shapes, dtypes)
    specs = handle._specs()
    size = shm_batch._grown(max(1, handle.nbytes()))  # as SlotRing.alloc makes it
    raw = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    padded = np.concatenate([np.zeros(64, np.uint8), raw])
    copied = raw[: handle.nbytes()].copy()
    blocks = [(raw, torch.from_numpy(raw)), (copied, torch.from_numpy(copied)),
              (padded[64:], torch.from_numpy(padded)[64:])]  # the last starts inside its storage
    for block, base in blocks:
        arrays = shm_batch._lay_out(block, specs)
        tensors = handle.tensors(base)
        assert len(tensors) == 4
        for array, tensor in zip(arrays, tensors, strict=True):
            assert tensor.shape == array.shape and tensor.is_contiguous()
            assert np.array_equal(tensor.numpy(), array)
            if array.size:
                assert tensor.data_ptr() == array.ctypes.data
            assert tensor.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
