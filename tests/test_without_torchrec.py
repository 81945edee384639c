"""The native engine on plain torch: torchrec and fbgemm_gpu made unimportable.

Each run is a fresh interpreter whose ``sitecustomize`` puts an import blocker first
on ``sys.meta_path``: any import of ``torchrec*`` or ``fbgemm_gpu*`` fails as if the
package were not installed, and is written down. At exit every process (torchrun's
agent and each rank too) reports what was tried and what ended up in ``sys.modules``:

    python -m dlrm generate / train / eval        (blocker in every process)
        └─ atexit ─► BLOCK_REPORT/<pid>.json  {"tried": [...], "loaded": [...]}

A native run must succeed with both lists empty: nothing of ours even tried. Asking
for the TorchRec backend there is one line and exit 2. One more run, without the
blocker, shows under ``python -X importtime`` that the native path imports neither
package where both are installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY, tiny_overrides
from tests.multiprocess import free_port

pytestmark = pytest.mark.slow

BLOCKED = ("torchrec", "fbgemm_gpu")

SITECUSTOMIZE = '''
import atexit, json, os, sys

BLOCKED = ("torchrec", "fbgemm_gpu")
tried = []


class BlockTorchRec:
    """Fails every import of a BLOCKED package, as if it were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            tried.append(name)
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


sys.meta_path.insert(0, BlockTorchRec())


@atexit.register
def report():
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    path = os.path.join(os.environ["BLOCK_REPORT"], f"{os.getpid()}.json")
    with open(path, "w") as fh:
        json.dump({"argv": sys.argv, "tried": tried, "loaded": loaded}, fh)
'''


def blocked_env(tmp: Path) -> tuple[dict[str, str], Path]:
    """Environment whose Python processes run the blocker; the folder of their reports."""
    site, reports = tmp / "blocker", tmp / "reports"
    site.mkdir()
    reports.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "BLOCK_REPORT": str(reports), "OMP_NUM_THREADS": "1"}
    return env, reports


def run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=400, check=False)


def dlrm(verb: str, *args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    proc = run(["-m", "dlrm", verb, *args], env, cwd)
    assert proc.returncode == 0, f"dlrm {verb}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return proc


def assert_untouched(reports: Path, processes: int) -> None:
    """Every process reported, and none tried to import (or holds) a blocked package."""
    found = [json.loads(p.read_text()) for p in sorted(reports.glob("*.json"))]
    assert len(found) >= processes, f"{len(found)} reports, {processes} processes expected"
    for r in found:
        assert r["tried"] == [] and r["loaded"] == [], r


@pytest.fixture(scope="module")
def blocked_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Train and eval sets for configs/tiny.yaml, generated under the blocker."""
    root = tmp_path_factory.mktemp("no_torchrec_data")
    env, reports = blocked_env(root)
    for name, rows, seed in (("train", 6000, "1"), ("eval", 2000, "2")):
        dlrm("generate", "--out", str(root / name), "--rows", str(rows), "--config", str(TINY),
             "--seed", seed, env=env, cwd=root)
    assert_untouched(reports, 2)
    return root


def train_args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["--config", str(TINY), "--out", str(out), f"data.train={data / 'train'}",
            f"data.eval={data / 'eval'}", "data.batch_size=256", "train.max_steps=6",
            *tiny_overrides(), *extra]


def test_trains_and_evaluates_without_torchrec(blocked_data: Path, tmp_path: Path) -> None:
    env, reports = blocked_env(tmp_path)
    run_dir = tmp_path / "run"
    dlrm("train", *train_args(blocked_data, run_dir), env=env, cwd=tmp_path)
    out = dlrm("eval", "--checkpoint", str(run_dir), "--data", str(blocked_data / "eval"),
               env=env, cwd=tmp_path)
    metrics = json.loads(out.stdout.strip().splitlines()[-1])
    assert metrics["rows"] == 2000 and 0.0 <= metrics["auc"] <= 1.0
    assert_untouched(reports, 2)


def test_hotline_trains_without_torchrec(blocked_data: Path, tmp_path: Path) -> None:
    env, reports = blocked_env(tmp_path)
    dlrm("train", *train_args(blocked_data, tmp_path / "hot", "embeddings.placement=hotline",
                              "hotline.budget=64KB"), env=env, cwd=tmp_path)
    assert (tmp_path / "hot" / "hot_profile.pt").is_file()
    assert_untouched(reports, 1)


@pytest.mark.distributed
def test_two_ranks_train_without_torchrec(blocked_data: Path, tmp_path: Path) -> None:
    env, reports = blocked_env(tmp_path)
    args = ["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
            "-m", "dlrm", "train", *train_args(blocked_data, tmp_path / "tw2")]
    proc = run(args, env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_untouched(reports, 3)  # torchrun's agent and both ranks


def test_torchrec_backend_without_torchrec_is_one_line(blocked_data: Path, tmp_path: Path) -> None:
    env, _ = blocked_env(tmp_path)
    proc = run(["-m", "dlrm", "train", *train_args(blocked_data, tmp_path / "tr",
                                                   "embeddings.backend=torchrec")], env, tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("dlrm train: error: embeddings.backend=torchrec needs torchrec")


def test_native_train_imports_neither_package(blocked_data: Path, tmp_path: Path) -> None:
    """Without the blocker, where torchrec and fbgemm are installed: ``-X importtime``
    lists every module the process imported, and neither package is among them."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = run(["-X", "importtime", "-m", "dlrm", "train",
                *train_args(blocked_data, tmp_path / "run", "train.max_steps=2")], env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = [line.split("|")[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")]
    assert "dlrm.train.trainer" in imported  # the listing is there
    assert not [m for m in imported if m.split(".")[0] in BLOCKED]
