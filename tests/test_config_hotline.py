"""Hotline's config keys that changed (dlrm/config.py):

- ``hotline.graph_dense`` / ``graph_split``: auto | on | off, default auto; YAML's
  true / false (configs and saved run configs from before, when they were booleans)
  read as on / off. (That auto is silent on a CPU and on warns is
  tests/test_dense_graphs.py's.)
- ``hotline.dense_pass`` is removed (``REMOVED_KEYS``): ``once`` is a note; a new run
  asking for ``per_micro_batch`` is one line of error; a resume keeps going with a
  note; a saved config holding either (an old run's RUN/config.yaml or checkpoint)
  still loads for ``dlrm eval``, ``dlrm export`` and a resume.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from dlrm.checkpoint import manifest
from dlrm.checkpoint.manager import find_checkpoint
from dlrm.cli import main
from dlrm.config import Config, ConfigError, from_dict, load_config, to_dict, to_yaml
from dlrm.eval.export import read_export
from tests.conftest import TINY
from tests.test_cli_errors import assert_one_line_error, good_columns, train_argv, write


def told(overrides: list[str], resuming: bool = False, path: Path | None = TINY) -> tuple[Config, list[str]]:
    """The config and the lines ``warn`` was told."""
    lines: list[str] = []
    cfg = load_config(path, ["embeddings.placement=hotline", *overrides], warn=lines.append, resuming=resuming)
    return cfg, lines


@pytest.mark.parametrize("given,read", [("auto", "auto"), ("on", "on"), ("off", "off"),
                                        ("true", "on"), ("false", "off")])
def test_graph_options_read_auto_on_off_and_yaml_booleans(given: str, read: str, tmp_path: Path) -> None:
    cfg, lines = told([f"hotline.graph_dense={given}", f"hotline.graph_split={given}"])
    assert (cfg.hotline.graph_dense, cfg.hotline.graph_split, lines) == (read, read, [])
    yaml_file = tmp_path / "c.yaml"  # the same in a file, written as YAML writes it
    yaml_file.write_text(yaml.safe_dump({"hotline": {"graph_dense": yaml.safe_load(given)}}))
    assert load_config(yaml_file).hotline.graph_dense == read
    saved = yaml.safe_load(to_yaml(cfg))  # RUN/config.yaml round trip ('on' is quoted: not a boolean)
    assert from_dict(Config, saved, "").hotline.graph_dense == read


def test_graph_options_default_to_auto_and_refuse_other_values() -> None:
    cfg = load_config(None)
    assert cfg.hotline.graph_dense == cfg.hotline.graph_split == "auto"
    with pytest.raises(ConfigError, match=r"hotline.graph_split: 'sometimes' is not one of \['auto', 'on', 'off'\]"):
        load_config(None, ["hotline.graph_split=sometimes"])


def test_saved_configs_of_earlier_runs_load() -> None:
    """A config saved before (booleans for the graph options, dense_pass either way)."""
    for dense_pass in ("once", "per_micro_batch"):
        saved = to_dict(load_config(TINY))
        saved["hotline"].update(dense_pass=dense_pass, graph_dense=True, graph_split=False)
        cfg = from_dict(Config, saved, "")
        assert (cfg.hotline.graph_dense, cfg.hotline.graph_split) == ("on", "off")
        assert "dense_pass" not in to_dict(cfg)["hotline"]  # not written again
    saved["hotline"]["dense_pass"] = "twice"
    with pytest.raises(ConfigError, match=r"hotline.dense_pass: 'twice' is not one of \['once', 'per_micro_batch'\]"):
        from_dict(Config, saved, "")


def test_dense_pass_once_is_a_note() -> None:
    cfg, lines = told(["hotline.dense_pass=once"])
    assert lines == ["note: hotline.dense_pass=once is Hotline's only step now: the key can go"]
    assert cfg == load_config(TINY, ["embeddings.placement=hotline"])


def test_dense_pass_per_micro_batch_is_refused_on_a_new_run_and_a_note_on_a_resume() -> None:
    with pytest.raises(ConfigError) as refused:
        told(["hotline.dense_pass=per_micro_batch"])
    message = str(refused.value)
    assert "\n" not in message and message.startswith("config key hotline.dense_pass=per_micro_batch: removed")
    assert "1.41x" in message and message.endswith("drop the key")
    cfg, [line] = told(["hotline.dense_pass=per_micro_batch"], resuming=True)
    assert line.startswith("note: hotline.dense_pass=per_micro_batch was removed")
    assert "this resume trains one pass per mini-batch" in line
    assert cfg == load_config(TINY, ["embeddings.placement=hotline"])
    with pytest.raises(ConfigError, match="'twice' is not one of"):
        told(["hotline.dense_pass=twice"], resuming=True)


def as_an_earlier_run(run: Path) -> Path:
    """``run``'s config.yaml and newest checkpoint rewritten as a run from before the
    change saved them: hotline.dense_pass=per_micro_batch, the graph options booleans
    (the checkpoint's meta.json checksum made again, as the run had written it)."""
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["hotline"].update(dense_pass="per_micro_batch", graph_dense=False, graph_split=False)
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    ckpt = find_checkpoint(run)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["config"]["hotline"].update(dense_pass="per_micro_batch", graph_dense=False, graph_split=False)
    meta["meta_sha256"] = manifest.meta_digest(meta)
    (ckpt / "meta.json").write_text(json.dumps(meta))
    return run / "config.yaml"


@pytest.mark.slow
def test_an_earlier_per_micro_batch_run_evaluates_exports_and_resumes(tmp_path: Path, capsys) -> None:
    data = write(tmp_path / "d.parquet", good_columns(np.random.default_rng(5)))
    run = tmp_path / "run"
    hotline = ("embeddings.placement=hotline", "hotline.budget=4KB")
    assert main(train_argv(data, run, *hotline)) == 0
    saved = as_an_earlier_run(run)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--data", str(data)]) == 0
    assert "auc" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "export")]) == 0
    _, cfg = read_export(tmp_path / "export")  # the old config travels in export.json
    assert cfg.hotline.graph_dense == "off"
    capsys.readouterr()
    # the run's own saved config as the --config of a new run: one line, nothing written
    code = main(["train", "--config", str(saved), "--out", str(tmp_path / "new")])
    assert_one_line_error(code, capsys.readouterr().err, "hotline.dense_pass=per_micro_batch: removed")
    assert not (tmp_path / "new").exists()
    # and of the resume: a note, then the run goes on (its config.yaml saved without the key)
    assert main(["train", "--config", str(saved), "--out", str(run), "train.max_steps=4"]) == 0
    out = capsys.readouterr().out
    assert "note: hotline.dense_pass=per_micro_batch was removed" in out
    assert "trained 4 steps (2 in this run)" in out, out
    assert "dense_pass" not in saved.read_text()
