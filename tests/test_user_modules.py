"""A user's own ``data`` or ``embeddings`` module in the working directory does not
break ``python -m dlrm`` or ``torchrun -m dlrm``.

``-m`` puts the current directory first on ``sys.path``, and our sibling packages have
common names; ``dlrm/__main__.py`` takes that entry off. Each test runs the CLI in a
fresh process from a directory whose ``data`` and ``embeddings`` raise when imported.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY
from tests.multiprocess import free_port

RAISE = 'raise ImportError("the user\'s own {name} was imported instead of hybrid-dlrm\'s")\n'

# A directory cannot offer both a data.py and a data/ package: each gets its own.
USER_FILES = {
    "modules": {"data.py": "data", "embeddings.py": "embeddings"},
    "packages": {"data/__init__.py": "data", "embeddings/__init__.py": "embeddings"},
}


@pytest.fixture(params=sorted(USER_FILES))
def user_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A working directory holding the user's own ``data`` and ``embeddings``."""
    for rel, name in USER_FILES[request.param].items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(RAISE.format(name=name))
    return tmp_path


def _env() -> dict[str, str]:
    """This environment, minus what would hide the hazard (PYTHONPATH) or avoid it (-P)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _generate(cwd: Path) -> Path:
    _run([sys.executable, "-m", "dlrm", "generate", "--out", "gen", "--rows", "2000",
          "--config", str(TINY)], cwd)
    return cwd / "gen"


def _train_args(train: Path) -> list[str]:
    return ["train", "--config", str(TINY), "--out", "run", f"data.train={train}",
            "train.max_steps=3", "train.progress=false", "data.batch_size=128"]


def _summary(stdout: str) -> dict:
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return next(e for e in events if e.get("event") == "summary")


def test_dlrm_init_imports_nothing() -> None:
    """``python -m dlrm`` runs dlrm/__init__.py before __main__ mends sys.path: an import
    there would still find the user's modules."""
    tree = ast.parse((REPO / "dlrm" / "__init__.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def test_help(user_dir: Path) -> None:
    out = _run([sys.executable, "-m", "dlrm", "--help"], user_dir).stdout
    assert "dlrm generate" in out


@pytest.mark.slow
def test_generate_and_train(user_dir: Path) -> None:
    train = _generate(user_dir)
    proc = _run([sys.executable, "-m", "dlrm", *_train_args(train)], user_dir)
    assert _summary(proc.stdout)["steps"] == 3
    assert (user_dir / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_train(tmp_path: Path) -> None:
    (tmp_path / "data.py").write_text(RAISE.format(name="data"))
    (tmp_path / "embeddings").mkdir()
    (tmp_path / "embeddings" / "__init__.py").write_text(RAISE.format(name="embeddings"))
    train = _generate(tmp_path)
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    proc = _run([*launcher, "--nproc_per_node=2", f"--master_port={free_port()}", "-m", "dlrm",
                 *_train_args(train)], tmp_path)
    summary = _summary(proc.stdout)
    assert summary["steps"] == 3 and summary["world_size"] == 2
