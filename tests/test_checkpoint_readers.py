"""A checkpoint that ``dlrm eval`` or ``export`` reads is not removed under it by the
run's pruning (dlrm/checkpoint/readers.py).

Before, an eval of a run still training failed whenever the run saved twice more while
it read ("meta.json: missing", "rank-0.42.bin cannot be read"): 6 of 12 evals of a run
saving every 2 steps.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dlrm.checkpoint import manager as ck
from dlrm.checkpoint.readers import reading, unread
from dlrm.cli import main
from tests.conftest import TINY, tiny_overrides
from tests.data_helpers import tiny_dataset


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("readers") / "data"
    root.mkdir()
    tiny_dataset(root, file_rows=(600,), row_group_rows=100)
    return root


def train(data: Path, run: Path, steps: int) -> None:
    assert main(["train", "--config", str(TINY), "--out", str(run), *tiny_overrides(), f"data.train={data}",
                 "data.eval=", "data.batch_size=32", f"train.max_steps={steps}", "train.checkpoint_every=1",
                 "train.keep_checkpoints=2"]) == 0


def kept(run: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run / ck.CHECKPOINTS).iterdir())


def test_a_checkpoint_being_read_outlives_the_runs_pruning(data: Path, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    train(data, run, 3)
    assert kept(run) == [2, 3]
    with reading(run, ck.find_checkpoint) as held:
        assert held is not None and held.name == "step-000000003"
        train(data, run, 6)  # saves at 4, 5 and 6: pruning would have removed 3
        assert kept(run) == [3, 5, 6]  # 3 kept while it is read; 4 was not read, so it went
        # and it is still a whole checkpoint: an eval of it loads and verifies every file
        capsys.readouterr()
        assert main(["eval", "--checkpoint", str(held), "--data", str(data)]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"] == 600
    train(data, run, 7)  # the next save prunes what no one reads any more
    assert kept(run) == [6, 7]


def test_the_last_reader_out_removes_what_a_finished_run_left_for_it(data: Path, tmp_path: Path,
                                                                      capsys) -> None:
    """The run ends while step 3 is read: it is left over keep_checkpoints=2; an eval of
    it that ends while another reader still holds it leaves it; the last reader to let go
    removes it (before, it stayed for ever)."""
    run = tmp_path / "run"
    train(data, run, 3)
    with reading(run, ck.find_checkpoint, then=ck.prune_after_read) as held:
        train(data, run, 6)  # the run's last save is 6
        assert kept(run) == [3, 5, 6]
        assert main(["eval", "--checkpoint", str(held), "--data", str(data)]) == 0  # a second reader
        assert kept(run) == [3, 5, 6]  # the outer hold still reads it
    assert kept(run) == [5, 6]
    assert not list((run / ck.CHECKPOINTS).glob("*" + ck.DELETING))
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--data", str(data)]) == 0  # the newest: kept
    assert kept(run) == [5, 6]


def test_a_reader_takes_the_newest_again_when_its_find_was_removed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (1, 2):
        (run / ck.CHECKPOINTS / f"step-00000000{step}").mkdir(parents=True)
        (run / ck.CHECKPOINTS / f"step-00000000{step}" / "meta.json").write_text("{}")
    found = []

    def find_then_prune(path: Path) -> Path | None:  # the run prunes between the look and the lock
        newest = ck.find_checkpoint(path)
        found.append(newest.name)
        if len(found) == 1:
            shutil.rmtree(newest)
        return newest

    with reading(run, find_then_prune) as held:
        assert held is not None and held.name == "step-000000001"
    assert found == ["step-000000002", "step-000000001"]


def test_unread_sees_a_reader_and_blocks_new_ones_while_pruning(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-000000001"
    ckpt.mkdir()
    (ckpt / "meta.json").write_text("{}")
    with reading(tmp_path, lambda _: ckpt), unread(ckpt) as free:
        assert not free
    with unread(ckpt) as free:
        assert free
        shutil.rmtree(ckpt)  # what the pruner does with the lock held
    with reading(tmp_path, lambda _: ckpt if ckpt.exists() else None) as held:
        assert held is None
