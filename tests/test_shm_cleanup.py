"""A killed decode worker leaves nothing in /dev/shm (data/shm_batch.py's names).

A worker names each shared-memory block under its pool's prefix; the trainer unlinks
every name under it once the worker is gone. The window that used to leak: a block
made (``shm_open``) but not yet registered with the resource tracker when the worker
died, its name a random one nobody could find. References: the listing of /dev/shm.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import threading
import time

import numpy as np

from data.decode_workers import DecodeWorkerError
from data.reader import ParquetReader
from data.shm_batch import SlotRing, new_prefix, unlink_blocks
from tests.data_helpers import tiny_dataset, within
from tests.test_reader_workers import assert_same


def blocks_of(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"{prefix}-"))


def _die_between_creating_and_registering(prefix: str) -> None:
    """A worker's ring making its first block, killed right after ``shm_open`` and the
    mapping, before SharedMemory registers the block with the resource tracker."""
    from multiprocessing import resource_tracker

    resource_tracker.register = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
    ring = SlotRing(mp.RawArray("b", 3), prefix)
    ring.alloc([((4, 2), np.float32), ((4,), np.float32)])


def test_a_worker_killed_mid_block_creation_leaves_a_name_the_trainer_unlinks() -> None:
    prefix = f"{new_prefix()}-w0"
    proc = mp.get_context("spawn").Process(target=_die_between_creating_and_registering, args=(prefix,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    made = blocks_of(prefix)
    assert made == [f"{prefix}-s0-v0"]  # the window was hit: the block exists, unregistered
    assert unlink_blocks(prefix) == made
    assert blocks_of(prefix) == []


def test_workers_killed_at_random_points_leave_no_block(tmp_path) -> None:
    """Rounds of: an epoch read in a thread, one worker killed a random 0-40 ms after the
    pool's workers are up (often while they make their first blocks). After the error
    (or, if the epoch finished first, the next epoch's fresh pool) and after close,
    /dev/shm holds nothing of any of the reader's pools."""
    files, schema = tiny_dataset(tmp_path)
    reader = ParquetReader(files, schema, 4, workers=2, prefetch=1, shuffle_buffer=8)
    rng = random.Random(0)
    prefixes, errors = [], 0
    deadline = time.monotonic() + 90
    for epoch in range(6):
        if time.monotonic() > deadline:
            break
        it = reader.epoch(epoch)
        result: dict = {}
        reading = threading.Thread(target=lambda it=it, result=result: result.update(out=_drain(it)), daemon=True)
        reading.start()
        pids = within(60, lambda: _wait_for(reader.worker_pids))
        prefixes.append(reader._pool.prefix)
        time.sleep(rng.uniform(0.0, 0.04))
        os.kill(rng.choice(pids), signal.SIGKILL)
        reading.join(60)
        assert not reading.is_alive(), "hung"
        errors += result["out"] == "died"
        if result["out"] == "died":  # the pool closed itself: its blocks are gone now
            assert blocks_of(prefixes[-1]) == []
    reader.close()
    assert errors >= 1
    for prefix in prefixes:
        assert blocks_of(prefix) == [], prefix


def _drain(it) -> str:
    try:
        for _ in it:
            pass
    except DecodeWorkerError:
        return "died"
    return "finished"


def _wait_for(pids_of) -> list[int]:
    while len(pids := pids_of()) < 2:
        time.sleep(0.001)
    return pids


def test_a_closed_reader_leaves_no_block(tmp_path) -> None:
    """After close the names are gone; the batches still held view their blocks'
    mappings, equal to the one-thread reader's."""
    files, schema = tiny_dataset(tmp_path)
    kw = {"prefetch": 1, "shuffle_buffer": 8}
    reader = ParquetReader(files, schema, 4, workers=2, **kw)
    held = within(120, lambda: list(reader.epoch(0)))
    prefix = reader._pool.prefix
    assert blocks_of(prefix)  # the live workers' blocks
    reader.close()
    assert blocks_of(prefix) == []
    assert_same(held, list(ParquetReader(files, schema, 4, workers=0, **kw).epoch(0)))


def mapped(prefix: str) -> list[str]:
    """Blocks under ``prefix`` this process still maps (unlinked ones included)."""
    with open("/proc/self/maps") as f:
        return sorted({line.split("/dev/shm/")[1].split()[0] for line in f
                       if f"/dev/shm/{prefix}-" in line})


def test_a_closed_readers_shared_memory_goes_with_its_last_batch(tmp_path) -> None:
    """The trainer's mappings of a closed pool's blocks are let go: once the batches
    viewing them are dropped, none is mapped (the memory goes back to the system)."""
    import gc

    files, schema = tiny_dataset(tmp_path)
    reader = ParquetReader(files, schema, 4, workers=2, prefetch=1, shuffle_buffer=8)
    held = within(120, lambda: list(reader.epoch(0)))
    prefix = reader._pool.prefix
    reader.close()
    assert mapped(prefix)  # the batches held still view them
    del held
    gc.collect()
    assert mapped(prefix) == []


def test_a_grown_block_replaces_its_older_version_in_the_trainers_mappings() -> None:
    from data.shm_batch import _attach, forget_maps

    prefix = new_prefix()
    names = [f"{prefix}-w0-s0-v{v}" for v in range(2)]
    for v, name in enumerate(names):  # made as a worker makes them, not mapped here
        fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4096 * (v + 1))
        os.close(fd)
    try:
        assert len(_attach(names[0])) == 4096 and _attach(names[0]) is _attach(names[0])
        assert mapped(prefix) == [names[0]]
        assert len(_attach(names[1])) == 8192
        assert mapped(prefix) == [names[1]]  # v0 let go: nothing viewed it
        forget_maps(prefix)
        assert mapped(prefix) == []
    finally:
        unlink_blocks(prefix)
