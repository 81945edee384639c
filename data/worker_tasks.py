"""One process per task, each result back through its own pipe; a process that dies
is one line and the others are killed.

The fit's workers ran in a ProcessPoolExecutor. When the OOM killer took one, Python
3.11's pool marked itself broken and then joined its other workers, which were
waiting on its call queue for work that would never come: the fit hung for ever
(seen in CI, `tests/test_fit_split.py`'s killed worker). Here nothing waits on a
shared queue: the parent watches each task's pipe and process, takes a result as it
arrives, and at the first process gone without one kills the rest and raises.

    parent ── Process(task 0) ── pipe 0 ──► ("done", result) | ("raised", traceback)
           ── Process(task 1) ── pipe 1 ──► ...
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from multiprocessing import connection
from typing import Any

from data.errors import UserError


def _run_one(target: Callable[..., object], args: tuple, out: connection.Connection) -> None:
    try:
        message: tuple = ("done", target(*args))
    except Exception:  # noqa: BLE001 - a bug in the task: its traceback, in the parent's error
        message = ("raised", traceback.format_exc())
    out.send(message)
    out.close()


def run_tasks(ctx: Any, target: Callable[..., object], tasks: Sequence[tuple], died: str,
              each_wait: Callable[[], None] | None = None, wait_s: float = 0.25) -> list[object]:
    """``target(*task)`` for each task, each in a process of ``ctx`` (a multiprocessing
    context; ``target`` importable by name), results in task order. A process gone
    without its result: ``UserError(died)``. A task that raised: RuntimeError with its
    traceback. ``each_wait`` runs every ``wait_s`` while results are awaited (a bar)."""
    processes, pipes = [], []
    try:
        for args in tasks:
            receive, send = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_run_one, args=(target, args, send), daemon=True)
            process.start()
            send.close()  # the child's end: EOF here once the child is gone
            processes.append(process)
            pipes.append(receive)
        return _collect(processes, pipes, died, each_wait, wait_s)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join()
        for pipe in pipes:
            pipe.close()


def _collect(processes: list, pipes: list, died: str, each_wait: Callable[[], None] | None,
             wait_s: float) -> list[object]:
    results: list[object] = [None] * len(processes)
    pending = set(range(len(processes)))
    while pending:
        connection.wait([pipes[k] for k in pending] + [processes[k].sentinel for k in pending], wait_s)
        for k in sorted(pending):
            if pipes[k].poll():  # a result (read before the process's end is looked at)
                try:
                    status, value = pipes[k].recv()
                except (EOFError, OSError):  # gone mid-send, or closed with nothing sent
                    raise UserError(died) from None
                if status == "raised":
                    raise RuntimeError(f"a worker process raised:\n{value}")
                results[k] = value
                pending.discard(k)
            elif not processes[k].is_alive():
                raise UserError(died)
        if each_wait is not None:
            each_wait()
    return results
