"""Where a step's time goes, by named section (off unless a run asks for it).

    with section("lookup"):        # no-op unless TIMER.enabled
        ...
    TIMER.totals["lookup"]         # seconds accumulated since TIMER.reset()

Sections measured inside the embedding code: input_alltoall, lookup,
output_alltoall, embedding_update. The trainer adds data_wait, mlp (forward +
backward minus the embedding sections inside them) and dense_update.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator


class SectionTimer:
    def __init__(self) -> None:
        self.enabled = False
        self.totals: dict[str, float] = defaultdict(float)

    def reset(self) -> None:
        self.totals = defaultdict(float)

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] += time.perf_counter() - start

    def section(self, name: str) -> contextlib.AbstractContextManager:
        return self._timed(name) if self.enabled else _NULL


_NULL = contextlib.nullcontext()
TIMER = SectionTimer()
EMBEDDING_SECTIONS = ("input_alltoall", "lookup", "output_alltoall", "embedding_update")


def section(name: str) -> contextlib.AbstractContextManager:
    return TIMER.section(name)
