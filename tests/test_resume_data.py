"""A resume over other training files than its checkpoint's (dlrm/train/same_data.py):
refused mid-epoch in one line, a note between epochs; a moved data set is the same
data. The reference for "resumes as always" is the run never stopped: its parameters
bit for bit (tests/run_state.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from data.errors import UserError
from dlrm.checkpoint.manifest import load_meta
from dlrm.config import load_config
from dlrm.train.trainer import train
from tests.conftest import TINY, tiny_overrides
from tests.run_state import run_state

BATCH = 2048  # 40k rows: 20 batches an epoch


def _run(data: Path, out: Path, steps: int, lines: list[str] | None = None) -> dict:
    cfg = load_config(TINY, tiny_overrides(**{"data.train": data, "data.eval": "", "train.max_steps": steps,
                                              "data.batch_size": BATCH}))
    return train(cfg, out, echo=(lines.append if lines is not None else lambda s: None))


@pytest.fixture()
def data(tiny_data, tmp_path: Path) -> Path:
    copy = tmp_path / "data"
    shutil.copytree(tiny_data["train"], copy)
    return copy


def test_a_file_added_mid_epoch_is_refused_and_a_moved_data_set_resumes(data: Path, tmp_path: Path) -> None:
    _run(data, tmp_path / "straight", 30)
    run = tmp_path / "run"
    _run(data, run, 7)  # mid-epoch
    extra = data / "part-99999.parquet"
    shutil.copy(min(data.glob("*.parquet")), extra)
    with pytest.raises(UserError, match=r"data.train changed since it was saved \(part-99999.parquet is new; "
                                        r"3 file\(s\) then, 4 now\), in the middle of epoch 0: .*"
                                        r"train.init_from="):
        _run(data, run, 30)
    extra.unlink()
    moved = tmp_path / "elsewhere" / "days"
    shutil.move(data, moved)  # the same files, mounted elsewhere
    assert _run(moved, run, 30)["trained_steps"] == 23
    got, want = run_state(run), run_state(tmp_path / "straight")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_rewritten_file_is_named(data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    _run(data, run, 5)
    first = min(data.glob("*.parquet"))
    pq.write_table(pq.read_table(first), first, row_group_size=1000)  # same rows, other row groups
    with pytest.raises(UserError, match=rf"\({first.name} was rewritten \(its Parquet footer differs\)\)"):
        _run(data, run, 10)


def test_more_files_between_epochs_are_a_note_and_the_next_epoch_reads_them(data: Path, tmp_path: Path) -> None:
    """The checkpoint ended epoch 0: the resume starts epoch 1 over the files as they are
    now. Before, it went on in epoch 0 from batch 20 of the new stream (26 batches now),
    training its tail as the rest of epoch 0 (with fewer batches than 20 it stopped on a
    start_step past the epoch's end)."""
    run = tmp_path / "run"
    _run(data, run, 20)  # one whole epoch
    shutil.copy(min(data.glob("*.parquet")), data / "part-99999.parquet")
    lines: list[str] = []
    summary = _run(data, run, 26, lines)
    assert summary["trained_steps"] == 6
    assert any(x.startswith("note: data.train changed since step-000000020 (part-99999.parquet is new")
               and x.endswith("the run goes on at the start of epoch 1 over the files as they are now")
               for x in lines), lines
    progress = load_meta(run / "checkpoints" / "step-000000026")["progress"]
    assert (progress["epoch"], progress["step_in_epoch"]) == (1, 6)  # epoch 1's first 6 batches


def test_an_eval_set_holding_training_files_or_copies_warns(data: Path, tiny_data, tmp_path: Path) -> None:
    copy = tmp_path / "eval_copy"
    copy.mkdir()
    shutil.copy(min(data.glob("*.parquet")), copy / "renamed.parquet")  # a copy under another name
    for eval_spec, want in ((f"{copy},{tiny_data['eval']}", ("1 of the 2 eval file(s) are training files or "
                             "copies of them (renamed.parquet)")), (str(tiny_data["eval"]), None)):
        cfg = load_config(TINY, tiny_overrides(**{"data.train": data, "data.eval": eval_spec,
                                                  "train.max_steps": 1, "data.batch_size": BATCH}))
        lines: list[str] = []
        train(cfg, tmp_path / f"run{len(eval_spec)}", echo=lines.append)
        warned = [x for x in lines if "eval measures rows the model trained on" in x]
        assert (warned[0].startswith(f"warning: {want}") if want else not warned), lines
