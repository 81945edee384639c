"""A checkpoint being read is not removed under its reader.

A run keeps its newest ``train.keep_checkpoints``; ``dlrm eval RUN`` (or ``export``)
of a run still training reads the newest one, and a run that saved twice more while
it read removed it: the eval stopped with ``meta.json: missing`` or ``rank-0.42.bin
cannot be read``, as if the checkpoint were corrupt. (Measured: 6 of 12 evals of a
run saving every 2 steps.)

::

    reader:  open step-N/meta.json (read-only) ─► flock SHARED ─► still there? ─► read
             (gone: the run removed it meanwhile ─► take the newest again)
    pruner:  open step-N/meta.json ─► flock EXCLUSIVE, non-blocking
             ├─ held by a reader ─► leave step-N for a later save's pruning, or for
             │                       the last reader out (``then``: it may be the run's end)
             └─ got it ─► rename step-N.deleting, remove it (the lock held throughout)

A read-only lock needs no write access to the run (an eval of a read-only mount
locks too); on NFS the client maps ``flock`` onto the server's byte-range locks. A
file system without locks is read and pruned as before.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path

META = "meta.json"
ATTEMPTS = 8  # a run that saves and prunes faster than a lock is taken, this many times


@contextlib.contextmanager
def reading(run: Path, find: Callable[[Path], Path | None],
            then: Callable[[Path], None] | None = None) -> Iterator[Path | None]:
    """``find(run)`` (the checkpoint to read: the newest, or ``run`` itself), held
    against removal until the block ends; None where ``find`` finds none. ``then(ckpt)``
    runs once the hold is let go (the pruning the hold deferred)."""
    for _ in range(ATTEMPTS):
        ckpt = find(run)
        if ckpt is None:
            yield None
            return
        fd = _held(ckpt / META)
        if fd == -1:  # removed between the look and the lock: look again
            continue
        try:
            yield ckpt
        finally:
            if fd is not None:
                os.close(fd)
            if then is not None:
                then(ckpt)
        return
    yield find(run)  # still racing: read without the hold; a loss says so in one line


def _held(meta: Path) -> int | None:
    """A descriptor of ``meta`` with a shared lock (None: no locks here, read as is;
    -1: it is gone)."""
    try:
        fd = os.open(meta, os.O_RDONLY)
    except FileNotFoundError:
        return -1
    except OSError:
        return None  # unreadable: the load says why
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a pruning removes it
    except OSError:  # no locks on this file system: read as before
        os.close(fd)
        return None
    try:
        same = os.stat(meta).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        same = False
    if not same:
        os.close(fd)
        return -1
    return fd


@contextlib.contextmanager
def unread(ckpt: Path) -> Iterator[bool]:
    """Whether no reader holds ``ckpt``; while True, none can start (the pruner's
    exclusive lock is held until the block ends)."""
    try:
        fd = os.open(ckpt / META, os.O_RDWR)  # NFS: an exclusive lock needs write access
    except OSError:
        yield True  # no meta.json (a checkpoint of an old format): nobody can hold it
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        free = True
    except OSError as e:  # held by a reader; any other error: no locks here, pruned as before
        free = e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN)
    try:
        yield free
    finally:
        os.close(fd)
