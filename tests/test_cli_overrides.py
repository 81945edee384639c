"""``key=value`` overrides may stand before and after a verb's options.

``dlrm train --config C embeddings.placement=hotline --out RUN hotline.budget=4KB``
was refused by argparse as ``unrecognized arguments: hotline.budget=4KB`` (it takes
one run of positionals), which reads as if the key were unknown. Each test checks the
split command against the same overrides given in one run."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from dlrm.cli import main
from tests.conftest import TINY


def test_plan_takes_overrides_on_both_sides_of_an_option(capsys) -> None:
    together = ["plan", "--config", str(TINY), "--world-size", "2",
                "embeddings.replicate_max_bytes=0", "model.embedding_dim=8", "model.bottom_mlp=[64,8]"]
    assert main(together) == 0
    expected = capsys.readouterr().out
    assert "1,000x8" in expected and "table_wise" in expected  # the overrides took effect
    split = ["plan", "--config", str(TINY), "embeddings.replicate_max_bytes=0", "--world-size", "2",
             "model.embedding_dim=8", "model.bottom_mlp=[64,8]"]
    assert main(split) == 0
    assert capsys.readouterr().out == expected


def test_generate_takes_overrides_on_both_sides_of_an_option(tmp_path: Path, capsys) -> None:
    argv = ["generate", "--config", str(TINY), "generate.sparse=2", "--out", str(tmp_path / "d"),
            "generate.dense=1", "generate.multi_hot=0", "--rows", "100"]
    assert main(argv) == 0, capsys.readouterr().err
    names = pq.read_schema(next((tmp_path / "d").glob("*.parquet"))).names
    assert sorted(n for n in names if n != "label") == ["C1", "C2", "I1"]
