"""dlrm/train/thread_census.py: each thread's CPU and context switches over a window,
against what the threads themselves measured (``time.thread_time``, their own sleeps),
and train.profile_mode=threads writing it for a run's profiled steps."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from dlrm.train import thread_census
from tests.test_train import run_train

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")


def _rows(text: str) -> dict[str, list[float]]:
    """The table's rows by thread name: threads, CPU ms/step, of a core (%), voluntary,
    involuntary a step."""
    out = {}
    for line in text.splitlines()[2:]:
        name, numbers = line[:40].strip(), line[40:].split()
        out[name] = [float(numbers[0]), float(numbers[1]), float(numbers[2].rstrip("%")),
                     float(numbers[3]), float(numbers[4])]
    return out


def test_a_threads_cpu_and_waits_are_its_own_and_a_pools_are_grouped() -> None:
    """Two threads of a pool (``burn_0``, ``burn_1``: grouped as ``burn``) each spin a
    measured CPU time; one more (``napper``) sleeps 30 times. The census of the window
    gives the pool their CPU summed, to the scheduler's accuracy, and the napper at
    least its 30 waits; per step, over 10 steps."""
    go, done, leave = threading.Event(), threading.Barrier(4), threading.Event()
    spun = {}

    def burn(name: str) -> None:
        go.wait()
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.15:
            pass
        spun[name] = time.thread_time() - t0
        done.wait()
        leave.wait()  # alive until sampled

    def nap() -> None:
        go.wait()
        for _ in range(30):
            time.sleep(0.001)
        done.wait()
        leave.wait()

    threads = [threading.Thread(target=burn, args=(f"burn_{i}",), name=f"burn_{i}") for i in range(2)]
    threads.append(threading.Thread(target=nap, name="napper"))
    for t in threads:
        t.start()
    before, t0 = thread_census.sample(), time.perf_counter()
    go.set()
    done.wait()
    after, wall = thread_census.sample(), time.perf_counter() - t0
    leave.set()
    for t in threads:
        t.join()
    text = thread_census.table(before, after, 10, wall)
    rows = _rows(text)
    burn_row, nap_row = rows["burn"], rows["napper"]
    assert burn_row[0] == 2
    assert burn_row[1] == pytest.approx(1000 * sum(spun.values()) / 10, abs=3.0)  # ms a step
    assert nap_row[0] == 1 and nap_row[3] >= 3.0  # 30 sleeps over 10 steps
    assert nap_row[1] < burn_row[1] / 4
    assert text.startswith("threads over 10 steps")
    assert "MainThread (the step loop)" in rows  # the sampling thread, named the step loop
    names = list(rows)
    assert names.index("burn") < names.index("napper")  # busiest first


def test_a_thread_id_reused_by_another_thread_counts_from_zero() -> None:
    """A kernel thread id whose name changed between the samples is another thread: its
    counts are not differences with the first one's."""
    before = {7: thread_census.ThreadSample("old", 5.0, 100, 10)}
    after = {7: thread_census.ThreadSample("new", 0.02, 3, 1)}
    rows = _rows(thread_census.table(before, after, 1, 1.0))
    assert rows["new"] == [1, 20.0, 2.0, 3.0, 1.0]
    assert thread_census.table(before, {}, 1, 1.0) == ""


def test_profile_mode_threads_writes_the_census_of_the_profiled_steps(tiny_data, tmp_path: Path) -> None:
    """train.profile_mode=threads: the Hotline run's profiled steps' census, its step
    loop, gather and host-update threads named, and no other report; the python
    mode's report starts with the same census."""
    run = tmp_path / "threads"
    run_train(tiny_data, run, **{"train.max_steps": 8, "train.profile_start": 3, "train.profile_steps": 4,
                                 "train.profile_mode": "threads", "data.eval": "",
                                 "embeddings.placement": "hotline", "hotline.budget": "64KB"})
    text = (run / "profile" / "rank-0-threads.txt").read_text()
    assert text.startswith("steps 3..6, rank 0, unprofiled")
    rows = _rows(text.split("\n", 2)[2])
    assert {"MainThread (the step loop)", "hotline-gather", "hotline-host-update"} <= set(rows)
    assert rows["MainThread (the step loop)"][1] > 0
    assert sorted(p.name for p in (run / "profile").iterdir()) == ["rank-0-threads.txt"]
    python = tmp_path / "python"
    run_train(tiny_data, python, **{"train.max_steps": 6, "train.profile_start": 3, "train.profile_steps": 2,
                                    "train.profile_mode": "python", "data.eval": ""})
    lines = (python / "profile" / "rank-0-python.txt").read_text().splitlines()
    assert lines[2].startswith("threads over 2 steps")
    assert "MainThread (the step loop)" in _rows("\n".join(lines[2:lines.index("")]))
