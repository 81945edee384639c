"""dlrm/config_rules.py: every numeric config key has a rule, each rule's bounds sit
where its words say, and every shipped config passes them; hotline.* keys set with
Hotline off are a warning. (That a bad value is one line through the CLI is
tests/test_cli_errors.py's.)"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from dlrm.cli import main
from dlrm.config import Config, ConfigError, load_config
from dlrm.config_rules import RULES, at_least, each, number, size
from tests.conftest import REPO, TINY
from tests.test_cli_errors import good_columns, train_argv, write

NUMERIC = (int, float)


def numeric_keys(cls: type, prefix: str = "") -> Iterator[str]:
    """Rule keys of every field of ``cls`` (recursively) that holds numbers: int and
    float fields, lists and mappings of them; ``*`` for a mapping of dataclasses' keys."""
    for name, tp in typing.get_type_hints(cls).items():
        key = f"{prefix}{name}"
        args = typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            yield from numeric_keys(tp, key + ".")
        elif typing.get_origin(tp) is dict and dataclasses.is_dataclass(args[1]):
            yield from numeric_keys(args[1], key + ".*.")
        elif tp in NUMERIC or (typing.get_origin(tp) in (list, dict) and args[-1] in NUMERIC):
            yield key


def test_every_numeric_key_has_a_rule() -> None:
    """A key added without a rule fails here: add its line to RULES."""
    keys = set(numeric_keys(Config))
    assert "model.embedding_dim" in keys and "embeddings.plan.*.ranks" in keys  # the walk works
    assert sorted(keys - set(RULES)) == []


def test_every_rule_names_a_key() -> None:
    """No rule for a key that was renamed or removed (it would check nothing)."""
    keys = set(numeric_keys(Config)) | {"hotline.budget", "embeddings.memory_per_rank", "data.workers",
                                        "data.shuffle_buffer"}
    assert sorted(set(RULES) - keys) == []


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_pass(path: Path) -> None:
    load_config(path)


def test_bounds() -> None:
    """Each rule kind at its edges."""
    assert at_least(1).fits(1) and not at_least(1).fits(0)
    assert at_least(0).fits(0) and not at_least(0).fits(-1)
    lr = number()
    assert lr.fits(1e-9) and not lr.fits(0.0) and not lr.fits(-1.0)
    assert not lr.fits(math.nan) and not lr.fits(math.inf)
    fraction = number(high=1.0)
    assert fraction.fits(1.0) and not fraction.fits(1.0 + 1e-9) and not fraction.fits(0.0)
    assert number(open_low=False).fits(0.0)
    assert size(empty_ok=True).fits("") and not size(empty_ok=False).fits("")
    assert all(size(empty_ok=False).fits(s) for s in ("256MB", "16GiB", "4096", "1.5G"))
    assert not any(size(empty_ok=False).fits(s) for s in ("lots", "16XB", "0", "-1GB"))
    layers = each(at_least(1), non_empty=True)
    assert layers.fits([1]) and not layers.fits([]) and not layers.fits([4, 0, 1])
    assert each(at_least(1), mapping=True).fits({}) and not each(at_least(1), mapping=True).fits({"a": 0})


def test_shuffle_buffer_is_auto_or_a_row_count() -> None:
    assert load_config(None).data.shuffle_buffer == "auto"
    assert load_config(None, ["data.shuffle_buffer=262144"]).data.shuffle_buffer == "262144"
    for bad in ("0", "-5", "lots"):
        with pytest.raises(ConfigError, match='data.shuffle_buffer.*"auto" or an integer >= 1'):
            load_config(None, [f"data.shuffle_buffer={bad}"])


def test_message_names_key_value_and_what_is_allowed() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.embedding_dim=-4"])
    assert str(e.value) == "config key model.embedding_dim=-4: must be an integer >= 1"
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.embedding_dim=8"])  # the default bottom MLP ends at 16
    assert str(e.value).startswith("config key model.bottom_mlp=[512, 256, 16]: must end at "
                                   "model.embedding_dim (8)")


def test_dcn_mlp_end_and_edges_pass() -> None:
    """The smallest allowed values load (the rules are not off by one); 1e-12, which
    YAML 1.1 reads as a string, is a number."""
    cfg = load_config(None, ["model.embedding_dim=1", "model.bottom_mlp=[1]", "model.top_mlp=[1]",
                       "model.interaction=dcn", "model.dcn_rank=0", "data.batch_size=1",
                       "train.max_steps=0", "hotline.profile_fraction=1", "optim.dense_lr=1e-12",
                       "embeddings.memory_per_rank=", "data.rows={c0: 1}"])
    assert cfg.optim.dense_lr == 1e-12


def test_hotline_keys_set_with_hotline_off_are_one_warning() -> None:
    """hotline.* keys set, in the YAML or an override, without the placement that turns
    Hotline on: a warning naming them (it trained an ordinary run, silently). Defaults
    do not count, and a run with Hotline on is not warned."""
    def told(path: Path | None, overrides: list[str]) -> list[str]:
        lines: list[str] = []
        load_config(path, overrides, warn=lines.append)
        return lines

    assert told(None, []) == [] and told(TINY, []) == []  # every hotline.* key has a default
    [line] = told(TINY, ["hotline.budget=128MB", "hotline.refresh_every=5"])
    assert line.startswith("warning: hotline.budget, hotline.refresh_every set, but Hotline is off")
    assert "embeddings.placement=hotline" in line
    bench_gpu = REPO / "configs" / "bench_gpu.yaml"
    in_file = [f"hotline.{k}" for k in yaml.safe_load(bench_gpu.read_text())["hotline"]]
    assert len(in_file) >= 2
    [line] = told(bench_gpu, [])
    assert line.startswith(f"warning: {', '.join(in_file)} set,")
    assert told(bench_gpu, ["embeddings.placement=hotline"]) == []
    assert told(TINY, ["embeddings.placement=hotline", "hotline.budget=4KB"]) == []


def test_dlrm_train_prints_the_hotline_warning_once(tmp_path: Path, capsys) -> None:
    data = write(tmp_path / "d.parquet", good_columns(np.random.default_rng(3)))
    assert main(train_argv(data, tmp_path / "run", "hotline.budget=4KB")) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if "hotline.budget" in line] == [out[0]]
    assert out[0].startswith("warning: hotline.budget set, but Hotline is off")
    assert main(train_argv(data, tmp_path / "hot", "embeddings.placement=hotline", "hotline.budget=4KB")) == 0
    assert "Hotline is off" not in capsys.readouterr().out
