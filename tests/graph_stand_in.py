"""A stand-in for torch.cuda.CUDAGraph on the CPU (tests of dlrm/train/dense_graphs.py
and split_graphs.py): ``replay`` runs ``body``, an eager function doing what the
captured graph would, set by the test or by the code that captured it; replays are
counted. ``stand_in_capture`` is its capture context (it records nothing)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


class StandInGraph:
    def __init__(self) -> None:
        self.body: Callable[[], None] | None = None
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        assert self.body is not None, "a stand-in graph replayed before its body was set"
        self.body()


@contextlib.contextmanager
def stand_in_capture(graph: StandInGraph) -> Iterator[None]:
    yield
