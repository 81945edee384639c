"""dlrm/train/graphs.py ReplayTimer without a GPU: CUDA's events replaced by fakes that
finish when the test says, so what is read when (no wait in a step, every replay
counted by the summary) is checked here; tests/test_gpu.py reads its figure on CUDA."""

from __future__ import annotations

import pytest
import torch

from dlrm.train.graphs import ReplayTimer


class FakeEvent:
    clock = 0.0  # "ms": each event recorded 0.75 after the last, so a replay takes 0.75
    finished = 0  # events recorded before this count have finished
    recorded = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at, self.index = None, None

    def record(self) -> None:
        FakeEvent.clock += 0.75
        self.at, self.index = FakeEvent.clock, FakeEvent.recorded
        FakeEvent.recorded += 1

    def query(self) -> bool:
        return self.index < FakeEvent.finished

    def synchronize(self) -> None:
        FakeEvent.finished = max(FakeEvent.finished, self.index + 1)  # a wait: it finishes

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "read before it finished"
        return end.at - self.at


class FakeGraph:
    replays = 0

    def replay(self) -> None:
        FakeGraph.replays += 1


def test_replays_are_timed_without_a_wait_in_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer, graph = ReplayTimer(enabled=True), FakeGraph()
    waits = []
    synchronize = FakeEvent.synchronize

    def counted(self: FakeEvent) -> None:
        waits.append(self.query())  # a wait for an event that had not finished: False
        synchronize(self)

    monkeypatch.setattr(FakeEvent, "synchronize", counted)
    for _ in range(100):  # the device runs 10 replays behind
        timer.replay(graph)
        FakeEvent.finished = max(0, FakeEvent.recorded - 20)
    assert FakeGraph.replays == 100
    assert all(waits), "a step waited for the device"
    assert 0 < timer.timed < 100 and len(timer.pending) < 100  # folded as they finished
    assert timer.summary() == ", 0.75 ms of GPU time a replay"
    assert timer.timed == 100 and not timer.pending
    assert ReplayTimer(enabled=True).summary() == ""  # nothing replayed: nothing said
    untimed = ReplayTimer(enabled=False)  # no CUDA (a CPU test's stand-in graph): replayed, not timed
    untimed.replay(graph)
    assert FakeGraph.replays == 101 and untimed.summary() == ""
