"""A run whose loss turns NaN stops in one line before it saves or evaluates the bad
weights (dlrm/train/divergence.py).

Before, learning rates of 1e8 trained to the end, saved NaN weights as the newest
checkpoint (a resume took them) and died in the final eval with a traceback
(``ValueError: scores: contains NaN or infinite values``). The reference for "bad" is
torch.isfinite over the saved dense weights; for "the same step on every rank", a
one-process run's message.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from dlrm.checkpoint import manager as ck
from dlrm.cli import main
from dlrm.config import load_config
from dlrm.train import divergence
from dlrm.train.divergence import Diverged
from dlrm.train.trainer import train
from tests.conftest import TINY, tiny_overrides
from tests.data_helpers import tiny_dataset
from tests.multiprocess import run_ranks

BLOW_UP = ["optim.dense_lr=1e8", "optim.sparse_lr=1e8"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("divergence") / "data"
    root.mkdir()
    tiny_dataset(root, file_rows=(800,), row_group_rows=100)
    return root


def argv(data: Path, run: Path, *extra: str) -> list[str]:
    return ["train", "--config", str(TINY), "--out", str(run), *tiny_overrides(), f"data.train={data}",
            f"data.eval={data}", "data.batch_size=32", "train.max_steps=20", "train.checkpoint_every=4",
            "train.log_every=3", *extra]


def saved_steps(run: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in ck.checkpoints(run, legacy=False)]


def dense_finite(ckpt: Path) -> bool:
    state = torch.load(ckpt / "state.pt", weights_only=True)
    tensors = [v for v in state["dense"].values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return bool(tensors) and all(bool(t.isfinite().all()) for t in tensors)


def test_a_diverging_run_stops_in_one_line_without_saving_the_bad_weights(data: Path, tmp_path: Path,
                                                                         capsys) -> None:
    run = tmp_path / "run"
    assert main(argv(data, run, *BLOW_UP)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.match(r"dlrm train: error: the training loss is (nan|inf) at step 3:", err), err  # by machine
    assert "no checkpoint was saved" in err and "optim.dense_lr (1e+08)" in err
    assert saved_steps(run) == []
    log = run / "metrics.jsonl"
    logged = [json.loads(line) for line in (log.read_text() if log.exists() else "").splitlines()]
    assert not [r for r in logged if r.get("event") in ("train", "eval")]  # no nan in the log


def test_a_resumed_run_that_diverges_keeps_its_finite_checkpoints(data: Path, tmp_path: Path,
                                                                  capsys) -> None:
    run = tmp_path / "run"
    assert main(argv(data, run, "train.max_steps=8")) == 0
    assert saved_steps(run) == [8, 4]
    assert main(argv(data, run, *BLOW_UP)) == 2  # resumed at 8 with rates that blow up
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"loss is (nan|inf) at step 12 \(finite at step 9\)", err), err  # step 9 trained on step 8's weights
    assert "the newest checkpoint, step-000000008, is from before it" in err
    assert saved_steps(run) == [8, 4] and dense_finite(ck.find_checkpoint(run))
    assert main(argv(data, run)) == 0  # the same run, sane rates: it goes on from step 8
    assert saved_steps(run)[0] == 20


def test_eval_of_a_checkpoint_with_nan_weights_names_the_checkpoint(data: Path, tmp_path: Path,
                                                                    capsys, monkeypatch) -> None:
    """Checkpoints written before the check (here: with it switched off, and a dense
    weight set to NaN before each save, as a diverged run's were; blown-up rates give
    inf or NaN depending on the machine's arithmetic) hold NaN weights; dlrm eval says
    so in one line instead of blaming the data."""
    from dlrm.train import trainer as trainer_mod

    monkeypatch.setattr(divergence.DivergenceGuard, "check", lambda *a, **k: None)
    save = trainer_mod.Trainer.save

    def poisoned_save(self) -> None:
        with torch.no_grad():
            next(iter(self.model.dense_parameters())).fill_(float("nan"))
        save(self)

    monkeypatch.setattr(trainer_mod.Trainer, "save", poisoned_save)
    run = tmp_path / "run"
    assert main(argv(data, run)) == 2  # its eval: one line (a traceback before)
    assert "the eval at step 20: scores: contains NaN" in capsys.readouterr().err
    newest = ck.find_checkpoint(run)
    assert newest is not None and not dense_finite(newest)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--data", str(data)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"dlrm eval: error: checkpoint {newest}: the model's scores are NaN or infinite: "
                   "its weights are (a run that diverged before its loss was checked)")


def _train_rank(rank: int, world_size: int, data: str, run: str) -> str:
    args = argv(Path(data), Path(run), *BLOW_UP)
    try:
        train(load_config(TINY, args[args.index("--out") + 2:]), Path(run))
    except Diverged as e:
        return str(e)
    return ""


@pytest.mark.distributed
def test_every_rank_stops_at_the_same_step_as_one_process(data: Path, tmp_path: Path) -> None:
    said = run_ranks(2, _train_rank, str(data), str(tmp_path / "two"))
    one = _train_rank(0, 1, str(data), str(tmp_path / "one"))
    assert said[0] == said[1] == one and re.match(r"the training loss is (nan|inf) at step 3:", one)
    assert saved_steps(tmp_path / "two") == []
