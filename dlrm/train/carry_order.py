"""A resume mid-epoch under another reading order ends that epoch in the old order.

Batch t of an epoch is a function of (files, seed, epoch, rank, W, batch_size, t) and
the shuffle settings (data/reader.py). A run resumed at step k of an epoch with another
world size, batch size, seed or shuffle read another stream from k on: some of the
epoch's rows trained twice and others never, silently (checkpoints reshard across
world sizes, so a preempted job resumed on other machines did this). Now a
checkpoint records the order its epoch is read in, and a resume whose order differs
reads the rest of that epoch in the old one: each of the W0 old ranks' streams goes to
new rank ``r * W1 // W0``, which concatenates its streams' batch t (a rank given none
yields empty batches). So global batch t is the old run's, summed over other ranks
(equal to the uninterrupted run within rounding, not bit for bit). The next epoch
reads in the run's own order.

    old W0=3, batch 6:  r0 [a a]  r1 [b b]  r2 [c c]    global batch t: a a b b c c
    new W1=2:           rank 0 = r0 + r1: [a a b b]    rank 1 = r2: [c c]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from data.batch import Batch
from data.merged import concat_batches
from dlrm.config import Config

ORDER_KEYS = ("world_size", "batch_size", "seed", "shuffle", "shuffle_buffer")


def _order(world_size: int, data: dict[str, Any], seed: int) -> dict[str, Any]:
    """The order of a run on ``world_size`` ranks with config section ``data``: one
    process with data.order_world_size=W reads a W-rank order."""
    order = int(data.get("order_world_size", 0))
    return {"world_size": order if order > 1 and world_size == 1 else world_size,
            "batch_size": data["batch_size"], "seed": seed, "shuffle": data["shuffle"],
            "shuffle_buffer": data["shuffle_buffer"]}


def reading_order(cfg: Config, world_size: int) -> dict[str, Any]:
    """What the training stream of ``cfg`` on ``world_size`` ranks is a function of
    (besides the files)."""
    return _order(world_size, dataclasses.asdict(cfg.data), cfg.seed)


def order_then(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The order a checkpoint's epoch was read in: recorded with its training files, or,
    for a checkpoint from before, its config's on its world size (None: unknown)."""
    recorded = (meta.get("train_data") or {}).get("order")
    if recorded is not None:
        return recorded
    config = meta.get("config")
    if not config or "world_size" not in meta:
        return None
    return _order(int(meta["world_size"]), config["data"], config["seed"])


def differences(then: dict[str, Any], now: dict[str, Any]) -> str:
    """``world size 2 then, 3 now; batch size 128 then, 256 now``: what changed."""
    return "; ".join(f"{key.replace('_', ' ')} {then[key]} then, {now[key]} now"
                     for key in ORDER_KEYS if then[key] != now[key])


class CarriedEpoch:
    """This rank's share of an old order's epoch: the old ranks' readers it was given
    (``readers``, possibly none) and one old reader that knows the epoch's shape."""

    def __init__(self, epoch: int, readers: list, shape: Any) -> None:
        self.epoch_number, self.readers, self.shape = epoch, readers, shape

    def steps_per_epoch(self) -> int:
        return self.shape.steps_per_epoch()

    def global_batch_size(self, step: int) -> int:
        return self.shape.global_batch_size(step)

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        """The old order's batches ``start_step ..`` of ``epoch``, this rank's streams together."""
        if not self.readers:
            empty = self.shape.empty_batch()
            return (empty for _ in range(start_step, self.steps_per_epoch()))
        streams = [r.epoch(epoch, start_step) for r in self.readers]
        return (concat_batches(list(group)) for group in zip(*streams, strict=True))


def carried_epoch(make: Any, then: dict[str, Any], epoch: int, rank: int, world_size: int) -> CarriedEpoch:
    """This rank's part of epoch ``epoch`` in order ``then``; ``make(rank, world_size,
    batch_size, seed, shuffle, shuffle_buffer)`` builds one old rank's reader."""
    old = int(then["world_size"])

    def reader(r: int) -> Any:
        return make(r, old, then["batch_size"], then["seed"], then["shuffle"], then["shuffle_buffer"])

    mine = [r for r in range(old) if r * world_size // old == rank]
    readers = [reader(r) for r in mine]
    return CarriedEpoch(epoch, readers, readers[0] if readers else reader(0))
