"""Every Triton kernel specialization the kernels tests launch compiles for sm_90.

The kernels tests run the kernels in Triton's interpreter here; this runs the same
tests again under tests/compile_only.py, which compiles each launch to an H100 cubin
(ptxas included) instead of running it, and checks the record: every kernel family
compiled, none failed, no fp32 division or square root in their PTX is an approximate
one (the interpreter computes both exactly, so only the PTX shows it), and none spills
more than a few registers (ptxas's own report), at the widths runs use (64- and 128-wide
tiles) as well as the tests' narrow ones; with the venv's triton and the GPU machine's
3.6. What the interpreter cannot see (types the compiler enforces, ops the backend
lowers, a release's own compiler faults) is then caught here and not on the first GPU
that runs it.
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

SPILL_BYTES = 16  # a thread's spills at most: 4 registers

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels tests compile for real"),
    pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None, reason="needs triton"),
]


# The triton releases the kernels compile with: the venv's own (CI's interpreter), and the
# GPU machine's 3.6, which scripts/setup.sh puts in a folder of its own (the import path
# takes it first). 3.6 alone failed on the lookups' 64-wide tiles (embeddings/kernels/
# pooled.py, ``row_tile``).
GPU_TRITON = Path(sys.prefix) / "triton-3.6.0"  # sys.prefix: the venv running the tests


@pytest.mark.parametrize("release", ["venv", "3.6.0"])
def test_every_launched_specialization_compiles_for_sm90(tmp_path: Path, release: str) -> None:
    record = tmp_path / "compiled.json"
    path = [str(REPO)]
    if release != "venv":
        if not (GPU_TRITON / "triton").is_dir():
            pytest.skip(f"no triton {release} at {GPU_TRITON} (scripts/setup.sh installs it)")
        path.insert(0, str(GPU_TRITON))
    env = {**os.environ, "COMPILE_RECORD": str(record), "PYTHONPATH": os.pathsep.join(path)}
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
    # Resources, as ptxas reports them assembling each kernel: none spills more than a
    # few registers to local memory (a spilled tile is a round trip to memory per access,
    # in kernels bound by memory latency already; a 4-byte spill comes and goes with the
    # compiler's version), at the widths runs use too (the kernels tests' D = 64 and 100:
    # 64- and 128-wide tiles, beside the tests' 16-wide ones)
    assert all("registers" in e and "spill_stores" in e for e in compiled), "ptxas -v reported nothing"
    spills = sorted({(e["kernel"], e["spill_stores"], e["spill_loads"]) for e in compiled
                     if max(e["spill_stores"], e["spill_loads"]) > SPILL_BYTES})
    assert not spills, spills
    widths = {e["kernel"]: set() for e in compiled}  # each kernel's BLOCK_Ds compiled
    for e in compiled:
        names = list(e["signature"])  # a constexpr's key is "(its argument's index,)"
        named = {names[int(key.strip("(),"))]: value for key, value in e["constexprs"].items()}
        widths[e["kernel"]].add(int(named.get("BLOCK_D", 0)))
    wide = {"_pooled_kernel", "_runs_kernel", "_two_tier_kernel", "_patch_kernel", "_keep_kernel"}
    assert all({16, 64, 128} <= widths[k] for k in wide), {k: sorted(widths[k]) for k in wide}
    registers = {}
    for e in compiled:
        registers[e["kernel"]] = max(registers.get(e["kernel"], 0), e["registers"])
    version = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"], env=env,
                             capture_output=True, text=True, check=True).stdout.strip()
    assert release in ("venv", version), (release, version)
    print(f"triton {version}: {len(compiled)} specializations compiled to sm_90 cubins, none spilling over "
          f"{SPILL_BYTES} bytes; most registers a thread: "
          f"{', '.join(f'{k} {n}' for k, n in sorted(registers.items()))}")
