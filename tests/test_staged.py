"""data.in_memory: the batches are read once and replayed, the same batches the reader gives.

References: the reader's own epoch 0 (batch for batch), and a run reading Parquet: within
the first epoch the staged run must train to bit-identical parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data.reader import ParquetReader
from dlrm.train.staged import StagedBatches
from tests.data_helpers import tiny_dataset
from tests.test_reader_workers import assert_same


class Counting:
    """A reader that counts its epochs."""

    def __init__(self, reader: ParquetReader) -> None:
        self.reader, self.epochs = reader, 0

    def steps_per_epoch(self) -> int:
        return self.reader.steps_per_epoch()

    def epoch(self, epoch: int, start_step: int = 0):
        self.epochs += 1
        return self.reader.epoch(epoch, start_step)


def test_staged_batches_are_epoch_0s_replayed(tmp_path: Path) -> None:
    files, schema = tiny_dataset(tmp_path)
    reader = ParquetReader(files, schema, 12, shuffle=True, seed=3, shuffle_buffer=24)
    whole = list(reader.epoch(0))
    steps = reader.steps_per_epoch()
    counting = Counting(reader)
    staged = StagedBatches(counting, torch.device("cpu"), limit=4)
    assert_same(list(staged.epoch(0)), [whole[t % 4] for t in range(steps)])
    assert_same(list(staged.epoch(5, start_step=3)), [whole[t % 4] for t in range(3, steps)])
    assert counting.epochs == 1  # read once
    full = StagedBatches(Counting(reader), torch.device("cpu"))
    assert_same(list(full.epoch(2, start_step=1)), whole[1:])


@pytest.mark.slow
def test_training_in_memory_equals_training_from_parquet(tiny_data, tmp_path: Path) -> None:
    """Within the first epoch the staged batches are the reader's: same parameters."""
    from dlrm.config import load_config
    from dlrm.train.trainer import train
    from tests.conftest import TINY, tiny_overrides
    from tests.run_state import run_state

    states = []
    for staged in (False, True):
        cfg = load_config(TINY, tiny_overrides(**{
            "data.train": tiny_data["train"], "data.eval": "", "data.in_memory": staged,
            "data.shuffle_buffer": 4096, "train.max_steps": 8}))
        train(cfg, tmp_path / f"s{staged}", echo=lambda s: None)
        states.append(run_state(tmp_path / f"s{staged}"))
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


@pytest.mark.gpu
def test_staged_batches_live_on_the_gpu_and_equal_the_readers(tmp_path: Path) -> None:
    files, schema = tiny_dataset(tmp_path)
    reader = ParquetReader(files, schema, 12, shuffle=True, seed=3, shuffle_buffer=24)
    whole = list(reader.epoch(0))
    staged = StagedBatches(reader, torch.device("cuda"), limit=3)
    got = list(staged.epoch(0))
    assert all(b.dense.is_cuda and b.sparse.values().is_cuda and b.labels.is_cuda for b in got)
    assert got[0] is got[3]  # kept once, replayed: no copy per epoch
    assert_same([b.to("cpu") for b in got], [whole[t % 3] for t in range(len(whole))])
