"""One training job per run directory at a time.

Two ``dlrm train --out RUN`` at once (a job requeued while the first still runs, a
command started twice) both wrote RUN: the second resumed from the first's newest
checkpoint, then each save removed the other's ``step-N.partial`` as a stale one,
and both appended to ``metrics.jsonl``. The second ended with a baffling
``FileNotFoundError`` line, or, with other timing, a checkpoint from a run that
then trained on as another.

Rank 0 holds an exclusive ``flock`` on ``RUN/.lock`` for the whole run (the kernel
drops it when the process ends, however it ends: nothing stale to clean up; NFS
clients map it onto the server's byte-range locks). A second job finds it held and
stops, every rank with it, in one line naming the holder (the pid, host and start
time the holder wrote into the file). A file system without locks is run unlocked,
as before. A lock an NFS server keeps for a machine that died goes with the file:
the message says to delete it (a new file is a new lock).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO, Self

from data.errors import UserError
from dlrm.parallel.distributed import DistInfo, broadcast_object

LOCK_FILE = ".lock"


class RunInUse(UserError):
    """Another job holds the run directory."""


class RunLock:
    """Rank 0's hold on ``RUN/.lock`` (see the module docstring); :meth:`release` or
    the process's end frees it."""

    def __init__(self, run_dir: Path, info: DistInfo) -> None:
        self._file: IO[str] | None = None
        refusal = self._take(Path(run_dir)) if info.is_main else None
        refusal = broadcast_object(refusal, info)  # every rank stops with rank 0
        if refusal:
            raise RunInUse(refusal)

    def _take(self, run_dir: Path) -> str | None:
        path = run_dir / LOCK_FILE
        fh = open(path, "a+")  # noqa: SIM115 - held for the whole run
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # no locks here: as before
                fh.close()
                return None
            fh.seek(0)
            holder = _holder(fh.read())
            fh.close()
            return (f"the run directory {run_dir} is in use by another training job ({holder}); "
                    f"wait for it to end, or train into another --out (if that job is gone with "
                    f"its machine, delete {path})")
        who = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                          "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}) + "\n"
        try:  # only for a second job's message: a full disk does not stop this one here
            os.ftruncate(fh.fileno(), 0)
            os.pwrite(fh.fileno(), who.encode(), 0)
        except OSError:
            pass
        self._file = fh
        return None

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor drops the lock
            self._file = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder(text: str) -> str:
    try:
        who = json.loads(text)
        return f"pid {who['pid']} on {who['host']}, started {who['started']}"
    except (ValueError, KeyError, TypeError):
        return "its owner did not say who it is"
