"""A resume mid-epoch in another reading order (dlrm/train/carry_order.py): the epoch
ends in the checkpoint's order, so each of its rows is trained once; the next epoch
reads in the run's own order. Rows carry their ids (dense column I1 = row number) and
``train.trace_rows=I1`` records each rank's rows at every step.

Reference for the parameters: the uninterrupted run to the epoch's end (the resumed
run's global batches are its global batches, summed over other ranks: equal within
rounding)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlrm.config import load_config
from dlrm.train.trainer import train
from tests.conftest import TINY, tiny_overrides
from tests.data_helpers import tiny_dataset
from tests.multiprocess import run_ranks
from tests.run_state import assert_states_close, run_state

pytestmark = [pytest.mark.distributed]

FILE_ROWS = (300, 170, 530, 41)  # uneven files, row groups of 50: N = 1041 rows
N = sum(FILE_ROWS)


def config(data: Path, *extra: str):
    return load_config(TINY, tiny_overrides(**{"data.train": data, "data.eval": ""}) + [
        "train.log_every=100", "embeddings.replicate_max_bytes=0", "train.trace_rows=I1",
        "optim.sparse=sgd", "optim.dense=sgd", *extra])


def train_ranks(rank: int, world_size: int, data: Path, out: Path, extra: tuple[str, ...]) -> None:
    train(config(data, *extra), out, echo=lambda s: None)


def rows_by_epoch(run: Path) -> dict[int, list[int]]:
    """Every traced row of every rank, by epoch; each step's latest record counts."""
    kept: dict[tuple[int, int], dict] = {}
    for path in sorted((run / "trace").glob("rank-*.jsonl")):
        for rec in map(json.loads, path.read_text().splitlines()):
            key = (int(path.stem.split("-")[1]), rec["step"])
            if key not in kept or rec["start"] >= kept[key]["start"]:
                kept[key] = rec
    out: dict[int, list[int]] = {}
    for rec in kept.values():
        out.setdefault(rec["epoch"], []).extend(rec["rows"])
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("order_data")
    tiny_dataset(root, file_rows=FILE_ROWS, row_group_rows=50)
    return root


@pytest.mark.slow
def test_two_ranks_resumed_on_three_mid_epoch_train_each_row_once(data, tmp_path: Path) -> None:
    """2 ranks stop at step 4 of 9 (batch 128); 3 ranks go on to the end of 2 epochs.
    Before: the 3-rank stream from step 4 on read other rows (some twice, some never)."""
    run, straight = tmp_path / "run", tmp_path / "straight"
    common = ("data.batch_size=128", "train.epochs=2", "train.checkpoint_every=4")
    run_ranks(2, train_ranks, data, run, (*common, "train.max_steps=4"))
    run_ranks(3, train_ranks, data, run, (*common, "train.max_steps=9"))
    # the parameters at the epoch's end: as the uninterrupted 2-rank run's
    run_ranks(2, train_ranks, data, straight, (*common, "train.max_steps=9"))
    assert_states_close(run_state(run), run_state(straight), "2 ranks, then 3 mid-epoch")
    run_ranks(3, train_ranks, data, run, common)
    epochs = rows_by_epoch(run)
    for epoch in (0, 1):
        assert sorted(epochs[epoch]) == list(range(N)), f"epoch {epoch}: rows missing or repeated"
    assert (run / "trace" / "rank-2.jsonl").is_file()
    # epoch 0's end in the 2-rank order (9 steps), epoch 1 in the 3-rank one (also 9: ceil(347/43))
    summary = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["steps"] == 18, summary


def test_a_batch_size_changed_mid_epoch_takes_effect_at_the_next_epoch(data, tmp_path: Path) -> None:
    """One process, batch 128 for 3 steps of 9, resumed with batch 256: the epoch ends at
    128 (6 more steps), the next runs 5 steps of 256; the run says so in a note."""
    run = tmp_path / "run"
    train(config(data, "data.batch_size=128", "train.epochs=2", "train.max_steps=3"), run, echo=lambda s: None)
    said: list[str] = []
    summary = train(config(data, "data.batch_size=256", "train.epochs=2"), run, echo=said.append)
    epochs = rows_by_epoch(run)
    for epoch in (0, 1):
        assert sorted(epochs[epoch]) == list(range(N)), f"epoch {epoch}: rows missing or repeated"
    assert summary["steps"] == 9 + 5
    note = [line for line in said if line.startswith("note: resumed at batch 3 of 9 of epoch 0")]
    assert note and "(batch size 128 then, 256 now)" in note[0], said
