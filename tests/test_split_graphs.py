"""hotline.graph_split (dlrm/train/split_graphs.py): Hotline's split replayed.

CUDA graphs need a GPU (tests/test_gpu.py trains Hotline with them against eager
splits). Here a stand-in graph, whose replay reruns the split eagerly into the captured
split's buffers, checks everything around the capture, in the trainer's Hotline step
(``HotlineSteps``) splitting each next mini-batch a step ahead: the passes handed out
equal those of eager splits, bit for bit (reference: a ``HotlineSteps`` without
graphs); two graphs are needed (with one, the split made ahead overwrites the one in
use, and the test sees it); a refresh captures again; a batch of another shape splits
eager. hotline.graph_split's modes: auto and on graph where they can, off never, and
only on says why not where they cannot.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from data.batch import Batch
from data.jagged import JaggedFeatures
from dlrm.train.split_graphs import GraphedSplits, why_not
from embeddings.hotline.split import split_tensors
from tests.graph_stand_in import StandInGraph, stand_in_capture
from tests.test_hotline import FEATURES
from tests.test_hotline_ahead import _assert_same_parts, _setup, _steps

BATCH = 16


def single_hot(coll, seed: int, batch: int = BATCH) -> Batch:
    """A single-hot mini-batch (every batch the same shape: the graphs' case)."""
    g = torch.Generator().manual_seed(seed)
    rows = {f: t.rows for t in coll.tables for f in t.features}
    values = torch.cat([torch.randint(0, rows[f], (batch,), generator=g) for f in FEATURES])
    sparse = JaggedFeatures(list(FEATURES), values, torch.ones(len(FEATURES) * batch, dtype=torch.int64), batch)
    return Batch(torch.randn(batch, 3, generator=g), sparse, torch.rand(batch, generator=g))


def graphed_steps(coll):
    steps = _steps(coll)
    steps.split_graphs = GraphedSplits(coll, graph=StandInGraph, capture=stand_in_capture)
    return steps


def compare_ahead(steps, reference, batches: list[Batch]) -> None:
    """Each batch's passes, the next batch split a step ahead (as the trainer runs them),
    against the reference's, compared before the next step (which may reuse buffers)."""
    for i, batch in enumerate(batches):
        upcoming = batches[i + 1] if i + 1 < len(batches) else None
        got = list(steps.micro_batches(batch, upcoming))
        _assert_same_parts(got, list(reference.micro_batches(batch, upcoming)), f"batch {i}")
        for s in (steps, reference):
            s.after_step(i + 1)


@pytest.mark.parametrize("mixed", [False, True])
def test_replayed_splits_give_the_eager_passes(mixed: bool) -> None:
    """One dtype, and several (a collection per dtype group, split jointly: each group's
    lookups cut out at its features' runs, which the host batch gives)."""
    coll, _, _ = _setup(mixed)
    batches = [single_hot(coll, s) for s in range(5)]
    steps, reference = graphed_steps(coll), _steps(coll)
    compare_ahead(steps, reference, batches)
    assert steps.split_graphs.captures == 1 and steps.split_graphs.replays == 5
    assert steps.stats(whole_run=True)["split_graphed"] == 1.0
    steps.close()
    reference.close()


def test_one_graph_is_not_enough(monkeypatch) -> None:
    """With one slot, the split made a step ahead writes over the one in use: the passes
    differ from eager ones (what the second slot is for)."""
    monkeypatch.setattr(GraphedSplits, "SLOTS", 1)
    coll, _, _ = _setup(False)
    batches = [single_hot(coll, s) for s in range(3)]
    with pytest.raises(AssertionError):
        compare_ahead(graphed_steps(coll), _steps(coll), batches)


def test_a_refresh_captures_again_and_another_shape_splits_eager() -> None:
    coll, _, second = _setup(False)
    steps, reference = graphed_steps(coll), _steps(coll)
    compare_ahead(steps, reference, [single_hot(coll, s) for s in range(2)])
    coll.refresh(second)  # new hot ids: the graphs read the old ones
    compare_ahead(steps, reference, [single_hot(coll, 7)])
    assert steps.split_graphs.captures == 2
    replays = steps.split_graphs.replays
    compare_ahead(steps, reference, [single_hot(coll, 8, batch=BATCH // 2)])  # another shape: eager
    assert steps.split_graphs.replays == replays and steps.split_graphs.captures == 2
    steps.close()
    reference.close()


class AddressGraph(StandInGraph):
    """A stand-in that reads the hot ids as a CUDA graph does, by address: its replay
    splits against the hot-ids tensor its capture read (``address_capture``), whatever
    the tier holds by then. A refresh that made new tensors, left uncaptured, splits
    against the old ids here, as it would on a GPU."""

    read: dict

    def replay(self) -> None:
        hot = self.coll.hot
        held, hot._ids_on = hot._ids_on, dict(self.read)
        try:
            super().replay()
        finally:
            hot._ids_on = held


def address_graphed_steps(coll):
    def graph() -> AddressGraph:
        made = AddressGraph()
        made.coll = coll
        return made

    @contextlib.contextmanager
    def address_capture(graph: AddressGraph):
        yield
        graph.read = dict(coll.hot._ids_on)  # the hot ids the captured split read

    steps = _steps(coll)
    steps.split_graphs = GraphedSplits(coll, graph=graph, capture=address_capture)
    return steps


def same_size_hot_set(coll) -> dict[str, torch.Tensor]:
    """Another hot set of as many rows per table as the one held: each table's last rows."""
    held = coll.hot_rows()
    return {t.name: torch.arange(t.rows - held[t.name].numel(), t.rows) for t in coll.tables}


def test_a_refresh_that_keeps_the_hot_tensors_replays_on_and_one_that_does_not_captures() -> None:
    """A refresh of as many hot rows copies them into the tensors held: the graphs,
    reading by address, replay on without a capture (each capture synchronizes and
    empties the memory caches) and split by the new hot set, as eager splits do. A
    refresh to another number of rows makes new tensors: captured again. Both by
    replays that read the ids the capture read (``AddressGraph``)."""
    from tests.test_hotline import profile_of

    coll, _, other_size = _setup(False)
    steps, reference = address_graphed_steps(coll), _steps(coll)
    compare_ahead(steps, reference, [single_hot(coll, s) for s in range(2)])
    before = coll.hot_rows()
    coll.refresh(profile_of(coll.tables, same_size_hot_set(coll)))
    assert any(not torch.equal(before[n], ids) for n, ids in coll.hot_rows().items())
    compare_ahead(steps, reference, [single_hot(coll, s) for s in range(10, 13)])
    assert steps.split_graphs.captures == 1 and steps.split_graphs.replays == 5
    coll.refresh(other_size)
    compare_ahead(steps, reference, [single_hot(coll, s) for s in range(20, 22)])
    assert steps.split_graphs.captures == 2 and steps.split_graphs.replays == 7
    steps.close()
    reference.close()


def test_a_short_first_batch_is_not_the_captured_shape() -> None:
    """The run's first mini-batch short (rows dropped by data.on_error=skip): it splits
    eager and the capture waits for the next full one; captured on the short one,
    every full batch after it would split eager."""
    coll, _, _ = _setup(False)
    steps, reference = _steps(coll), _steps(coll)
    steps.split_graphs = GraphedSplits(coll, graph=StandInGraph, capture=stand_in_capture, batch=BATCH)
    batches = [single_hot(coll, 0, batch=BATCH - 1)] + [single_hot(coll, s) for s in range(1, 4)]
    compare_ahead(steps, reference, batches)
    assert steps.split_graphs.captures == 1 and steps.split_graphs.replays == 3
    steps.close()
    reference.close()


def test_several_dtypes_replay_only_for_the_captured_runs() -> None:
    """Several dtypes: the capture cut each group's lookups at the captured batch's runs
    (ids per feature); a batch with as many ids but other runs splits eager (a replay
    would cut it in the wrong places), one with the same runs replays."""
    coll, _, _ = _setup(True)
    steps, reference = graphed_steps(coll), _steps(coll)
    first = single_hot(coll, 0)
    # as many ids, other runs: feature 0's last bag empty, feature 1's first bag two ids
    g = torch.Generator().manual_seed(1)
    rows = {f: t.rows for t in coll.tables for f in t.features}
    lengths = torch.ones(len(FEATURES) * BATCH, dtype=torch.int64)
    lengths[BATCH - 1], lengths[BATCH] = 0, 2
    runs = lengths.view(len(FEATURES), BATCH).sum(dim=1).tolist()
    values = torch.cat([torch.randint(0, rows[f], (n,), generator=g) for f, n in zip(FEATURES, runs)])
    shifted = Batch(torch.randn(BATCH, 3, generator=g), JaggedFeatures(list(FEATURES), values, lengths, BATCH),
                    torch.rand(BATCH, generator=g))
    compare_ahead(steps, reference, [first, shifted, single_hot(coll, 2)])
    assert steps.split_graphs.captures == 1 and steps.split_graphs.replays == 2
    steps.close()
    reference.close()


def test_where_graphs_cannot_split() -> None:
    from dlrm.config import load_config
    from tests.conftest import TINY

    cuda = torch.device("cuda")
    assert why_not(load_config(TINY), torch.device("cpu"), 1) == "no CUDA device"
    assert why_not(load_config(TINY), cuda, 1) is None
    assert why_not(load_config(TINY, ["embeddings.dtypes.C1=bf16"]), cuda, 1) is None  # split jointly, replayed
    assert why_not(load_config(TINY, ["train.accumulate=2"]), cuda, 1).startswith("train.accumulate")


@pytest.mark.parametrize("mode,graphed", [("auto", True), ("on", True), ("off", False)])
def test_graph_split_modes_where_graphs_can_run(monkeypatch, mode: str, graphed: bool) -> None:
    """Where the splits can be graphed (why_not None, as on one GPU; stand-in graphs
    here): auto and on graph them, off does not; none of the three says anything."""
    from types import SimpleNamespace

    from dlrm.config import load_config
    from dlrm.train import hotline
    from tests.conftest import TINY

    monkeypatch.setattr(hotline, "split_graphs_why_not", lambda *a: None)
    monkeypatch.setattr(hotline, "GraphedSplits",
                        lambda emb, **kw: GraphedSplits(emb, graph=StandInGraph, capture=stand_in_capture, **kw))
    coll, _, _ = _setup(False)
    lines: list[str] = []
    steps = hotline.HotlineSteps(SimpleNamespace(embeddings=coll),
                                 load_config(TINY, ["hotline.budget=1KB", f"hotline.graph_split={mode}",
                                                    f"data.batch_size={BATCH}"]),
                                 say=lines.append)
    assert (steps.split_graphs is not None, lines) == (graphed, [])
    if graphed:  # and they do split
        compare_ahead(steps, _steps(coll), [single_hot(coll, s) for s in range(2)])
        assert steps.split_graphs.replays == 2
    steps.close()


def test_graph_split_on_says_why_not_where_auto_is_silent(monkeypatch) -> None:
    """Where they cannot be graphed: eager under every mode; only on says why."""
    from types import SimpleNamespace

    from dlrm.config import load_config
    from dlrm.train import hotline
    from tests.conftest import TINY

    monkeypatch.setattr(hotline, "split_graphs_why_not", lambda *a: "more than one process")
    coll, _, _ = _setup(False)
    said = "warning: hotline.graph_split=on: splits run eager: more than one process"
    for mode, want in [("auto", []), ("off", []), ("on", [said])]:
        lines: list[str] = []
        steps = hotline.HotlineSteps(SimpleNamespace(embeddings=coll),
                                     load_config(TINY, ["hotline.budget=1KB", f"hotline.graph_split={mode}"]),
                                     say=lines.append)
        assert steps.split_graphs is None and lines == want, mode
        steps.close()


def test_a_slots_tensors_are_recorded_once_a_stream(monkeypatch) -> None:
    """``record_reads``: a slot's buffers live as long as it does, and the allocator
    keeps the streams recorded on a block until it is freed; so once per slot and
    stream, every storage of its split once, and again for another stream or slot.
    Streams are torch's (a fresh object each time, equal by value): ``None != stream``
    is False for them (torch's Stream compares to None as unequal under no operator),
    so a first record was never made until 2026-12-07's review."""
    coll, _, _ = _setup(False)
    graphs = GraphedSplits(coll, graph=StandInGraph, capture=stand_in_capture)
    batch = single_hot(coll, 0)
    slot = graphs.split(batch.sparse, batch.sparse)[1]
    recorded = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: recorded.append((self, stream)))
    storages = {t.untyped_storage().data_ptr() for t in split_tensors(slot.split) if t.numel()}
    def compute() -> torch.Stream:
        return torch.Stream("cpu")

    another = torch.Stream(stream_id=1, device_index=0, device_type=0)
    GraphedSplits.record_reads(slot, compute())
    assert {t.untyped_storage().data_ptr() for t, _ in recorded} == storages and len(recorded) == len(storages)
    GraphedSplits.record_reads(slot, compute())
    assert len(recorded) == len(storages)
    GraphedSplits.record_reads(slot, another)
    assert len(recorded) == 2 * len(storages) and recorded[-1][1] == another
    other = graphs.split(batch.sparse, batch.sparse)[1]
    assert other is not slot
    GraphedSplits.record_reads(other, compute())
    assert len(recorded) == 3 * len(storages)
