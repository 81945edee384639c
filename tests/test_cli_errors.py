"""Every bad input a user can cause ends in one line naming the culprit, exit 2,
no traceback; nothing half-written is left behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlrm.cli import main
from tests.conftest import REPO, TINY, tiny_overrides

ROWS = 64


def good_columns(rng: np.random.Generator, n: int = ROWS) -> dict[str, pa.Array]:
    return {
        "label": pa.array(rng.integers(0, 2, n).astype(np.float32)),
        "x0": pa.array(rng.random(n).astype(np.float32)),
        "x1": pa.array(rng.random(n).astype(np.float32)),
        "c0": pa.array(rng.integers(0, 50, n), type=pa.int64()),
        "c1": pa.array([list(rng.integers(0, 20, k)) for k in rng.integers(0, 3, n)], type=pa.list_(pa.int64())),
    }


def write(path: Path, cols: dict[str, pa.Array], row_group_size: int = 16) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), path, row_group_size=row_group_size)
    return path


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


def train_argv(data: Path, run: Path, *extra: str) -> list[str]:
    return ["train", "--config", str(TINY), "--out", str(run), *tiny_overrides(),
            f"data.train={data}", "train.max_steps=2", "data.batch_size=16", *extra]


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def _bad(name: str, rng: np.random.Generator):
    cols = good_columns(rng)
    if name == "label_null":
        cols["label"] = pa.array([None] + [1.0] * (ROWS - 1), type=pa.float32())
        return cols, "label"
    if name == "label_range":
        cols["label"] = pa.array(np.full(ROWS, 2.0, dtype=np.float32))
        return cols, "label"
    if name == "dense_nan":
        x = np.ones(ROWS, dtype=np.float32)
        x[40] = np.nan
        cols["x1"] = pa.array(x)
        return cols, "x1"
    if name == "dense_inf":
        x = np.ones(ROWS, dtype=np.float32)
        x[3] = np.inf
        cols["x0"] = pa.array(x)
        return cols, "x0"
    if name == "negative_id":
        ids = np.arange(ROWS)
        ids[50] = -4
        cols["c0"] = pa.array(ids, type=pa.int64())
        return cols, "c0"
    if name == "mistyped":
        cols["x0"] = pa.array(["a"] * ROWS)
        return cols, "x0"
    raise AssertionError(name)


@pytest.mark.parametrize(
    "case", ["label_null", "label_range", "dense_nan", "dense_inf", "negative_id", "mistyped"]
)
def test_bad_values(case: str, tmp_path: Path, capsys) -> None:
    cols, column = _bad(case, np.random.default_rng(0))
    # Schema pinned by config so a mistyped column is an error, not "not a feature".
    f = write(tmp_path / "data" / f"{case}.parquet", cols)
    # identity: ids are rows, so a negative one is an error (auto gives it a vocabulary)
    code, err = run_cli(train_argv(f, tmp_path / "run", "data.dense=[x0,x1]", "data.sparse=[c0,c1]",
                                   "data.encoding=identity"), capsys)
    assert_one_line_error(code, err, f.name, repr(column))


def test_id_out_of_range_error_and_policies(tmp_path: Path, capsys) -> None:
    f = write(tmp_path / "d.parquet", good_columns(np.random.default_rng(1)))
    code, err = run_cli(train_argv(f, tmp_path / "run", "data.rows={c0: 10}"), capsys)
    assert_one_line_error(code, err, f.name, "'c0'", "row group")
    for policy in ("modulo", "hash"):
        code, err = run_cli(
            train_argv(f, tmp_path / f"run_{policy}", "data.rows={c0: 10}", f"data.id_policy={policy}"), capsys
        )
        assert code == 0, err


def test_dense_nan_zero_policy(tmp_path: Path, capsys) -> None:
    cols, _ = _bad("dense_nan", np.random.default_rng(2))
    f = write(tmp_path / "d.parquet", cols)
    code, err = run_cli(train_argv(f, tmp_path / "run", "data.dense_nan=zero"), capsys)
    assert code == 0, err


def test_missing_column(tmp_path: Path, capsys) -> None:
    f = write(tmp_path / "d.parquet", good_columns(np.random.default_rng(3)))
    code, err = run_cli(train_argv(f, tmp_path / "run", "data.dense=[x0,x9]"), capsys)
    assert_one_line_error(code, err, f.name, "x9")


def test_type_differs_between_files(tmp_path: Path, capsys) -> None:
    rng = np.random.default_rng(4)
    write(tmp_path / "data" / "a.parquet", good_columns(rng))
    cols = good_columns(rng)
    cols["c0"] = pa.array(np.arange(ROWS), type=pa.int64()).cast(pa.float64())
    b = write(tmp_path / "data" / "b.parquet", cols)
    code, err = run_cli(train_argv(tmp_path / "data", tmp_path / "run", "data.sparse=[c0,c1]",
                                   "data.dense=[x0,x1]"), capsys)
    assert_one_line_error(code, err, b.name, "c0")


def test_empty_dataset(tmp_path: Path, capsys) -> None:
    cols = {k: v.slice(0, 0) for k, v in good_columns(np.random.default_rng(5)).items()}
    f = write(tmp_path / "empty.parquet", cols)
    code, err = run_cli(train_argv(f, tmp_path / "run", "data.rows={c0: 5, c1: 5}"), capsys)
    assert_one_line_error(code, err, "empty")


def test_no_files(tmp_path: Path, capsys) -> None:
    code, err = run_cli(train_argv(tmp_path / "nothing_here", tmp_path / "run"), capsys)
    assert_one_line_error(code, err, "nothing_here")


@pytest.mark.parametrize("kind", ["truncated", "not_parquet"])
def test_broken_file(kind: str, tmp_path: Path, capsys) -> None:
    good = write(tmp_path / "src.parquet", good_columns(np.random.default_rng(6)))
    bad = tmp_path / "data" / "broken.parquet"
    bad.parent.mkdir()
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2] if kind == "truncated" else b"label,x0\n1,2\n")
    code, err = run_cli(train_argv(bad, tmp_path / "run"), capsys)
    assert_one_line_error(code, err, "broken.parquet")


@pytest.mark.parametrize(
    "override, needle",
    [("model.embedding_dimm=8", "model.embedding_dimm"), ("model.embedding_dim=big", "model.embedding_dim"),
     ("optim.sparse=lbfgs", "optim.sparse"), ("train=3", "train"),
     # YAML's flow mapping without the space after the colon: one key, named with the fix
     ("embeddings.plan={C1:{sharding:row_wise}}", "write 'sharding: row_wise', a space after the colon"),
     # the same in a mapping of values: it read "embeddings.dtypes.C1:bf16: None is not one of ..."
     ("embeddings.dtypes={C1:bf16}", ("embeddings.dtypes: YAML reads 'C1:bf16' as one key with no value: "
                                      "write 'C1: bf16', a space after the colon"))],
)
def test_bad_config(override: str, needle: str, tmp_path: Path, capsys) -> None:
    f = write(tmp_path / "d.parquet", good_columns(np.random.default_rng(7)))
    code, err = run_cli(train_argv(f, tmp_path / "run", override), capsys)
    assert_one_line_error(code, err, needle)


def test_hotline_on_the_torchrec_backend_is_refused(tmp_path: Path, capsys) -> None:
    """It profiled, printed the header, then died in an AttributeError at the first step."""
    f = write(tmp_path / "d.parquet", good_columns(np.random.default_rng(7)))
    code, err = run_cli(train_argv(f, tmp_path / "run", "embeddings.placement=hotline",
                                   "embeddings.backend=torchrec"), capsys)
    assert_one_line_error(code, err, "embeddings.backend='torchrec'", "embeddings.placement=hotline",
                          "embeddings.backend=native")
    assert not (tmp_path / "run").exists()


def test_triton_kernels_off_a_gpu_without_the_interpreter_are_refused(tmp_path: Path, capsys, monkeypatch) -> None:
    """The first launch died in triton's "0 active drivers" traceback, after the profile
    and the header; the tests' way (TRITON_INTERPRET=1) still trains."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    f = write(tmp_path / "d.parquet", good_columns(np.random.default_rng(7)))
    code, err = run_cli(train_argv(f, tmp_path / "run", "embeddings.kernels=triton",
                                   "embeddings.placement=hotline"), capsys)
    assert_one_line_error(code, err, "embeddings.kernels=triton", "TRITON_INTERPRET=1", "embeddings.kernels=auto")
    assert not (tmp_path / "run").exists()
    from embeddings.kernels import why_not_triton

    assert why_not_triton("auto", "cpu") is None and why_not_triton("torch", "cpu") is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert why_not_triton("triton", "cpu") is None


def test_missing_config_file(tmp_path: Path, capsys) -> None:
    code, err = run_cli(["train", "--config", str(tmp_path / "nope.yaml")], capsys)
    assert_one_line_error(code, err, "nope.yaml")


def test_incompatible_checkpoint_refused(tmp_path: Path, capsys) -> None:
    f = write(tmp_path / "d.parquet", good_columns(np.random.default_rng(8)))
    code, err = run_cli(train_argv(f, tmp_path / "run"), capsys)
    assert code == 0, err
    code, err = run_cli(train_argv(f, tmp_path / "run", "model.embedding_dim=8", "model.bottom_mlp=[8]"), capsys)
    assert_one_line_error(code, err, "checkpoint", "model.embedding_dim")


def test_corrupt_checkpoint_refused(tmp_path: Path, capsys) -> None:
    f = write(tmp_path / "d.parquet", good_columns(np.random.default_rng(9)))
    assert run_cli(train_argv(f, tmp_path / "run"), capsys)[0] == 0
    from dlrm.checkpoint.manager import find_checkpoint

    state = find_checkpoint(tmp_path / "run") / "state.pt"
    state.write_bytes(state.read_bytes()[:100])
    code, err = run_cli(["eval", "--checkpoint", str(tmp_path / "run"), "--data", str(f)], capsys)
    assert_one_line_error(code, err, "state.pt")


def test_eval_without_checkpoint(tmp_path: Path, capsys) -> None:
    f = write(tmp_path / "d.parquet", good_columns(np.random.default_rng(10)))
    code, err = run_cli(["eval", "--checkpoint", str(tmp_path), "--data", str(f)], capsys)
    assert_one_line_error(code, err, "no checkpoint")


@pytest.mark.slow
def test_real_process_exit_code_and_no_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm", "train", "--config", str(TINY), "--out", str(tmp_path / "run"),
         f"data.train={tmp_path}/none"],
        check=False, capture_output=True, text=True, cwd=REPO,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "none" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- config values
# (override, key named, value as printed): every kind of rule in dlrm/config_rules.py,
# the checks across keys, enums and types. Each must stop `dlrm train` at load.
BAD_VALUES = [
    ("model.embedding_dim=-4", "model.embedding_dim", "-4"),  # dims and sizes > 0
    ("model.embedding_dim=0", "model.embedding_dim", "0"),
    ("data.batch_size=0", "data.batch_size", "0"),
    ("data.rows={c0: 0}", "data.rows", "0"),
    ("generate.table_rows=[0]", "generate.table_rows", "[0]"),
    ("model.bottom_mlp=[]", "model.bottom_mlp", "[]"),  # MLP widths
    ("model.top_mlp=[64,-3,1]", "model.top_mlp", "-3"),
    ("model.top_mlp=[512,256,2]", "model.top_mlp", "[512, 256, 2]"),  # MLP ends
    ("model.bottom_mlp=[64,8]", "model.bottom_mlp", "[64, 8]"),
    ("optim.dense_lr=-1", "optim.dense_lr", "-1"),  # learning rates: finite, > 0
    ("optim.sparse_lr=0", "optim.sparse_lr", "0"),
    ("optim.dense_lr=.nan", "optim.dense_lr", "nan"),
    ("optim.eps=.inf", "optim.eps", "inf"),
    ("train.max_steps=-1", "train.max_steps", "-1"),  # steps, intervals: >= 0 (0 = off)
    ("train.checkpoint_every=-5", "train.checkpoint_every", "-5"),
    ("train.checkpoint_seconds=-1", "train.checkpoint_seconds", "-1"),
    ("optim.warmup_steps=-2", "optim.warmup_steps", "-2"),
    ("train.keep_checkpoints=0", "train.keep_checkpoints", "0"),  # counts >= 1
    ("train.accumulate=0", "train.accumulate", "0"),
    ("train.epochs=0", "train.epochs", "0"),
    ("hotline.profile_fraction=1.5", "hotline.profile_fraction", "1.5"),  # fractions in (0, 1]
    ("hotline.profile_fraction=0", "hotline.profile_fraction", "0"),
    ("hotline.budget=lots", "hotline.budget", "lots"),  # byte sizes
    ("embeddings.memory_per_rank=16XB", "embeddings.memory_per_rank", "16XB"),
    ("embeddings.plan={c0: {ranks: [-1]}}", "embeddings.plan.c0.ranks", "-1"),
    ("generate.table_rows=[10,20]", "generate.table_rows", "[10, 20]"),  # across keys
    ("generate.multi_hot=30", "generate.multi_hot", "30"),
    ("embeddings.placement=everywhere", "embeddings.placement", "everywhere"),  # enums
    ("embeddings.pooling=max", "embeddings.pooling", "max"),
    ("train.precision=fp8", "train.precision", "fp8"),
    ("train.precision_fallback=maybe", "train.precision_fallback", "maybe"),
    ("optim.dense=lamb", "optim.dense", "lamb"),
    ("data.label=[a,b]", "data.label", "['a', 'b']"),  # types (a column name is a string)
    ("data.train=[a,1]", "data.train", "['a', 1]"),  # paths: strings or a list of them
    ("data.shuffle=3", "data.shuffle", "3"),
]


@pytest.mark.parametrize("override, key, value", BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_bad_config_value(override: str, key: str, value: str, tmp_path: Path, capsys) -> None:
    """One line naming the key and its value, exit 2, before the run directory exists."""
    argv = ["train", "--config", str(TINY), "--out", str(tmp_path / "run"), *tiny_overrides(), override]
    code, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, f"config key {key}", value)
    assert not (tmp_path / "run").exists()


def test_every_bad_value_kind_is_refused_by_load_config() -> None:
    """The table above tells the shipped config from a broken one only by the override."""
    from dlrm.config import ConfigError, load_config

    load_config(TINY, tiny_overrides())
    for override, key, _ in BAD_VALUES:
        with pytest.raises(ConfigError, match=f"config key {key}"):
            load_config(TINY, [*tiny_overrides(), override])


# --------------------------------------------------------------------------- --out


@pytest.mark.parametrize("verb", ["train", "generate", "convert-criteo", "bench", "eval", "below_file"])
def test_out_is_a_file(verb: str, tmp_path: Path, capsys) -> None:
    """An output directory that names a file (or a path below one) is one line naming the flag."""
    taken = tmp_path / "taken"
    taken.write_text("not a directory\n")
    argv = {
        "train": ["train", "--config", str(TINY), "--out", str(taken)],
        "generate": ["generate", "--config", str(TINY), "--out", str(taken)],
        "convert-criteo": ["convert-criteo", str(tmp_path / "day_0"), "--out", str(taken)],
        "bench": ["bench", "--config", str(TINY), "--out", str(taken)],
        "eval": ["eval", "--checkpoint", str(tmp_path), "--data", str(tmp_path), "--plots", str(taken)],
        "below_file": ["train", "--config", str(TINY), "--out", str(taken / "run")],
    }[verb]
    code, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, "--plots" if verb == "eval" else "--out", str(taken))
    assert taken.read_text() == "not a directory\n"


# --------------------------------------------------------------------------- bf16


@pytest.mark.parametrize("fallback", ["fp32", "error", "none"])
@pytest.mark.parametrize("bf16_gflops", [2.5, 400.0])  # emulated bf16; native (faster than fp32)
def test_bf16_on_slow_hardware(fallback: str, bf16_gflops: float, tmp_path: Path, capsys,
                               monkeypatch) -> None:
    """Measured rates injected (this CPU: about 2.5 GFLOP/s bf16 against 180 fp32):
    slow bf16 trains in fp32 with one warning (fallback fp32), stops with one line
    (error) or stays bf16 (none); fast bf16 stays bf16. config.yaml says what ran."""
    import yaml

    from dlrm.train import precision

    monkeypatch.setattr(precision, "matmul_rates", lambda device: (bf16_gflops * 1e9, 180e9))
    f = write(tmp_path / "d.parquet", good_columns(np.random.default_rng(11)))
    argv = train_argv(f, tmp_path / "run", "train.precision=bf16", f"train.precision_fallback={fallback}")
    code = main(argv)
    out, err = capsys.readouterr()
    slow = bf16_gflops < 180
    if slow and fallback == "error":
        assert_one_line_error(code, err.strip(), "train.precision=bf16", "2.5 GFLOP/s", "180.0",
                              "train.precision_fallback")
        assert not (tmp_path / "run").exists()
        return
    assert code == 0, err
    warnings = [line for line in out.splitlines() if line.startswith("warning: train.precision=bf16")]
    ran = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["train"]["precision"]
    if slow and fallback == "fp32":
        assert len(warnings) == 1 and "2.5 GFLOP/s against 180.0" in warnings[0], out
        assert ran == "fp32"
    else:
        assert warnings == [] and ran == "bf16"


def _decide_on_rank(rank: int, world_size: int) -> tuple[str, list[str]]:
    """Rank 1 measures slow bf16, the others fast; the precision each rank chooses."""
    from dlrm.config import load_config
    from dlrm.parallel.distributed import DistInfo
    from dlrm.train import precision

    precision.matmul_rates = lambda device: (2.5e9 if rank == 1 else 400e9, 180e9)
    cfg = load_config(TINY, ["train.precision=bf16"])
    said: list[str] = []
    info = DistInfo(rank=rank, world_size=world_size, backend="gloo")
    return precision.decide_precision(cfg.train, info.device, info, said.append), said


@pytest.mark.distributed
def test_ranks_agree_on_the_precision() -> None:
    """One rank's slow bf16 moves every rank to fp32 (one precision per job); the
    warning names where it was measured."""
    from tests.multiprocess import run_ranks

    results = run_ranks(2, _decide_on_rank)
    assert [r[0] for r in results] == ["fp32", "fp32"]
    assert "another rank" in results[0][1][0] and "2.5 GFLOP/s against 180.0" in results[1][1][0]


@pytest.mark.parametrize("override, key", [
    ("data.encodings={x0: hash}", "data.encodings"),  # a dense column, not a sparse feature
    ("data.dense_transforms={c9: log1p}", "data.dense_transforms"),
    ("embeddings.plan={nope: {sharding: row_wise}}", "embeddings.plan"),
])
def test_config_names_a_column_the_data_lacks(override: str, key: str, tmp_path: Path, capsys) -> None:
    """A column or table named in the config that the data lacks is one line, not ignored;
    the same keys naming real ones train."""
    f = write(tmp_path / "d.parquet", good_columns(np.random.default_rng(12)))
    code, err = run_cli(train_argv(f, tmp_path / "run", override), capsys)
    assert_one_line_error(code, err, f"config key {key}", override.split("{")[1].split(":")[0])
    fixed = override.replace("x0", "c0").replace("c9", "x1").replace("nope", "c1")
    code, err = run_cli(train_argv(f, tmp_path / "run_fixed", fixed), capsys)
    assert code == 0, err


@pytest.mark.parametrize("overrides, column, words", [
    (["data.dense=[label,x0]"], "label", "data.dense names the label column"),
    (["data.sparse=[label,c0]"], "label", "data.sparse names the label column"),
    (["data.exclude=[label]"], "label", "data.exclude names the label column"),
    (["data.dense=[x0,c0]", "data.sparse=[c0,c1]"], "c0", "data.dense and data.sparse both name this column"),
])
def test_a_column_given_two_roles_is_one_line_saying_so(overrides: list[str], column: str, words: str,
                                                        tmp_path: Path, capsys) -> None:
    """The label named as a feature or left out said "column is missing" (it is not); a
    column named dense and sparse trained as both (2026-12-07)."""
    f = write(tmp_path / "d.parquet", good_columns(np.random.default_rng(12)))
    code, err = run_cli(train_argv(f, tmp_path / "run", *overrides), capsys)
    assert_one_line_error(code, err, f"column '{column}'", words)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("size", ["0", "-3"])
def test_eval_batch_size_below_one(size: str, tmp_path: Path, capsys) -> None:
    """--batch-size 0 was read as "not given"; now it is refused like -3, before any work."""
    code, err = run_cli(["eval", "--checkpoint", str(tmp_path), "--data", str(tmp_path),
                         "--batch-size", size], capsys)
    assert_one_line_error(code, err, f"--batch-size {size}")


def test_generate_zero_rows_is_refused(tmp_path: Path, capsys) -> None:
    """``--rows 0`` wrote no file, exited 0 and printed generate.rows' count (2026-12-07)."""
    code, err = run_cli(["generate", "--config", str(TINY), "--out", str(tmp_path / "g"), "--rows", "0"], capsys)
    assert_one_line_error(code, err, "--rows 0: must be >= 1")
    assert not (tmp_path / "g").exists()
