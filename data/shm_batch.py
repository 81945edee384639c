"""Batches handed from a decode worker to the trainer in shared-memory slots, no copy.

    worker    decodes each batch straight into a free slot of its ring (:class:`SlotRing`:
              one /dev/shm block per slot, [dense | labels | values | lengths])
    queue     a small handle (:class:`SharedBatch`: block name, slot, shapes)
    trainer   handle ──:class:`Receiver`──► Batch of tensors viewing the slot; the slot is
              free again when the last of them is garbage (a finalizer writes its state)

Each slot's state lives in a byte array both sides map (``multiprocessing.RawArray``):
FREE → WRITING (the worker allocates it) → SENT (its handle is queued) → FREE (the
trainer dropped the batch, or it was never handed out). The trainer holds at most
``hold`` batches as views per worker; past that (a trainer that keeps batches, e.g.
``data.in_memory``) it copies the batch out and frees the slot at once, so the worker
always gets a slot back and never waits for ever.

With CUDA the trainer registers each block it maps as page-locked memory
(``cudaHostRegister``, portable; once per block, blocks being reused), so the batch's
views are pinned where the worker wrote them and its H2D copy is queued DMA straight
from the slot (data/pinned.py ``to_device`` keeps the slot until that copy is done).
Before, the taking thread copied every batch into a pinned block: 0.38 ms of its CPU
a batch on the 2026-11-28 H200, which bounded 16 workers at 5.3x one core. A block
that cannot be registered (or ``DLRM_SHM_PIN=0``, a developer's A/B) is copied as
before; a mapping is unregistered when let go (after a device synchronize: no copy
from it in flight).

Fresh blocks would cost a page fault per 4 KiB on both sides; slots are reused, and
the trainer maps each block once. The worker unlinks its blocks when it exits; the
trainer's mappings (and the views in them) stay valid after that.

Block names are made, not drawn: ``{prefix}-s{slot}-v{version}``, the prefix the
pool's (``new_prefix``: trainer pid, a random token) and the worker's index. A worker
killed anywhere, even between creating a block and registering it with the resource
tracker, leaves only names under its prefix, which the trainer unlinks
(``unlink_blocks``) when it finds the worker dead and when it closes the pool.
"""

from __future__ import annotations

import collections
import functools
import math
import mmap
import os
import secrets
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from data.batch import Batch
from data.jagged import JaggedFeatures
from data.pinned import on_cuda_thread, when_no_capture

FREE, WRITING, SENT = 0, 1, 2
_SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory
_WAIT_S = 0.0005  # a worker with no free slot looks again after this long
_ALIGN = 64  # bytes: each array of a slot starts on a cache line


class Abandoned(Exception):
    """The task a worker waited for a slot for was dropped (data/decode_workers.py)."""


@dataclass
class SharedBatch:
    """Where a batch's four arrays (dense, labels, values, lengths) lie: slot ``slot``,
    block ``name`` (picklable, small)."""

    name: str
    slot: int
    keys: list[str]
    stride: int
    shapes: list[tuple[int, ...]]
    dtypes: list[str]

    def nbytes(self) -> int:
        """Bytes of the block the four arrays span, from its start."""
        return _offsets(self._specs())[-1]

    def tensors(self, block: torch.Tensor) -> list[torch.Tensor]:
        """The four arrays as torch views of ``block`` (uint8: the slot's block mapped
        here, or a copy of its first ``nbytes()``; each array starts on a cache line, so
        every view is aligned). One storage under all four: one block to data/pinned.py.
        One ``as_strided`` each over the block viewed in its type, from a layout worked
        out once per shape: the slice-and-view chains and offsets worked out per batch
        took 21 us of the taking thread's ~55 a batch here, and that thread's time
        bounds 16 decode workers (the 2026-11-28 H200)."""
        typed: dict[torch.dtype, torch.Tensor] = {}
        out = []
        if block.numel() % 8 or block.stride(0) != 1:  # a batch of no bytes: a 1-byte block, or none
            block = block.as_strided((block.numel() // 8 * 8,), (1,))
        for dtype, shape, stride, offset in _views(tuple(map(tuple, self.shapes)), tuple(self.dtypes)):
            of_type = typed.get(dtype)
            if of_type is None:
                of_type = typed[dtype] = block.view(dtype)
            out.append(of_type.as_strided(shape, stride, of_type.storage_offset() + offset))
        return out

    def _specs(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        return [(tuple(s), np.dtype(d)) for s, d in zip(self.shapes, self.dtypes)]

    def batch(self, arrays: list[torch.Tensor]) -> Batch:
        dense, labels, values, lengths = arrays
        return Batch(dense=dense, labels=labels,
                     sparse=JaggedFeatures(keys=self.keys, values=values, lengths=lengths,
                                           stride=self.stride))


@functools.cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


@functools.cache
def _views(shapes: tuple[tuple[int, ...], ...], dtypes: tuple[str, ...]
           ) -> list[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]]:
    """Each array of a batch of ``shapes`` and ``dtypes`` laid out in a block: (torch
    dtype, shape, contiguous strides, offset in elements of its type)."""
    specs = [(shape, np.dtype(d)) for shape, d in zip(shapes, dtypes)]
    out = []
    for shape, dtype, at, _ in _spans(specs):
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        out.append((_torch_dtype(dtype), shape, tuple(strides), at // dtype.itemsize))
    return out


def _lay_out(block: np.ndarray, specs: list[tuple[tuple[int, ...], np.dtype]]
             ) -> list[np.ndarray]:
    """Arrays of ``specs`` one after the other in ``block`` (uint8), as views of it,
    each starting on a cache line (int64 values after float32 ones stay aligned)."""
    return [block[at : at + size].view(dtype).reshape(shape) for shape, dtype, at, size in _spans(specs)]


def _spans(specs: list[tuple[tuple[int, ...], np.dtype]]) -> list[tuple[tuple[int, ...], np.dtype, int, int]]:
    """(shape, dtype, byte offset, bytes) of each array of ``specs`` laid out one after the other."""
    return [(shape, dtype, at, math.prod(shape) * dtype.itemsize)
            for (shape, dtype), at in zip(specs, _offsets(specs))]


def _offsets(specs: list[tuple[tuple[int, ...], np.dtype]]) -> list[int]:
    """Byte offset of each array of ``specs``, then the end."""
    at = [0]
    for shape, dtype in specs:
        at.append(-(-(at[-1] + math.prod(shape) * dtype.itemsize) // _ALIGN) * _ALIGN)
    return at


class SlotRing:
    """A worker's slots (as many as ``state`` has; each block made when first needed and
    grown when a batch needs more). ``alloc`` is the decoder's ``Alloc``
    (data/rows.py): the batch is written in place; ``pack`` then queues its slot."""

    def __init__(self, state: object, prefix: str) -> None:
        self.state = state  # RawArray("b", slots), shared with the Receiver
        self.prefix = prefix  # of every block name: the trainer unlinks what a dead worker left
        self.blocks: list = [None] * len(state)  # type: ignore[arg-type]
        self.versions = [0] * len(self.blocks)  # blocks made per slot (a grown one is a new name)
        self.base = [0] * len(self.blocks)  # each block's address here
        self.alive: Callable[[], bool] = lambda: True
        # slots allocated and not yet packed, in order: the decoder makes the items in
        # the order they are packed, one alloc each (found by order, not by address: a
        # tensor of no elements does not keep its array's address)
        self.written: collections.deque[int] = collections.deque()
        self.retired: list = []  # blocks replaced while a view of them was still alive

    def start(self, alive: Callable[[], bool]) -> None:
        """A new task (``alive()`` false once it is dropped): slots written for an
        earlier task but never sent are free again."""
        self.written.clear()
        for i in range(len(self.blocks)):
            if self.state[i] == WRITING:  # type: ignore[index]
                self.state[i] = FREE  # type: ignore[index]
        self.alive = alive

    def alloc(self, specs: list[tuple[tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
        """Empty arrays of ``specs`` in a free slot (waits for one; :class:`Abandoned`
        if the task is dropped meanwhile)."""
        specs = [(shape, np.dtype(dtype)) for shape, dtype in specs]
        need = max(1, _offsets(specs)[-1])
        i = self._free_slot()
        shm = self.blocks[i]
        if shm is None or shm.size < need:
            self._replace(i, _grown(need))
        self.state[i] = WRITING  # type: ignore[index]
        self.written.append(i)
        return _lay_out(np.frombuffer(self.blocks[i].buf, np.uint8), specs)

    def _free_slot(self) -> int:
        """The first free slot: the lowest ones are reused while they come back in time,
        so a batch is written where the last few were (in cache), not across the ring."""
        while True:
            for i in range(len(self.blocks)):
                if self.state[i] == FREE:  # type: ignore[index]
                    return i
            if not self.alive():
                raise Abandoned
            time.sleep(_WAIT_S)

    def _replace(self, i: int, size: int) -> None:
        from multiprocessing import shared_memory

        if self.blocks[i] is not None:
            self.blocks[i].unlink()
            self._close(self.blocks[i])
        # a name under the worker's prefix: if the worker dies before close(), even before
        # SharedMemory registers it with the job's resource tracker, the trainer finds it
        # (a new version per block: the trainer's mappings are by name)
        name = f"{self.prefix}-s{i}-v{self.versions[i]}"
        self.versions[i] += 1
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        self.blocks[i] = shm
        self.base[i] = np.frombuffer(shm.buf, np.uint8).ctypes.data

    def pack(self, batch: Batch) -> SharedBatch:
        """The handle of ``batch`` (written by the oldest ``alloc`` not yet packed), whose
        slot is now the trainer's."""
        arrays = [batch.dense.numpy(), batch.labels.numpy(), batch.sparse.values().numpy(),
                  batch.sparse.lengths().numpy()]
        i = self.written.popleft()
        lo = self.base[i]
        for a in arrays:
            at = a.__array_interface__["data"][0]
            if a.size and not lo <= at < lo + self.blocks[i].size:
                raise RuntimeError("a decoded batch is not in the shared-memory slot allocated for it")
        self.state[i] = SENT  # type: ignore[index]
        return SharedBatch(self.blocks[i].name, i, list(batch.sparse.keys()),
                           batch.sparse.stride(), [a.shape for a in arrays],
                           [a.dtype.str for a in arrays])

    def free(self, handle: SharedBatch) -> None:
        """``handle`` was never queued: its slot is free."""
        self.state[handle.slot] = FREE  # type: ignore[index]

    def _close(self, shm: object) -> None:
        try:
            shm.close()  # type: ignore[attr-defined]
        except BufferError:  # the last batch written there is still referenced here
            self.retired.append(shm)

    def close(self) -> None:
        for shm in self.blocks:
            if shm is not None:
                shm.unlink()
                self._close(shm)
        self.blocks = [None] * len(self.blocks)


def shm_free_bytes() -> int | None:
    """/dev/shm's free bytes (None: there is none to ask)."""
    try:
        st = os.statvfs(_SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _grown(need: int) -> int:
    """A block made for ``need`` bytes is a quarter larger: a later batch may be bigger."""
    return need + need // 4


def slot_bytes(specs: list[tuple[tuple[int, ...], np.dtype]]) -> int:
    """The block ``SlotRing.alloc`` makes for a batch of ``specs`` (data/rows.py's
    ``batch_specs``): its arrays cache-line aligned, a quarter more."""
    return _grown(max(1, _offsets([(shape, np.dtype(dtype)) for shape, dtype in specs])[-1]))


def slots_that_fit(workers: int, slot: int, share: float = 0.5) -> int:
    """Slots of ``slot`` bytes each of ``workers`` may make within ``share`` of /dev/shm's
    free space; no limit (2^30) where there is no /dev/shm to ask."""
    free = shm_free_bytes()
    if free is None:
        return 1 << 30
    return int(free * share) // max(1, workers) // max(1, slot)


def new_prefix() -> str:
    """A pool's block-name prefix: this (the trainer's) process and a random token, so
    pools, readers and runs never share a name."""
    return f"dlrm-{os.getpid()}-{secrets.token_hex(4)}"


def unlink_blocks(prefix: str) -> list[str]:
    """Unlink every block whose name starts with ``prefix-`` (those of workers that are
    gone: a live one may still use them); the names unlinked. Each is also taken off the
    resource tracker's list (registered first: a worker killed before registering it
    left it off, and unregistering an unknown name makes the tracker print a traceback)."""
    from multiprocessing import resource_tracker

    gone = []
    for name in sorted(os.listdir(_SHM_DIR)):
        if name.startswith(f"{prefix}-"):
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
            except FileNotFoundError:  # unlinked already (another cleanup)
                continue
            resource_tracker.register(f"/{name}", "shared_memory")
            resource_tracker.unregister(f"/{name}", "shared_memory")
            gone.append(name)
    return gone


class Receiver:
    """The trainer's side of one worker's slots: a handle becomes a Batch viewing its
    slot (at most ``hold`` at a time; a copy past that, or pinned copies if ``pin``)."""

    def __init__(self, state: object, hold: int, pin: bool) -> None:
        self.state, self.hold, self.pin = state, hold, pin
        self.held = 0  # batches handed out as views, less those in ``released``
        # finalizers run in whichever thread drops a batch, at any point (a garbage
        # collection): they only append here (atomic) and free the slot, no lock
        self.released: collections.deque = collections.deque()

    def take(self, handle: SharedBatch) -> Batch:
        while self.released:
            self.released.popleft()
            self.held -= 1
        # a fresh array over the whole block: the four views' base, so when the last of
        # them is garbage, so is it, and its finalizer frees the slot
        block = np.frombuffer(_attach(handle.name), np.uint8)
        if (not self.pin or _registered(handle.name)) and self.held < self.hold:
            self.held += 1
            weakref.finalize(block, _release, self.state, handle.slot, self.released)
            # torch views of one torch tensor over the block: one storage, so the batch is
            # one block to data/pinned.py (to_device: one H2D copy straight from the slot).
            # torch.from_numpy of each array would give each its own storage, and the
            # step loop would copy all four into a fresh pinned block before its copy.
            return handle.batch(handle.tensors(torch.from_numpy(block)))
        # one copy of the slot's used bytes into one (pinned) block, the four arrays views
        # of it: one allocation and one copy a batch, not four of each (a pinned
        # allocation took ~20 us on the 2026-11-28 H200 host, where this copy was 0.48 ms
        # of the taking thread's CPU a batch). Torch views, not numpy ones: a non_blocking
        # H2D copy from them marks the pinned block in use (torch's host allocator finds it
        # by the storage), so it is not handed out again before the copy ends.
        used = handle.nbytes()
        out = torch.empty(used, dtype=torch.uint8, pin_memory=self.pin)
        # numpy's copy, on this thread with the GIL released: torch's copy_ spreads over
        # its intra-op threads, which the decode workers' cores keep waiting (data/pinned.py)
        np.copyto(out.numpy(), block[:used])
        self.free(handle)
        return handle.batch(handle.tensors(out))

    def free(self, handle: SharedBatch) -> None:
        """The slot of a batch not (or no longer) handed out is free."""
        self.state[handle.slot] = FREE  # type: ignore[index]


def _release(state: object, slot: int, released: collections.deque) -> None:
    state[slot] = FREE  # type: ignore[index]
    released.append(slot)


@dataclass
class _Mapped:
    """A block mapped in the trainer; ``registered``: page-locked for CUDA (None: not
    tried yet)."""

    name: str
    mm: mmap.mmap
    registered: bool | None = None


# the trainer's mappings of workers' blocks, by slot ("{prefix}-w{i}-s{slot}"). A slot's
# grown block replaces its older version here; a closed pool's are forgotten
# (forget_maps). A mapping is never closed: it goes when the last array viewing it does.
_MAPS: dict[str, _Mapped] = {}
# at most this many (the oldest let go): every slot of the live pools stays mapped, as a
# block mapped anew costs a page fault per 4 KiB again (16 workers x (128 + 9) slots: 2,192)
_KEEP_MAPS = 4096
# registered mappings let go and not yet unregistered (a capture was in progress: _let_go)
_UNREGISTER: collections.deque[_Mapped] = collections.deque()
# CUDA registration of the blocks (module docstring): "0" turns it off, to compare; a
# failed registration turns it off too (none is tried again)
_PIN_SLOTS = os.environ.get("DLRM_SHM_PIN", "1") != "0"
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context (a rank's is not device 0's)
# the trainer's CUDA device (register_for): the registration thread's, and the one synchronized
# before a block is unregistered. None: the CUDA runtime's default for a new thread, device 0
_DEVICE: int | None = None


def register_for(device: int) -> None:
    """Register blocks, and wait before unregistering them, on CUDA ``device``: the
    trainer's (ParquetReader.epoch passes its thread's current device). A thread starts
    on device 0: with 8 ranks on one machine, every rank's registration would otherwise
    make a CUDA context on GPU 0 (hundreds of MB each there), and the synchronize before
    unregistering would wait for GPU 0, not for the rank's own copies."""
    global _DEVICE
    _DEVICE = device


def _attach(name: str) -> mmap.mmap:
    """Block ``name`` mapped here (once)."""
    slot = name.rsplit("-v", 1)[0]
    held = _MAPS.get(slot)
    if held is not None and held.name == name:
        return held.mm
    _unregister_let_go()  # any put off by a capture
    fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDWR)
    try:
        mm = mmap.mmap(fd, 0)
    finally:
        os.close(fd)
    _let_go(_MAPS.pop(slot, None))  # (re)inserted last: the oldest are first
    _MAPS[slot] = _Mapped(name, mm)
    for old in list(_MAPS)[: max(0, len(_MAPS) - _KEEP_MAPS)]:
        _let_go(_MAPS.pop(old, None))  # another reader's thread may have let it go first
    return mm


def _registered(name: str) -> bool:
    """Whether block ``name`` (mapped by ``_attach``) is page-locked for CUDA: registered
    at its first use here, once."""
    global _PIN_SLOTS
    held = _MAPS.get(name.rsplit("-v", 1)[0])
    if held is None or held.name != name:
        return False
    if held.registered is None:
        now, outcome = when_no_capture(lambda: _PIN_SLOTS and _host_register(held.mm))
        if not now:  # a CUDA graph is being captured (data/pinned.py): copied this time
            return False
        held.registered = _PIN_SLOTS = bool(outcome)
    return held.registered


def _host_register(mm: mmap.mmap) -> bool:
    """``mm`` registered as page-locked memory for every CUDA context (False: it could
    not be; the run copies its batches into pinned blocks instead)."""
    # whole pages (the mapping's last one is mapped whole), as page-locking pins them
    size = -(-len(mm) // mmap.PAGESIZE) * mmap.PAGESIZE
    try:
        err = _on_cuda_thread(lambda: torch.cuda.cudart().cudaHostRegister(_address(mm), size, _PORTABLE))
    except Exception:  # noqa: BLE001 - no CUDA runtime to ask: copied, as without registration
        return False
    return int(err) == 0


def _let_go(held: _Mapped | None) -> None:
    """A mapping no longer kept: unregistered if it was registered, once every queued
    device copy (from it, among others) is done; its views, if any, stay valid as
    ordinary memory. While a CUDA graph is being captured (data/pinned.py
    ``capturing``), where the wait for the device would break the capture, it is put
    off to the next mapping made or let go (held until then: its pages stay mapped)."""
    if held is None or not held.registered:
        return
    held.registered = False
    _UNREGISTER.append(held)
    _unregister_let_go()


def _unregister_let_go() -> None:
    """Every mapping let go unregistered, after the device's queued copies (none where a
    capture is in progress: at the next call)."""

    def unregister() -> None:
        torch.cuda.synchronize(_DEVICE)
        while _UNREGISTER:
            held = _UNREGISTER.popleft()
            _on_cuda_thread(lambda h=held: torch.cuda.cudart().cudaHostUnregister(_address(h.mm)))

    if not _UNREGISTER:
        return
    try:
        when_no_capture(unregister)
    except Exception:  # noqa: BLE001 - a pool closed at exit may find CUDA gone: its pages go with the process
        _UNREGISTER.clear()


def _on_cuda_thread(call: Callable[[], object]) -> object:
    """``call()`` (a registration call) on the registration thread (data/pinned.py
    ``on_cuda_thread``), on the trainer's device (register_for)."""
    return on_cuda_thread(call, _DEVICE)


def _address(mm: mmap.mmap) -> int:
    """The address of ``mm``'s first byte (no view of it is left behind)."""
    return int(np.frombuffer(mm, np.uint8).ctypes.data)


def forget_maps(prefix: str) -> None:
    """Let go of the mappings of a pool's blocks (``prefix``: the pool's; its workers are
    gone), so they no longer hold its shared memory once its batches are dropped."""
    for slot in [s for s in list(_MAPS) if s.startswith(f"{prefix}-")]:
        _let_go(_MAPS.pop(slot, None))
