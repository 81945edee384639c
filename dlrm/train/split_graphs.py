"""``hotline.graph_split``: Hotline's on-device split captured as CUDA graphs and replayed.

The split (embeddings/hotline/split.py; one pass per mini-batch: hot lookups, then
cold ones, not by popularity) sizes every output by its input's size (no
boolean-mask indexing, no nonzero, no unique), so for mini-batches of one shape (B
samples, N ids in the collection's feature order: single-hot data always) it is the
same ops every step: about 40 that the main thread dispatches. Captured, it is two
copies and one replay on the split stream:

    mini-batch t    ids, lengths ──copy──► graph (t % 2)'s static inputs ──replay──►
                    its DeviceSplit (static output buffers, header included)

Two graphs, used in turn: mini-batch t+1 is split (a step ahead, dlrm/train/hotline.py)
while the compute stream still reads mini-batch t's split, so each holds its own
buffers. Before a graph replays into its buffers again, the split stream waits for the
event the trainer recorded after the step that last read them (``consumed``: after
the step's update).

A refresh changes the hot ids the graphs read. One that keeps their number (a full
budget: every refresh after the first few) copies them into the tensor held
(hot_tier.py ``load``), which the graphs read by address: they replay on, as the
captured step does (``static_version``). One that makes new tensors has them captured
again at the next split. A capture is costly beyond itself: torch's capture context
synchronizes, collects garbage and empties the device's and the pinned host memory's
caches, so the pinned buffers of the steps after it are allocated anew (the
2026-11-28 H200's refresh row, under cProfile: 37 ms of the two captures a refresh,
beside a 37 ms swap). A batch of another shape or key order
splits eager. Tables of several dtypes (a collection per dtype group, mixed.py) split
jointly, each group's lookups cut out of the batch at its features' runs, which the
host's copy of the batch gives: the capture cuts at the captured batch's runs, so a
replay also needs the same ids per feature (single-hot data always). The capture is ``thread_local``
(Hotline's other threads call CUDA meanwhile) after one eager run of the split (lazily
made state, such as a sort's workspace, exists before it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from data.jagged import JaggedFeatures
from data.pinned import capturing, record_once
from embeddings.hotline.mixed import MixedHotlineCollection
from embeddings.hotline.split import DeviceSplit, JointSplit, split_tensors


def why_not(cfg: Any, device: torch.device, world_size: int) -> str | None:
    """Why this run's splits cannot be graphed (None: they can, batch by batch)."""
    reasons = [
        (device.type != "cuda", "no CUDA device"),
        (world_size > 1, "more than one process"),
        (cfg.train.accumulate != 1, "train.accumulate > 1 (more splits alive than graphs)"),
    ]
    return next((why for broken, why in reasons if broken), None)


@dataclass
class _Slot:
    """One captured graph: its static inputs, the split it writes, the event after the
    step that last read that split (None: never handed out)."""

    graph: Any
    values: torch.Tensor
    lengths: torch.Tensor
    split: DeviceSplit | JointSplit
    runs: tuple[int, ...] | None = None  # ids per feature it was cut at (several dtypes)
    consumed: torch.cuda.Event | None = None
    recorded: Any = None  # the stream its split's tensors were record_stream-ed on


class GraphedSplits:
    """The collection's split by replays (see the module docstring). ``graph`` and
    ``capture``: the graph type and its capture context (a test's stand-ins)."""

    SLOTS = 2

    def __init__(self, emb: Any, graph: Callable[[], Any] | None = None,
                 capture: Callable[[Any], Any] | None = None, batch: int | None = None) -> None:
        """``batch``: the run's batch size; a (re)capture waits for a batch that has it
        (not an epoch's short last one, nor one data.on_error=skip dropped rows from),
        else every full batch after it would split eager. None: any batch."""
        self.emb, self.batch = emb, batch
        self.graph_type = graph or torch.cuda.CUDAGraph
        self.capture = capture or _cuda_capture
        self.slots: list[_Slot] = []
        self.version: object = None
        self.turn = 0
        self.replays = self.captures = 0
        self.failed: str | None = None

    def split(self, sparse: JaggedFeatures, host: JaggedFeatures | None = None
              ) -> tuple[DeviceSplit | JointSplit, _Slot] | None:
        """``sparse``'s split by a replay on the current stream (the split stream), with
        the slot it was written in (``handed``); None where it must run eager. ``host``:
        the same batch in host memory (several dtypes: its runs per feature, without it
        they split eager)."""
        if self.failed is not None or sparse.keys() != list(self.emb.features):
            return None
        runs = self._runs(host)
        if isinstance(self.emb, MixedHotlineCollection) and runs is None:
            return None
        if self.version != self.emb.static_version:  # first split, or new hot-tier tensors: (re)capture
            if self.batch is not None and sparse.stride() != self.batch:
                return None  # captured at the next full batch
            self._capture(sparse, host, runs)
            if self.failed is not None:
                return None
        slot = self.slots[self.turn]
        if not self._fits(slot, sparse) or slot.runs != runs:
            return None
        self.turn = (self.turn + 1) % self.SLOTS
        if slot.consumed is not None:  # the step that read its buffers last is done with them
            torch.cuda.current_stream().wait_event(slot.consumed)
        slot.values.copy_(sparse.values(), non_blocking=True)
        slot.lengths.copy_(sparse.lengths(), non_blocking=True)
        slot.graph.replay()
        slot.split.reset()
        self.replays += 1
        return slot.split, slot

    @staticmethod
    def handed(slot: _Slot, event: torch.cuda.Event) -> None:
        """The step that read ``slot``'s split is queued up to ``event`` (recorded on the
        compute stream after its update): the slot's next replay waits for it."""
        slot.consumed = event

    @staticmethod
    def record_reads(slot: _Slot, stream: torch.cuda.Stream) -> None:
        """``slot``'s split tensors kept from reuse until ``stream``'s work on them is
        done (``record_stream``). Once per slot and stream: the caching allocator keeps
        a block's streams as a set until the block is freed, and inserts its events
        then, so a second record of the same stream adds nothing (a slot's tensors are
        freed only with it, at a recapture)."""
        if slot.recorded is None or slot.recorded != stream:  # None != a torch Stream is False
            record_once(split_tensors(slot.split), stream)
            slot.recorded = stream

    def _fits(self, slot: _Slot, sparse: JaggedFeatures) -> bool:
        batch = slot.split.parts[0] if isinstance(slot.split, JointSplit) else slot.split
        return (sparse.stride() == batch.lookups.batch and sparse.values().numel() == slot.values.numel()
                and sparse.lengths().numel() == slot.lengths.numel())

    def _runs(self, host: JaggedFeatures | None) -> tuple[int, ...] | None:
        """Ids per feature of the host batch where the split cuts there (several dtypes),
        else None (one dtype: its split reads the whole values)."""
        if host is None or not isinstance(self.emb, MixedHotlineCollection):
            return None
        return tuple(host.length_per_key())

    def _capture(self, sparse: JaggedFeatures, host: JaggedFeatures | None = None,
                 runs: tuple[int, ...] | None = None) -> None:
        """Both slots captured for ``sparse``'s shape (and ``runs``) against the current
        hot ids; a failure is kept (``failed``) and every later split runs eager."""
        try:
            self.slots = [self._capture_one(sparse, host, runs) for _ in range(self.SLOTS)]
            self.version, self.turn = self.emb.static_version, 0
            self.captures += 1
        except Exception as e:  # noqa: BLE001 - any capture error: the eager split still works
            self.slots, self.failed = [], f"{type(e).__name__}: {e}"

    def _capture_one(self, sparse: JaggedFeatures, host: JaggedFeatures | None,
                     runs: tuple[int, ...] | None) -> _Slot:
        values, lengths = sparse.values().clone(), sparse.lengths().clone()
        static = JaggedFeatures(list(sparse.keys()), values, lengths, sparse.stride())
        split_on_device = partial(self.emb.split_on_device, by_popularity=False, host=host)
        split_on_device(static)  # warm-up: lazily made state
        graph = self.graph_type()
        with self.capture(graph):
            split = split_on_device(static)
        if hasattr(graph, "body"):  # a test's stand-in graph: its replay reruns the split
            graph.body = lambda: _rerun(split_on_device, static, split)
        return _Slot(graph, values, lengths, split, runs)


def _rerun(split_on_device: Callable[[JaggedFeatures], Any], static: JaggedFeatures,
           split: DeviceSplit | JointSplit) -> None:
    """What a replay computes, eagerly: the split of the static inputs written into the
    captured split's buffers (a test's stand-in graph calls this; CUDA ignores it)."""
    fresh = split_on_device(static)
    for out, value in zip(split_tensors(split), split_tensors(fresh), strict=True):
        out.copy_(value)


@contextlib.contextmanager
def _cuda_capture(graph: torch.cuda.CUDAGraph) -> Iterator[None]:
    with capturing(), torch.cuda.graph(graph, capture_error_mode="thread_local"):  # data/pinned.py
        yield
