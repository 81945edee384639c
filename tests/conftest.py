"""Shared fixtures (small generated datasets, made once per test session), the
``gpu`` marker's skip without CUDA, and ``requires_torchrec``. Markers: see pyproject.toml.

Imports neither torchrec nor fbgemm_gpu: the suite runs on plain torch too (tests
that compare with TorchRec skip there)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dlrm.config import load_config

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
# `dlrm train` on 8 of configs/tiny.yaml's 26 tables (the last two multi-hot), for runs
# on the Triton kernels: interpreted, a kernel runs one program per lookup, so these
# runs take a third of the time (tests/test_hotline_graph.py: 220 s of CI with 26)
FEW_TABLES = "data.sparse=[C1,C2,C3,C4,C5,C6,C25,C26]"
SHARED_CRITEO = REPO.parent / "shared" / "data" / "criteo"

# Tests that run embeddings.backend=torchrec (found without importing either package).
requires_torchrec = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("torchrec", "fbgemm_gpu")),
    reason="needs torchrec and fbgemm_gpu",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` are skipped where CUDA is not available."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in gpu:
            item.add_marker(skip)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With DLRM_TEST_RECORD=PATH, one JSON line per test phase that failed and per
    test's call, appended as each ends: a run cut by a time limit (the GPU session's)
    still names what failed and why, and what took the time (under pytest-xdist the
    controller gets every worker's reports here)."""
    path = os.environ.get("DLRM_TEST_RECORD")
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or (report.when != "call" and not report.failed):
        return
    record = {"test": report.nodeid, "when": report.when, "outcome": report.outcome,
              "seconds": round(report.duration, 2)}
    if report.failed:
        record["error"] = report.longreprtext[-4000:]  # the traceback's end: the assertion
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def tiny_overrides(**extra: object) -> list[str]:
    """Overrides that make configs/tiny.yaml quick and quiet for tests."""
    base = {"train.progress": "false", "train.log_every": "10", "data.prefetch": "2"}
    base.update({k: str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Generated train (40k rows) and eval (10k rows) sets for configs/tiny.yaml."""
    from data.generate import generate_dataset

    root = tmp_path_factory.mktemp("tiny_data")
    cfg = load_config(TINY, ["generate.row_group_rows=4096", "generate.file_rows=15000"])
    generate_dataset(str(root / "train"), cfg.generate, seed=1, rows=40_000)
    generate_dataset(str(root / "eval"), cfg.generate, seed=2, rows=10_000)
    return {"train": root / "train", "eval": root / "eval"}


def _can_unshare() -> bool:
    """Root with ``unshare -m``: a test can give a process a file system of its own
    (another machine's disk at the same path, a small full disk)."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /mnt"],
                           capture_output=True, check=False)
    return probe.returncode == 0


needs_mount_namespace = pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare -m")
