"""One batch's lookups split into hot and cold, and what the host tier sends for them.

    lookups (stacked ids, feature-major)   [ h c h | h h | c ]      bags f*B + b
    is_hot  [N]                            [ 1 0 1 | 1 1 | 0 ]
    slot    [N]  place in the hot tier where hot (meaningless elsewhere)

``split.py`` cuts them into micro-batches, hot and cold lookups apart.

The cold part comes from the host tier: ``ColdRows`` (one process: the unique cold
rows, copied to the device) or ``ColdPooled`` (several ranks: the cold part of
every bag, looked up by the sharded host tier).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

HOT_ONLY = "hot-only"  # ``cold`` of a popular micro-batch: no cold lookup at all (no collective)


class ColdInFlight:
    """Cold rows still being gathered on another thread (``future``): the collection
    looks up the hot rows first and takes these only when it needs them (``result``,
    a wait for the thread, timed in ``waited``). ``pick``: one dtype group's share
    (``GroupCold.parts[pick]``), waited for through its parent (``part``)."""

    def __init__(self, future: Future[Any], pick: int | None = None,
                 parent: ColdInFlight | None = None) -> None:
        self.future = future
        self.pick = pick
        self.parent = parent
        self.waited = 0.0  # seconds ``result`` waited (a part's wait counts in its parent's)

    def result(self) -> Any:
        """The gathered cold rows (``ColdRows``, ``ColdPooled``, a group's share of a
        ``GroupCold``), after the gather thread ends; its error raises here."""
        t0 = time.perf_counter()
        value = self.future.result()
        root = self if self.parent is None else self.parent
        root.waited += time.perf_counter() - t0
        return value if self.pick is None else value.parts[self.pick]

    def part(self, pick: int) -> ColdInFlight:
        """Dtype group ``pick``'s cold rows, from the same gather."""
        return ColdInFlight(self.future, pick, self)


@dataclass
class Lookups:
    """A batch's lookups in the collection's feature order.

    ids [N] stacked ids; values [N] the same, table-local; lengths [F*B]; is_hot
    [N] bool; slot [N] hot-tier slot (meaningless where not hot); bag [N] each
    lookup's bag f*B + b (None: not made yet; the split makes it).
    """

    ids: torch.Tensor
    values: torch.Tensor
    lengths: torch.Tensor
    batch: int
    num_features: int
    is_hot: torch.Tensor
    slot: torch.Tensor
    bag: torch.Tensor | None = None

    def check_hot_only(self) -> None:
        """For a popular micro-batch: it must have no cold lookup (a pipeline bug,
        not bad input). An asynchronous assert: on CUDA it fails in the device's own
        time, with no ``int()`` that would make the step wait for it."""
        torch._assert_async(self.is_hot.all(), "Hotline: a popular micro-batch has cold lookups")


@dataclass
class ColdRows:
    """Copies of the cold rows one batch needs, on the device.

    ids [U] stacked ids (host stack numbering), unique ascending, on the device;
    rows [U, D] on the device, a leaf that requires grad (its KV gradient goes home);
    host_ids [U] the same ids on the host (where the gradient rows go back to).
    """

    ids: torch.Tensor
    rows: torch.Tensor
    host_ids: torch.Tensor
    gather_s: float = 0.0  # host time to gather the rows
    transfer_s: float = 0.0  # time to issue the copy to the device (CUDA: asynchronous)
    ready: torch.cuda.Event | None = None  # CUDA: recorded on the copy stream after the copy
    late_rows: int = 0  # rows read again after the previous step's host update ended
    update_wait_s: float = 0.0  # time the gather waited for host updates
    # of gather_s, the wait for the cold ids' D2H copy (queued a step ahead, after the
    # split stream classified them: the device's work, not the gather's)
    ids_wait_s: float = 0.0
    # staged for the device's update (cold_stage.py): the rows' optimizer state [U] or [U, D]
    state: dict[str, torch.Tensor] | None = None
    # rows read while the last static step's write-back ran (positions in ``host_ids``,
    # that write-back): that step's patch replaces them, any other use reads them again
    stale: tuple[torch.Tensor, Future[None]] | None = None


@dataclass
class ColdPooled:
    """Several ranks: the cold part of every bag, summed, [B, F*D] on the device,
    looked up by the sharded host tier (with autograd back to its shards)."""

    pooled: torch.Tensor
    gather_s: float = 0.0  # ids all-to-all, owners' host lookups, pooled all-to-all
    transfer_s: float = 0.0
