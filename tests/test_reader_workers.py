"""data.workers: decode processes give exactly the batches of the one-thread reader.

The reference is the same reader at ``workers=0`` (itself held to pandas and to the
contract by tests/test_reader.py and tests/test_reader_fuzz.py): every tensor of every
batch must be equal, in the same order, and so must the records of dropped rows and
the errors. Workers are forked from a forkserver that has torch imported; its first
start is the slow part of this file.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from data.batch import Batch
from data.decode_workers import IN_FLIGHT, DecodeWorkerError, auto_workers
from data.errors import DataError, UserError
from data.reader import _HELD_BATCHES, ParquetReader
from data.rows import batch_specs
from data.schema import Schema
from data.shm_batch import FREE, SENT, slot_bytes, slots_that_fit
from tests.data_helpers import tiny_dataset, within
from tests.test_bad_data import SCHEMA, columns, smash_row_group, write


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Schema]:
    return tiny_dataset(tmp_path_factory.mktemp("tiny"))


def assert_same(a: list[Batch], b: list[Batch]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.sparse.keys() == y.sparse.keys() and x.sparse.stride() == y.sparse.stride()
        for s, t in [(x.dense, y.dense), (x.labels, y.labels),
                     (x.sparse.values(), y.sparse.values()),
                     (x.sparse.lengths(), y.sparse.lengths())]:
            assert s.dtype == t.dtype and torch.equal(s, t)


def batches(files: list[str], schema: Schema, workers: int, epoch: int = 1, start: int = 0,
            **kw: Any) -> list[Batch]:
    kw = {"shuffle": True, "seed": 7, "shuffle_buffer": 24, **kw}
    reader = ParquetReader(files, schema, 12, workers=workers, **kw)
    return within(120, lambda: list(reader.epoch(epoch, start_step=start)))


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_same_batches_as_one_thread(tiny, workers: int) -> None:
    files, schema = tiny
    for rank in range(2):  # rank 1 of 2 also yields empty batches at its end
        kw = {"rank": rank, "world_size": 2}
        assert_same(batches(files, schema, workers, **kw), batches(files, schema, 0, **kw))


@pytest.mark.parametrize("start", [0, 3, 5])
def test_resume_mid_epoch_with_workers(tiny, start: int) -> None:
    files, schema = tiny
    whole = batches(files, schema, 0)
    assert 0 < start < len(whole) - 1 or start == 0
    assert_same(batches(files, schema, 2, start=start), whole[start:])


def test_a_killed_worker_is_one_line_and_no_hang(tiny) -> None:
    files, schema = tiny
    reader = ParquetReader(files, schema, 4, workers=2, prefetch=1, shuffle_buffer=8)
    it = reader.epoch(0)
    within(120, lambda: next(it))
    # the reader's own list: /proc/PID/task/TID/children lists a thread's children only,
    # and the forkserver started in within()'s thread is passed to whichever thread the
    # kernel picks when that thread ends
    for child in reader.worker_pids():
        os.kill(child, signal.SIGKILL)
    with pytest.raises(DecodeWorkerError) as e:
        within(60, lambda: list(it))
    message = str(e.value)
    assert "\n" not in message and "died" in message and "data.workers=0" in message


def test_workers_live_across_epochs(tiny) -> None:
    """The same processes serve every epoch, also after one left early, and each epoch's
    batches are those of the one-thread reader."""
    files, schema = tiny
    kw = {"shuffle": True, "seed": 7, "shuffle_buffer": 24}
    reader = ParquetReader(files, schema, 12, workers=2, prefetch=1, **kw)
    one = ParquetReader(files, schema, 12, workers=0, **kw)
    assert reader.worker_pids() == []
    assert_same(within(120, lambda: list(reader.epoch(0))), list(one.epoch(0)))
    pids = reader.worker_pids()
    assert len(pids) == 2
    it = reader.epoch(1)
    within(60, lambda: next(it))
    it.close()  # left early: the workers drop the rest of epoch 1
    assert_same(within(120, lambda: list(reader.epoch(2))), list(one.epoch(2)))
    assert_same(within(120, lambda: list(reader.epoch(1, start_step=2))), list(one.epoch(1))[2:])
    assert reader.worker_pids() == pids
    reader.close()
    assert reader.worker_pids() == []


def test_each_worker_decodes_its_next_window_whole_while_the_trainer_reads_another(tiny) -> None:
    """The trainer takes a window's batches from one worker in a row: each other worker
    has its whole next window decoded into its slots meanwhile, not ``prefetch`` batches
    of it (at 4 ahead the H200 host's 16 workers gave 4.81x one core's rate)."""
    import time

    files, schema = tiny
    reader = ParquetReader(files, schema, 4, workers=2, prefetch=2, shuffle=True, seed=5,
                           shuffle_buffer=40)
    assert (reader.window_rows, reader.worker_depth()) == (40, 10)  # 10 batches a window
    it = reader.epoch(0)
    first = within(120, lambda: next(it))  # window 0's, worker 0's; window 1 is worker 1's
    state = reader._pool.receivers[1].state

    def sent() -> int:
        return sum(s == SENT for s in state)

    end = time.monotonic() + 60
    while sent() < 10 and time.monotonic() < end:
        time.sleep(0.05)
    assert sent() == 10  # all of window 1, and nothing past its 10 batches (queue full)
    reference = list(ParquetReader(files, schema, 4, shuffle=True, seed=5, shuffle_buffer=40).epoch(0))
    assert_same([first, *within(120, lambda: list(it))], reference)
    reader.close()


def test_the_workers_depth_is_a_window_within_the_shared_memory(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """A window's batches, at least data.prefetch, at most what half of /dev/shm's free
    space holds over the workers (each slot a quarter over its batch); worker_depth= wins."""
    files, schema = tiny

    def depth(**kw: Any) -> int:
        kw = {"workers": 2, "prefetch": 2, "shuffle": True, "shuffle_buffer": 40, **kw}
        return ParquetReader(files, schema, 4, **kw).worker_depth()

    assert depth() == 10 and depth(prefetch=12) == 12 and depth(worker_depth=3) == 3
    monkeypatch.setattr("data.reader.slots_that_fit", lambda workers, nbytes, share: _HELD_BATCHES + IN_FLIGHT + 6)
    assert depth() == 6 and depth(prefetch=7) == 7
    monkeypatch.undo()

    class Shm:
        f_bavail, f_frsize = 1000, 4096  # 4,096,000 bytes free

    monkeypatch.setattr("os.statvfs", lambda path: Shm)
    assert slots_that_fit(2, 10_000) == 4_096_000 // 2 // 2 // 10_000  # half the space, 2 workers
    specs = batch_specs(4, 2, 12, 3)  # dense [4, 2] f32, labels [4], values [12], lengths [12]
    assert slot_bytes(specs) == (64 + 64 + 128 + 128) * 5 // 4  # each array from a cache line, a quarter more


def test_held_batches_stay_intact_while_the_workers_reuse_their_slots(tiny) -> None:
    """Batches come as views of the workers' shared memory: while the trainer holds some
    (here the last ``_HELD_BATCHES`` + 2: past that many per worker they are copies) the
    workers write the next ones into other slots, and every slot is free again once the
    batches are dropped."""
    files, schema = tiny
    kw = {"shuffle": True, "seed": 3, "shuffle_buffer": 8}
    reference = list(ParquetReader(files, schema, 4, workers=0, **kw).epoch(0))
    reader = ParquetReader(files, schema, 4, workers=1, prefetch=1, **kw)

    def read_holding_more() -> int:
        held: list[tuple[int, Batch]] = []
        for t, batch in enumerate(reader.epoch(0)):
            held = [*held[-(_HELD_BATCHES + 1):], (t, batch)]
            for u, b in held:
                assert_same([b], [reference[u]])
        return t + 1

    assert within(120, read_holding_more) == len(reference) > 3 * 13  # many times the slots
    gc.collect()
    state = reader._pool.receivers[0].state
    assert list(state) == [FREE] * len(state)
    reader.close()


def test_no_dense_columns_and_empty_batches(tmp_path: Path) -> None:
    """Batches with no dense values, and batches of no rows (every row of theirs bad,
    on_error=skip), cross the shared memory like any other."""
    a = write(tmp_path / "a.parquet", columns(0, 24) | {"I2": [float("nan")] * 12 + [1.0] * 12})
    no_dense = dataclasses.replace(SCHEMA, dense=())
    for schema in (no_dense, SCHEMA):
        got = [batches([a], schema, workers, shuffle=False, shuffle_buffer=8, on_error="skip")
               for workers in (0, 2)]
        assert_same(got[1], got[0])
        assert any(b.size == 0 for b in got[0]) == (schema is SCHEMA)
        assert got[0][0].dense.shape[1] == len(schema.dense)


def test_batches_outlive_the_workers(tiny) -> None:
    files, schema = tiny
    kw = {"shuffle": True, "seed": 3, "shuffle_buffer": 8}
    reference = list(ParquetReader(files, schema, 4, workers=0, **kw).epoch(1))
    reader = ParquetReader(files, schema, 4, workers=2, prefetch=1, **kw)
    it = reader.epoch(1)
    first = within(120, lambda: [next(it) for _ in range(3)])
    it.close()
    reader.close()  # the workers exit and unlink their shared memory
    assert reader.worker_pids() == []
    assert_same(first, reference[:3])


def test_slots_left_by_an_epoch_left_early_come_back(tiny) -> None:
    files, schema = tiny
    reader = ParquetReader(files, schema, 4, workers=2, prefetch=1, shuffle_buffer=8)
    for start in (0, 5):
        it = reader.epoch(0, start_step=start)
        within(120, lambda it=it: [next(it) for _ in range(3)])
        it.close()
    whole = within(120, lambda: len(list(reader.epoch(1))))
    assert whole == reader.steps_per_epoch()
    gc.collect()
    for receiver in reader._pool.receivers:
        assert list(receiver.state) == [FREE] * len(receiver.state)
    reader.close()


def test_after_a_killed_worker_the_next_epoch_starts_fresh_workers(tiny) -> None:
    files, schema = tiny
    reader = ParquetReader(files, schema, 4, workers=2, prefetch=1, shuffle_buffer=8)
    it = reader.epoch(0)
    within(120, lambda: next(it))
    old = reader.worker_pids()
    os.kill(old[0], signal.SIGKILL)
    with pytest.raises(DecodeWorkerError):
        within(60, lambda: list(it))
    one = ParquetReader(files, schema, 4, workers=0, shuffle_buffer=8)
    assert_same(within(120, lambda: list(reader.epoch(1))), list(one.epoch(1)))
    assert not set(reader.worker_pids()) & set(old)
    reader.close()


def test_corrupt_row_group_fails_with_the_same_line(tmp_path: Path) -> None:
    a = write(tmp_path / "a.parquet", columns(0, 24))
    smash_row_group(a, 1)
    errors = []
    for workers in (0, 2):
        with pytest.raises(DataError) as e:
            batches([a], SCHEMA, workers, shuffle=False, shuffle_buffer=8)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "row group 1" in errors[0] and "\n" not in errors[0]


def test_skip_drops_the_same_rows_and_records_them(tmp_path: Path) -> None:
    a = write(tmp_path / "a.parquet", columns(0, 24))
    b = write(tmp_path / "b.parquet", columns(24, 16, ) | {"I2": [1.0] * 5 + [float("nan")]
                                                              + [1.0] * 10})
    smash_row_group(a, 1)
    seen = []
    for workers in (0, 2):
        reader = ParquetReader([a, b], SCHEMA, 6, workers=workers, on_error="skip",
                               shuffle=True, seed=3, shuffle_buffer=12)
        got = within(120, lambda r=reader: list(r.epoch(0)))
        seen.append((got, [(r.file, r.row_group, r.row, r.rows, r.reason)
                           for r in reader.bad_data.records]))
    assert_same(seen[0][0], seen[1][0])
    assert seen[0][1] == seen[1][1] and len(seen[0][1]) >= 2


def test_auto_workers_leave_the_trainers_cores() -> None:
    assert auto_workers(16, 1, 1) == 15
    assert auto_workers(16, 8, 1) == 1
    assert auto_workers(2, 1, 2) == 0
    assert auto_workers(4, 8, 1) == 0


def test_data_workers_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from dlrm.config import ConfigError, load_config
    from dlrm.train.inputs import decode_workers

    assert decode_workers(load_config(None, ["data.workers=3"])) == 3
    assert decode_workers(load_config(None, ["data.workers=auto", "train.device=cpu"])) == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr("dlrm.train.inputs.available_cores", lambda: 16)
    assert decode_workers(load_config(None, ["data.workers=auto"])) == 15
    for bad in ("-1", "lots"):
        with pytest.raises(ConfigError, match="data.workers"):
            load_config(None, [f"data.workers={bad}"])


def test_dropped_unseen_ids_are_counted_the_same(tiny) -> None:
    files, schema = tiny
    small = dataclasses.replace(schema, sparse=tuple(dataclasses.replace(f, rows=30)
                                                      for f in schema.sparse))
    seen = []
    for workers in (0, 2):
        reader = ParquetReader(files, small, 12, workers=workers, id_policy="drop", shuffle=True,
                               seed=5, shuffle_buffer=24)
        got = within(120, lambda r=reader: list(r.epoch(0)))
        seen.append((got, dict(reader.unseen_ids)))
    assert_same(seen[0][0], seen[1][0])
    assert seen[0][1] == seen[1][1] and sum(seen[0][1].values()) > 0


@pytest.mark.slow
def test_training_with_workers_equals_training_without(tiny_data, tmp_path: Path) -> None:
    """Same seed and data: data.workers=2 trains to bit-identical parameters (12 steps)."""
    from dlrm.config import load_config
    from dlrm.train.trainer import train
    from tests.conftest import TINY, tiny_overrides
    from tests.run_state import run_state

    states = []
    for workers in (0, 2):
        cfg = load_config(TINY, tiny_overrides(**{
            "data.train": tiny_data["train"], "data.eval": "", "data.workers": workers,
            "data.shuffle_buffer": 4096, "train.max_steps": 12}))
        train(cfg, tmp_path / f"w{workers}", echo=lambda s: None)
        states.append(run_state(tmp_path / f"w{workers}"))
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_a_pool_whose_start_was_cut_short_closes(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """A start cut short (the GPU session's pytest time limit hit one) leaves workers that
    never started: close() stops the started one and skips the other, no
    AssertionError ('can only join a started process') at close or at exit."""
    from multiprocessing import context

    files, schema = tiny
    real_start, started = context.ForkServerProcess.start, []

    def start_once(self: Any) -> None:
        if started:
            raise KeyboardInterrupt  # the signal arrives while the second one starts
        real_start(self)
        started.append(self)

    monkeypatch.setattr(context.ForkServerProcess, "start", start_once)
    reader = ParquetReader(files, schema, 4, workers=2, prefetch=1, shuffle_buffer=8)
    with pytest.raises(KeyboardInterrupt):
        within(120, lambda: next(reader.epoch(0)))
    assert reader.worker_pids() == [started[0].pid]
    reader.close()
    assert not started[0].is_alive() and reader.worker_pids() == []


def test_a_short_dev_shm_is_one_line_before_the_workers_start(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers whose slots /dev/shm cannot hold died of SIGBUS mid-run (Docker's 64 MB
    default: "decode worker died (exit code -7)"). Now: one line naming /dev/shm and
    the workers that fit before any starts; ``fit_workers`` (data.workers=auto) takes
    those instead, the batches the same."""
    files, schema = tiny
    kw = {"shuffle": True, "seed": 7, "shuffle_buffer": 24}
    probe = ParquetReader(files, schema, 12, workers=3, **kw)
    layout = probe.layout
    each = (probe.worker_depth() + _HELD_BATCHES + IN_FLIGHT) * slot_bytes(
        batch_specs(12, layout.n_dense, 12 * len(layout.packed), len(layout.packed)))
    monkeypatch.setattr("data.reader.shm_free_bytes", lambda: 2 * each + each // 2)  # two workers' room
    reader = ParquetReader(files, schema, 12, workers=3, **kw)
    with pytest.raises(UserError, match=r"^data\.workers=3: their batches need about .* of shared memory "
                                        r"\(/dev/shm\), .* free for this process; .* set data\.workers=2 or lower"):
        next(reader.epoch(0))
    assert reader.worker_pids() == []  # none started
    fitted = ParquetReader(files, schema, 12, workers=3, fit_workers=True, **kw)
    assert_same(within(120, lambda: list(fitted.epoch(0))), list(ParquetReader(files, schema, 12, **kw).epoch(0)))
    assert fitted.workers == 2 and len(fitted.worker_pids()) == 2
    fitted.close()
    halved = ParquetReader(files, schema, 12, workers=2, shm_share=0.5, **kw)  # two processes share it
    with pytest.raises(UserError, match=r"set data\.workers=1 or lower"):
        next(halved.epoch(0))


def test_a_worker_killed_by_sigbus_names_dev_shm() -> None:
    from data.decode_workers import _died

    class Dead:
        exitcode = -signal.SIGBUS

    assert "/dev/shm full?" in str(_died(Dead(), 1))
    Dead.exitcode = -signal.SIGKILL
    assert "/dev/shm" not in str(_died(Dead(), 1)) and "out of memory?" in str(_died(Dead(), 1))
