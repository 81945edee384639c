"""The host tier's tables read and written in place by the GPU (``hotline.cold_path=mapped``).

The host path gathers a step's cold rows on a host thread into a pinned buffer and
copies them over, and a static step's updated rows come back by D2H copy for the
host-update thread to store (host_local.py ``gather_cold``, ``write_back``). On a GPU
the step loop is the bound (the 2026-11-28 H200: a 1.13 ms replay in a ~2.4-3 ms
step), and those threads share its interpreter lock: each torch call of any of them
drops the lock, and the one that wants it back waits for the others' Python. Here the
tables are registered with CUDA once (page-locked in place, mapped into the device's
address space) and the step loop's stream does both ends with one kernel a tensor:

    host tables (pageable, 2 MiB pages)  ──cudaHostRegister (in place)──►  pinned, mapped
        weight [R, D], state [R] / [R, D]                                   │ same bytes
    device view: a CUDA tensor over the mapped address (no copy) ◄──────────┘
    step t:   cold rows [U, D] (+ state) = view.index_select(0, cold ids)   reads over PCIe
              replay: lookups, backward, the staged rows updated (cold_stage.py)
              view.index_copy_(0, cold ids, rows[:U]) (+ state)             writes over PCIe
    step t+1: its reads follow step t's writes on the same stream: nothing stale

No gather thread, no pinned buffer, no copy either way, no store on the host. Host
readers of the tables wait for an event after the device's last write
(host_local.py ``wait_updates``); the device's reads wait for the host's queued
writes first (``_mapped_waits``). On the CPU (the tests' runs) the "device" is the
host: the view is the table itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch

from data.pinned import on_cuda_thread

_PORTABLE, _MAPPED = 1, 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
_PAGE = 4096
_DEVICE_POINTER = 3  # CU_POINTER_ATTRIBUTE_DEVICE_POINTER


class MappedTables:
    """Host tensors registered with CUDA and a device view of each (see the module
    docstring). ``view(t)``: ``t`` as the device reads it; a tensor that is not
    registered yet is registered then (its storage, whole pages)."""

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._views: dict[tuple[int, int], torch.Tensor] = {}  # (storage address, bytes): bytes on the device
        # page ranges [start, end) registered, each its own call: two storages may share a
        # page (small ones from the heap, side by side), which CUDA registers once only
        self._ranges: list[tuple[int, int]] = []

    @property
    def registered_bytes(self) -> int:
        return sum(end - start for start, end in self._ranges)

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (a host tensor) as a tensor on ``device`` over the same memory."""
        if self.device.type != "cuda":
            return tensor
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        raw = self._views.get(key)
        if raw is None:
            raw = self._views[key] = self._map(*key)
        return raw.view(tensor.dtype).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())

    def _map(self, address: int, nbytes: int) -> torch.Tensor:
        """The storage at ``address`` registered (page-locked, mapped: its pages not
        registered yet) and viewed as ``nbytes`` bytes on the device. RuntimeError where
        CUDA refuses."""
        first = address & ~(_PAGE - 1)
        for start, end in _gaps(first, -(-(address + nbytes) // _PAGE) * _PAGE, self._ranges):
            err = on_cuda_thread(lambda s=start, n=end - start: torch.cuda.cudart().cudaHostRegister(
                s, n, _PORTABLE | _MAPPED), self.device.index)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {end - start:,} bytes failed (CUDA error {int(err)})")
            self._ranges.append((start, end))
        pointer = on_cuda_thread(lambda: _device_pointer(address), self.device.index)  # a thread with the context
        # as_tensor reads the CUDA array interface (torch.asarray does not: with copy=False
        # it refuses any object but a tensor, a numpy array, DLPack or a buffer, as the
        # 2026-12-07 review found), its device that of the pointer (cudaPointerGetAttributes).
        # device= the same: no copy; a copy (another device) fails the check below
        raw = torch.as_tensor(_Bytes(pointer, nbytes), device=self.device)
        if raw.device != self.device or raw.data_ptr() != pointer:
            raise RuntimeError(f"the mapped tables' view is at {raw.device} {raw.data_ptr():#x}, "
                               f"not {self.device} {pointer:#x}")
        return raw

    def close(self) -> None:
        """Every registration undone, once the device's queued reads are done."""
        self._views.clear()
        if not self._ranges:
            return
        torch.cuda.synchronize(self.device)
        for start, _ in self._ranges:
            on_cuda_thread(lambda s=start: torch.cuda.cudart().cudaHostUnregister(s), self.device.index)
        self._ranges.clear()


def _gaps(start: int, end: int, taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of [start, end) that no range of ``taken`` covers, in order."""
    gaps, at = [], start
    for lo, hi in sorted(taken):
        if hi <= at or lo >= end:
            continue
        if lo > at:
            gaps.append((at, lo))
        at = max(at, hi)
    if at < end:
        gaps.append((at, end))
    return gaps


class _Bytes:
    """``nbytes`` bytes at device address ``pointer``, for ``torch.as_tensor`` (the CUDA
    array interface: bytes, as it has no type string for bf16)."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (pointer, False),
                                         "version": 2, "strides": None}


def _device_pointer(address: int) -> int:
    """The device's address of registered host memory at ``address`` (the same on most
    64-bit systems; the driver says: cuPointerGetAttribute, which torch does not bind)."""
    lib = _libcuda()
    out = ctypes.c_uint64(0)
    err = lib.cuPointerGetAttribute(ctypes.byref(out), _DEVICE_POINTER, ctypes.c_uint64(address))
    if err != 0:
        raise RuntimeError(f"cuPointerGetAttribute(DEVICE_POINTER) failed (CUDA driver error {err})")
    return int(out.value)


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
