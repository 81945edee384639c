"""data/worker_tasks.py: tasks in processes of their own, results in task order; a
process that dies is one line at once and its siblings are killed (the fit hung for
ever in Python 3.11's ProcessPoolExecutor when the OOM killer took a worker); a task's
exception comes back with its traceback."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from data.errors import UserError
from data.worker_tasks import run_tasks

SPAWN = multiprocessing.get_context("spawn")


def square_after(x: int, seconds: float) -> int:
    time.sleep(seconds)
    return x * x


def die(seconds: float) -> None:
    time.sleep(seconds)
    os.kill(os.getpid(), signal.SIGKILL)


def fail(word: str) -> None:
    raise ValueError(f"bad {word}")


def test_results_come_back_in_task_order() -> None:
    waits: list[int] = []
    # the first task ends last: its result still comes first
    got = run_tasks(SPAWN, square_after, [(3, 1.0), (4, 0.0), (5, 0.2)], "died", lambda: waits.append(1))
    assert got == [9, 16, 25] and waits


@pytest.mark.parametrize("tasks", [
    [(die, (0.5,)), (square_after, (2, 120.0))],  # killed while its sibling works on
    [(die, (0.0,))],  # killed before it could send anything
])
def test_a_killed_process_is_one_line_at_once_and_its_siblings_are_killed(tasks) -> None:
    started = time.monotonic()
    with pytest.raises(UserError, match="^a worker died$"):
        run_tasks(SPAWN, call, [(f, args) for f, args in tasks], "a worker died")
    assert time.monotonic() - started < 60  # not the sibling's 120 s, nor for ever
    assert multiprocessing.active_children() == []


def call(f, args: tuple) -> object:
    return f(*args)


def test_a_task_that_raises_brings_its_traceback() -> None:
    with pytest.raises(RuntimeError, match=r"(?s)a worker process raised:.*ValueError: bad input"):
        run_tasks(SPAWN, fail, [("input",)], "died")
