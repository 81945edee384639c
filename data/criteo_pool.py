"""The Criteo converter's jobs on several processes: ``run_all(jobs, workers)``.

The converter's two heavy passes split into independent jobs: parsing one input
file (Criteo 1TB: one per day, 24) and writing one output part (rows [lo, hi) of the
staged files, mapped). One process parses about 300k rows/s here, so Criteo 1TB's
4.4B rows took about 4 hours to parse and 1.7 more to write; N processes divide both.

Jobs run on spawned processes (no fork of a parent holding big arrays) and return
in job order. The first job that raises stops the others at once (a bad line in
day 23 is reported when it is found, not after the other days finish) and is raised
here as it was raised there (``DataError`` pickles whole); a process that dies (the
kernel's OOM killer) is one line too, not a hang. With ``workers <= 1`` the jobs run
in this process, one after the other.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections.abc import Callable, Sequence
from typing import Any

from data.errors import UserError

Job = tuple[Callable[..., Any], tuple[Any, ...]]


def run_all(jobs: Sequence[Job], workers: int) -> list[Any]:
    """Each job's result, in job order (see the module docstring)."""
    if workers <= 1 or len(jobs) <= 1:
        return [fn(*args) for fn, args in jobs]
    failed = threading.Event()
    errors: list[BaseException] = []

    def stop(error: BaseException) -> None:
        errors.append(error)
        failed.set()

    pool = mp.get_context("spawn").Pool(min(workers, len(jobs)))
    started = {p.pid for p in mp.active_children()}  # the pool's processes
    try:
        pending = [pool.apply_async(fn, args, error_callback=stop) for fn, args in jobs]
        for result in pending:
            while not result.ready() and not failed.is_set():
                failed.wait(0.1)
                # A killed process's job never returns (the pool starts another process
                # and waits on): without this a converter OOM-killed hung for ever.
                if not started <= {p.pid for p in mp.active_children()}:
                    raise UserError("a converter process died (killed, perhaps for memory: "
                                    "try fewer --workers)")
            if failed.is_set():
                raise errors[0]
        out = [result.get() for result in pending]
    except BaseException:
        pool.terminate()  # the jobs still running are of no use now
        raise
    finally:
        pool.close()
        pool.join()
    return out
