"""Every Triton kernel specialization the kernels tests launch compiles for sm_90.

The kernels tests run the kernels in Triton's interpreter here; this runs the same
tests again under tests/compile_only.py, which compiles each launch to an H100 cubin
(ptxas included) instead of running it, and checks the record: every kernel family
compiled, none failed, and no fp32 division or square root in their PTX is an
approximate one (the interpreter computes both exactly, so only the PTX shows it). What the interpreter cannot see (types the compiler enforces,
ops the backend lowers) is then caught here and not on the first GPU that runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
KERNELS = {"_pooled_kernel", "_runs_kernel", "_segments_kernel", "_linearize_kernel", "_round_kernel",
           "_two_tier_kernel", "_patch_kernel", "_keep_kernel"}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels tests compile for real"),
    pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None, reason="needs triton"),
]


def test_every_launched_specialization_compiles_for_sm90(tmp_path: Path) -> None:
    record = tmp_path / "compiled.json"
    env = {**os.environ, "COMPILE_RECORD": str(record), "PYTHONPATH": str(REPO)}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.compile_only", "-m", "kernels", "-q",
         "-p", "no:cacheprovider", "-o", "addopts=", "tests/test_kernels_pooled.py",
         "tests/test_kernels_update.py", "tests/test_kernels_rounding.py",
         "tests/test_kernels_collection.py", "tests/test_kernels_overflow.py",
         "tests/test_hotline_kernels.py", "tests/test_hotline_kernels_half.py", "tests/test_dtype_stacks.py",
         "tests/test_kernels_two_tier.py", "tests/test_kernels_stage_rows.py", "tests/test_hotline_cold_stage.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1200, check=False)
    assert record.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    compiled = json.loads(record.read_text())
    failed = [e for e in compiled if "error" in e]
    assert not failed, "\n\n".join(f"{e['kernel']} {e['constexprs']}:\n{e['error']}" for e in failed)
    assert {e["kernel"] for e in compiled} == KERNELS
    assert all("cubin" in e["stages"] for e in compiled)
    # Triton's ``/`` and ``tl.sqrt`` are approximate on a GPU; torch's and the CPU's are
    # IEEE's: the kernels use tl.div_rn / tl.sqrt_rn (embeddings/kernels/sparse_update.py)
    approximate = {(e["kernel"], op) for e in compiled for op in e["approximate"]}
    assert not approximate, sorted(approximate)
    print(f"{len(compiled)} specializations compiled to sm_90 cubins "
          f"({', '.join(sorted(KERNELS))})")
