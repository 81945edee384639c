"""`dlrm fit` once, reuse with data.preprocessing=DIR: the reused run trains the same
parameters as a run that fits for itself (reference: that fresh run), its
preprocessing.json is the fit's byte for byte, and a changed data file is refused in
one line naming the file."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from data.preprocess import FILE
from dlrm.cli import main
from dlrm.train.trainer import train
from tests.conftest import TINY
from tests.run_state import run_state
from tests.test_preprocess_train import cfg_for, string_dataset


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fit")
    paths = {"train": string_dataset(root / "train", 1500, 1),
             "eval": string_dataset(root / "eval", 400, 2), "fit": root / "fit"}
    code = main(["fit", "--config", str(TINY), "--data", str(paths["train"]),
                 "--out", str(paths["fit"]), "data.label=click", "data.min_frequency=2"])
    assert code == 0
    return paths


@pytest.mark.slow
def test_reused_fit_trains_the_fresh_fit_parameters(fitted, tmp_path: Path) -> None:
    said: list[str] = []
    extra = ("data.min_frequency=2", "train.max_steps=3")
    train(cfg_for(fitted["train"], fitted["eval"], *extra), tmp_path / "fresh", echo=said.append)
    assert f"data.preprocessing={tmp_path / 'fresh'}" in "\n".join(said)
    train(cfg_for(fitted["train"], fitted["eval"], *extra,
                  f"data.preprocessing={fitted['fit']}"), tmp_path / "reused", echo=lambda s: None)
    assert (tmp_path / "reused" / FILE).read_bytes() == (fitted["fit"] / FILE).read_bytes()
    assert (tmp_path / "fresh" / FILE).read_bytes() == (fitted["fit"] / FILE).read_bytes()
    a, b = run_state(tmp_path / "fresh"), run_state(tmp_path / "reused")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_a_changed_data_file_is_refused_in_one_line(fitted, tmp_path: Path, capsys) -> None:
    changed = tmp_path / "train"
    changed.mkdir()
    table = pq.read_table(fitted["train"] / "part-0.parquet")
    pq.write_table(table.slice(0, 1400), changed / "part-0.parquet", row_group_size=500)
    code = main(["train", "--config", str(TINY), "--out", str(tmp_path / "run"),
                 f"data.train={changed}", f"data.eval={fitted['eval']}", "data.label=click",
                 f"data.preprocessing={fitted['fit']}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "part-0.parquet changed since the fit" in err[0] and "data.preprocessing=" in err[0]
    assert not (tmp_path / "run").exists()


def test_an_unchanged_copy_elsewhere_is_accepted(fitted, tmp_path: Path) -> None:
    """Files are matched by name and footer, so a moved data set reuses the fit."""
    import shutil

    from data import preprocess

    moved = tmp_path / "moved"
    shutil.copytree(fitted["train"], moved)
    prep = preprocess.load(fitted["fit"], [str(moved / "part-0.parquet")])
    assert prep.vocabularies and prep.data == preprocess.footer_digests([str(moved / "part-0.parquet")])


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_fit_over_two_ranks_writes_the_one_process_fit(fitted, tmp_path: Path) -> None:
    """`torchrun --nproc_per_node=2 -m dlrm fit`: each rank counts half the row groups
    (gloo), rank 0 writes, and every file equals the one-process `dlrm fit` byte for
    byte (string and list columns, min_frequency 2)."""
    from tests.test_torchrun import torchrun

    out = tmp_path / "fit2"
    proc = torchrun(2, "fit", "--config", str(TINY), "--data", str(fitted["train"]),
                    "--out", str(out), "data.label=click", "data.min_frequency=2")
    assert proc.stdout.count("wrote ") == 1  # rank 0 alone prints and writes

    def files(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
                if p.is_file()}

    assert files(out) == files(fitted["fit"]) and len(files(out)) >= 2


@pytest.mark.parametrize("setting,named", [
    ("data.min_frequency=3", "data.min_frequency is 3 here, 2 for the fit"),
    ("data.dense_transform=log1p", "data.dense_transform(s) asks log1p for n1, the fit has none"),
    ("data.encodings.app=hash", "data.encoding(s) asks hash for app, the fit has vocabulary (asked auto)"),
    ("data.rows.dev=64", "data.rows.dev is 64 here, unset for the fit"),
])
def test_a_setting_the_fit_was_not_made_with_is_refused_in_one_line(fitted, tmp_path: Path, capsys,
                                                                    setting: str, named: str) -> None:
    """A reused fit is taken as it is: a data.* setting that would fit otherwise was
    ignored, silently. Now one line names it, and nothing is written."""
    code = main(["train", "--config", str(TINY), "--out", str(tmp_path / "run"), f"data.train={fitted['train']}",
                 f"data.eval={fitted['eval']}", "data.label=click", "data.min_frequency=2", setting,
                 f"data.preprocessing={fitted['fit']}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"data.preprocessing={fitted['fit']}: {named}; a reused fit is taken as it is" in err[0], err[0]
    assert not (tmp_path / "run").exists()


def test_settings_that_give_the_same_fit_are_taken(fitted, tmp_path: Path) -> None:
    """Asking for what the fit has (vocabulary where auto chose it), or changing what it
    does not use (hash_rows with no hashed table), is the same fit: the run trains."""
    train(cfg_for(fitted["train"], fitted["eval"], "data.min_frequency=2", "data.encoding=vocabulary",
                  "data.hash_rows=99", "train.max_steps=2", f"data.preprocessing={fitted['fit']}"),
          tmp_path / "run", echo=lambda s: None)
    assert (tmp_path / "run" / FILE).read_bytes() == (fitted["fit"] / FILE).read_bytes()


def test_a_fit_saved_without_its_settings_is_checked_on_what_it_holds(fitted, tmp_path: Path) -> None:
    """preprocessing.json from before the settings were recorded: min_frequency cannot be
    compared (taken), an encoding it does not hold can."""
    import json
    import shutil

    from data.errors import UserError

    old = tmp_path / "old_fit"
    shutil.copytree(fitted["fit"], old)
    body = json.loads((old / FILE).read_text())
    del body["settings"]
    (old / FILE).write_text(json.dumps(body, indent=1))
    extra = ("train.max_steps=2", f"data.preprocessing={old}")
    train(cfg_for(fitted["train"], fitted["eval"], "data.min_frequency=7", *extra), tmp_path / "a",
          echo=lambda s: None)
    with pytest.raises(UserError, match="asks hash for site, the fit has vocabulary;"):
        train(cfg_for(fitted["train"], fitted["eval"], "data.encodings.site=hash", *extra), tmp_path / "b",
              echo=lambda s: None)
