"""What ``dlrm train`` prints before its progress bar (issue 25, items 1 and 2): a short
header in place of the resolved config, and one warning line naming the integer
columns that became embedding tables without ``data.sparse`` naming them. The
figures are checked against the Parquet file written here (numpy, not our reader)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dlrm.config import load_config
from dlrm.train.trainer import train
from tests.conftest import TINY, tiny_overrides
from tests.data_helpers import write_parquet

N = 600


@pytest.fixture(scope="module")
def user_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A user's own file: label, a float, two integer counts, an integer id, a string."""
    rng = np.random.default_rng(0)
    cols = {
        "label": rng.integers(0, 2, N).astype(np.float32),
        "spend": rng.random(N).astype(np.float32),
        "clicks_7d": rng.integers(0, 42, N),
        "age": rng.integers(18, 80, N),
        "user_id": rng.integers(0, 300, N),
        "city": [f"c{i}" for i in rng.integers(0, 20, N)],
    }
    root = tmp_path_factory.mktemp("user")
    (root / "train").mkdir()
    write_parquet(root / "train" / "part.parquet", cols)
    return {"dir": root / "train", "cols": cols}


def run_lines(user_data, run: Path, *extra: str) -> list[str]:
    cfg = load_config(TINY, tiny_overrides(**{"data.train": user_data["dir"], "train.max_steps": 1,
                                              "data.batch_size": 64, "data.eval": ""}) + list(extra))
    lines: list[str] = []
    train(cfg, run, echo=lambda s: lines.extend(s.splitlines()))
    return lines


def field(lines: list[str], name: str) -> list[str]:
    return [line[9:] for line in lines if line.split(" ", 1)[0] == name]


def test_header_replaces_the_config_dump(user_data, tmp_path: Path) -> None:
    lines = run_lines(user_data, tmp_path / "run")
    assert not any(line.startswith("config:") for line in lines)
    assert len(lines) < 15, lines
    assert field(lines, "data") == [f"train: 1 file, {N:,} rows"]
    assert field(lines, "schema")[0].startswith("1 dense, 4 sparse; inferred from the footer")
    cols = user_data["cols"]
    rows = sum(int(np.max(cols[c])) + 1 for c in ("clicks_7d", "age", "user_id"))
    # city is vocabulary-encoded: its table is its distinct values plus the reserved rows
    (tables,) = field(lines, "tables")
    total = int(tables.split(", ")[1].split(" rows")[0].replace(",", ""))
    assert tables.startswith("4, ") and rows + 20 <= total <= rows + 20 + 2
    assert field(lines, "device") == ["cpu, fp32"]
    assert field(lines, "run") == [f"{tmp_path / 'run'} (full config: {tmp_path / 'run' / 'config.yaml'})"]
    assert field(lines, "plan")  # placement and one line per strategy
    assert (tmp_path / "run" / "config.yaml").is_file()


def _table_bytes(line: str) -> float:
    """Bytes of the tables line's "= 1.2 MiB" (format_bytes' units)."""
    value, unit = line.split(" = ")[1].split(" (")[0].split()
    return float(value) * 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].index(unit)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_tables_line_gives_the_stored_type_and_bytes(user_data, tmp_path: Path, dtype: str) -> None:
    """Half tables are half the bytes, and the line says so (it once said fp32 for every
    run); per-table types are counted."""
    (fp32,) = field(run_lines(user_data, tmp_path / "a"), "tables")
    (half,) = field(run_lines(user_data, tmp_path / "b", f"embeddings.dtype={dtype}"), "tables")
    (mixed,) = field(run_lines(user_data, tmp_path / "c", f"embeddings.dtypes={{user_id: {dtype}}}"),
                     "tables")
    assert fp32.endswith("(fp32 weights)") and half.endswith(f"({dtype} weights)")
    assert _table_bytes(half) == pytest.approx(_table_bytes(fp32) / 2, rel=0.01)
    assert mixed.endswith(f"(weights: 3 fp32, 1 {dtype})")
    assert _table_bytes(half) < _table_bytes(mixed) < _table_bytes(fp32)


def test_integer_columns_taken_as_sparse_warn_in_one_line(user_data, tmp_path: Path) -> None:
    lines = run_lines(user_data, tmp_path / "run")
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1
    assert "clicks_7d, age, user_id" in warnings[0]
    assert "data.dense=[spend,clicks_7d,age,user_id]" in warnings[0]


def test_the_override_in_the_warning_trains_counts_as_dense(user_data, tmp_path: Path) -> None:
    lines = run_lines(user_data, tmp_path / "run", "data.dense=[spend,clicks_7d,age]")
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and ": user_id;" in warnings[0]  # the id stays sparse, named
    assert field(lines, "schema")[0].startswith("3 dense, 2 sparse; as given by data.dense")


def test_naming_the_sparse_columns_silences_the_warning(user_data, tmp_path: Path) -> None:
    lines = run_lines(user_data, tmp_path / "run", "data.sparse=[user_id,city]")
    assert not any(line.startswith("warning:") for line in lines)


def test_print_config_shows_the_full_config(user_data, tmp_path: Path) -> None:
    lines = run_lines(user_data, tmp_path / "run", "train.print_config=true", "data.shuffle_buffer=auto")
    assert lines.count("config:") == 1 and "  print_config: true" in lines
    # as it ran: data.shuffle_buffer=auto printed as the rows it resolved to (as config.yaml saves it)
    shown = [line for line in lines if line.startswith("  shuffle_buffer:")]
    assert len(shown) == 1 and shown[0].split(":")[1].strip().strip("'").isdigit(), shown


def test_many_integer_columns_keep_the_warning_to_one_short_line(tmp_path: Path) -> None:
    from data.schema import infer_schema
    from dlrm.train.header import integer_warning

    cols = {"label": np.zeros(4, np.float32), **{f"I{i}": np.ones(4, np.float32) for i in range(5)},
            **{f"C{i}": np.arange(4) for i in range(20)}}
    path = write_parquet(tmp_path / "f.parquet", cols)
    cfg = load_config(TINY, [])
    line = integer_warning(cfg, infer_schema([path]), path)
    assert line is not None and "\n" not in line and len(line) < 300
    assert "20 columns, C0, C1, C2, ..., C19" in line and "data.dense=[I0,...,I4,THOSE]" in line


def test_big_tables_say_they_are_being_initialised(user_data, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Filling tables of many GiB takes seconds to minutes before the header: one line
    says so, with the bytes of the tables line; a resume (tables loaded) does not."""
    from dlrm.train import trainer

    monkeypatch.setattr(trainer, "INIT_NOTE_BYTES", 1)
    lines = run_lines(user_data, tmp_path / "run")
    (tables,) = field(lines, "tables")
    size = tables.split(" = ")[1].split(" (")[0]
    assert f"initialising {size} of tables ..." in lines
    assert lines.index(f"initialising {size} of tables ...") < lines.index("tables   " + tables)
    resumed = run_lines(user_data, tmp_path / "run", "train.max_steps=2")
    assert not any(line.startswith("initialising") for line in resumed)
