"""A run trained on the Triton kernels (``embeddings.kernels=triton``) scored where they
cannot run: ``dlrm eval --device cpu`` without a GPU (and without TRITON_INTERPRET) takes
the torch kernels with one note line, and its metrics equal the run's own end-of-run
eval, scored in memory by the model that trained, on the Triton kernels (interpreted
on a CPU machine, compiled on a GPU one). Training keeps refusing the forced kernels
there; a resume that names torch kernels is accepted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernel_cases import DEVICE  # sets TRITON_INTERPRET=1 without a GPU

pytest.importorskip("triton")

from dlrm.config import ConfigError, load_config
from dlrm.eval.export import export_run
from dlrm.train.trainer import train
from tests.conftest import REPO, TINY, tiny_overrides
from tests.data_helpers import tiny_dataset

pytestmark = pytest.mark.kernels

# Tiny: every launch is interpreted on a CPU machine (each program a Python loop).
STEPS = ("train.max_steps=3", "data.batch_size=32", "data.eval_batch_size=64")
# The run's own eval ran where it trained: on a CPU machine the same float32 CPU
# arithmetic as the eval here (1e-6); on a GPU cuBLAS and the compiled kernels sum in
# another order (the 2026-11-26 H200 run: logloss 5.6e-6 apart over 64 rows).
TOL = 1e-6 if DEVICE.type == "cpu" else 5e-5


@pytest.fixture(scope="module")
def triton_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """(run, eval file, the run's summary) of a run trained on the Triton kernels."""
    root = tmp_path_factory.mktemp("triton_run")
    (root / "train").mkdir()
    (root / "eval").mkdir()
    train_files, _ = tiny_dataset(root / "train", file_rows=(96,), table_rows=20, seed=3)
    eval_files, _ = tiny_dataset(root / "eval", file_rows=(64,), table_rows=20, seed=4)
    cfg = load_config(TINY, [*tiny_overrides(), f"data.train={train_files[0]}", f"data.eval={eval_files[0]}",
                             *STEPS, "embeddings.kernels=triton", f"train.device={DEVICE.type}"])
    summary = train(cfg, root / "run", echo=lambda s: None)
    return root / "run", Path(eval_files[0]), summary


def _eval_without_the_interpreter(*argv: list[str]) -> tuple[list[dict], str]:
    """``dlrm eval`` of each argv in one fresh process where triton is not interpreted:
    the metrics printed, and stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    calls = "; ".join(f"main({list(a)!r})" for a in argv)
    proc = subprocess.run([sys.executable, "-c", f"from dlrm.cli import main; {calls}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")], proc.stderr


def test_a_triton_run_is_scored_on_the_torch_kernels_off_a_gpu(triton_run, tmp_path: Path) -> None:
    run, eval_file, summary = triton_run
    export = tmp_path / "serving"
    export_run(run, export, tables="stored")  # reads the run: no lookup, no kernel
    results, err = _eval_without_the_interpreter(
        ["eval", "--checkpoint", str(run), "--data", str(eval_file), "--device", "cpu"],
        ["eval", "--checkpoint", str(export), "--data", str(eval_file), "--device", "cpu"])
    assert len(results) == 2
    for result in results:  # the run's own eval ran the Triton kernels on the trained model
        assert result["rows"] == summary["eval_rows"] == 64
        assert result["auc"] == pytest.approx(summary["eval_auc"], abs=TOL)
        assert result["logloss"] == pytest.approx(summary["eval_logloss"], abs=TOL)
    notes = [line for line in err.splitlines() if line.strip()]
    assert len(notes) == 2, err  # one line for each eval, nothing else
    for note in notes:
        assert note.startswith("note: the run's embeddings.kernels=triton cannot run here (cpu"), note
        assert "torch kernels" in note


def test_training_refuses_the_forced_kernels_but_resumes_on_torch(triton_run, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel choice is no part of the resume's compatibility check: only where
    the forced Triton kernels cannot run is the run refused, before anything is written."""
    run = shutil.copytree(triton_run[0], tmp_path / "run")  # the first test's run stays as trained
    overrides = [*tiny_overrides(), *STEPS, "train.device=cpu", "data.eval=", "train.max_steps=5"]
    cfg = load_config(run / "config.yaml", overrides)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # set only without a GPU
    before = sorted(p.name for p in run.rglob("*"))
    with pytest.raises(ConfigError, match="embeddings.kernels=triton"):
        train(cfg, run, echo=lambda s: None)
    assert sorted(p.name for p in run.rglob("*")) == before
    resumed = train(load_config(run / "config.yaml", [*overrides, "embeddings.kernels=torch"]), run,
                    echo=lambda s: None)
    assert (resumed["steps"], resumed["trained_steps"]) == (5, 2)
