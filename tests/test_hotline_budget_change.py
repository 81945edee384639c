"""A changed ``hotline.budget`` in a run directory that has a hot profile.

Before, ``RUN/hot_profile.pt`` was reused whatever the budget: a resume with a
larger budget trained on with the old hot set and said nothing (its config.yaml
claimed the new budget), and a run directory holding a profile but no checkpoint
started with the old hot set too."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from dlrm.cli import main
from dlrm.train.hotline import PROFILE_FILE
from embeddings.hotline.profile import HotProfile
from tests.conftest import TINY, tiny_overrides


def argv(tiny_data, out: Path, *extra: str) -> list[str]:
    return ["train", "--config", str(TINY), "--out", str(out),
            *tiny_overrides(**{"data.train": tiny_data["train"], "data.eval": ""}),
            "embeddings.placement=hotline", "train.max_steps=4", *extra]


def hot_rows(run: Path) -> dict[str, torch.Tensor]:
    return HotProfile.load(run / PROFILE_FILE).hot


def test_a_profile_without_a_checkpoint_is_chosen_again_within_the_new_budget(
        tiny_data, tmp_path: Path, capsys) -> None:
    assert main(argv(tiny_data, tmp_path / "fresh", "hotline.budget=8KB")) == 0
    assert main(argv(tiny_data, tmp_path / "run", "hotline.budget=2KB")) == 0
    small = hot_rows(tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints")  # as a run that never saved
    capsys.readouterr()
    assert main(argv(tiny_data, tmp_path / "run", "hotline.budget=8KB")) == 0
    assert "profiling again" in capsys.readouterr().out
    again, fresh = hot_rows(tmp_path / "run"), hot_rows(tmp_path / "fresh")
    assert sum(v.numel() for v in fresh.values()) > sum(v.numel() for v in small.values())
    assert again.keys() == fresh.keys()
    for name in fresh:  # the same hot set as a run started with 8KB
        assert torch.equal(again[name], fresh[name]), name


def test_a_resume_with_another_budget_and_no_refresh_is_refused(tiny_data, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    assert main(argv(tiny_data, run, "hotline.budget=2KB")) == 0
    config = (run / "config.yaml").read_text()
    capsys.readouterr()
    assert main(argv(tiny_data, run, "hotline.budget=8KB", "train.max_steps=6")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "hotline.budget=8KB" in err and "hotline.budget=2000" in err and "train.init_from=" in err
    assert (run / "config.yaml").read_text() == config  # the refused command changed nothing
    assert main(argv(tiny_data, run, "hotline.budget=2000", "train.max_steps=6")) == 0  # its own fix


def test_a_resume_with_another_budget_and_refreshes_says_when_it_applies(
        tiny_data, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    assert main(argv(tiny_data, run, "hotline.budget=2KB", "hotline.refresh_every=3")) == 0
    capsys.readouterr()
    assert main(argv(tiny_data, run, "hotline.budget=8KB", "hotline.refresh_every=3",
                     "train.max_steps=8")) == 0
    out = capsys.readouterr().out
    assert "the next refresh (hotline.refresh_every=3) chooses within 8KB" in out, out
