"""A pytest plugin that compiles the Triton kernels for an H100 without a GPU.

    python -m pytest -p tests.compile_only -m kernels tests    (COMPILE_RECORD=FILE)

CI runs the kernels in Triton's interpreter, which checks their arithmetic but not
what only the compiler checks: a loop-carried variable whose type changes, branches
of a runtime ``if`` that disagree in type, an op the NVIDIA backend cannot lower,
an unsupported ``tl`` call. Under this plugin every launch the kernels tests make is
compiled instead, through the real pipeline (TTIR, TTGIR, LLVM IR, PTX, then ptxas,
which triton's wheel carries, to a cubin) for ``sm_90`` (H100/H200), and not run: a
fake active driver answers the target, and each launch becomes a warm-up. The tests'
own assertions then fail (nothing was computed); what counts is the record written
at the end, one entry per compiled specialization: kernel, constexprs, signature,
and the compiler's error where it failed (tests/test_kernels_compile.py reads it).

It reaches into ``triton.runtime.jit.JITFunction`` (``run``, ``_do_compile``: the same
signatures in triton 3.6, the GPU machine's, and 3.9, CI's): a test tool, not a path
of the engine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import traceback
from typing import Any

# Compiled, not interpreted: set before kernel_cases (setdefault "1") or triton are imported.
os.environ["TRITON_INTERPRET"] = "0"

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)  # Hopper: the lent H100 and H200
RECORD: list[dict[str, Any]] = []


class _NoLaunch:
    def load_binary(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("compile_only: kernels are compiled, never loaded")


class CompileOnlyDriver:
    """The active driver's answers that compiling needs: the target, device 0."""

    utils = _NoLaunch()

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        pass

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


APPROXIMATE = ("div.full.f32", "div.approx", "sqrt.approx")  # PTX ops: sqrt.approx.ftz.f32, rsqrt.approx...
_run = JITFunction.run
_do_compile = JITFunction._do_compile


def _recorded_compile(self, key, signature, device, constexprs, options, attrs, warmup):
    entry: dict[str, Any] = {"kernel": self.fn.__name__,
                             "constexprs": {str(k): repr(v) for k, v in constexprs.items()},
                             "signature": {k: str(v) for k, v in signature.items()}}
    RECORD.append(entry)
    try:
        kernel = _do_compile(self, key, signature, device, constexprs, options, attrs, warmup)
    except Exception as e:
        entry["error"] = "".join(traceback.format_exception_only(type(e), e))[-4000:]
        raise
    entry["stages"] = sorted(kernel.asm)
    # fp32 divisions and square roots not rounded as IEEE's (torch's, the CPU's)
    ptx = kernel.asm.get("ptx", "")
    entry["approximate"] = sorted({op for op in APPROXIMATE if op in ptx})
    entry.update(resource_usage(ptx))
    return kernel


def resource_usage(ptx: str) -> dict[str, int]:
    """Registers a thread, and bytes of stack frame and of register spills (stores and
    loads to local memory), as ptxas itself reports them (``-v``) assembling ``ptx``
    for its own target with the ptxas triton compiled it with: a kernel that spills, or
    whose registers cap its occupancy, shows here before any GPU runs it."""
    from triton.backends.nvidia.compiler import get_ptxas

    target = re.search(r"^\.target (sm_\w+)", ptx, re.MULTILINE)
    if target is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        command = [get_ptxas(TARGET.arch).path, "-v", f"--gpu-name={target[1]}", src,
                   "-o", os.path.join(tmp, "kernel.cubin")]
        report = subprocess.run(command, capture_output=True, text=True, check=False)
    text = report.stdout + report.stderr
    found = {"registers": r"Used (\d+) registers", "stack": r"(\d+) bytes stack frame",
             "spill_stores": r"(\d+) bytes spill stores", "spill_loads": r"(\d+) bytes spill loads"}
    return {name: int(m[1]) for name, pattern in found.items() if (m := re.search(pattern, text))}


def _compile_not_launch(self, *args, grid, warmup, **kwargs):
    return _run(self, *args, grid=grid, warmup=True, **kwargs)


def pytest_configure(config) -> None:
    driver.set_active(CompileOnlyDriver())
    JITFunction._do_compile = _recorded_compile
    JITFunction.run = _compile_not_launch


def pytest_sessionfinish(session, exitstatus) -> None:
    path = os.environ.get("COMPILE_RECORD")
    if path:
        with open(path, "w") as f:
            json.dump(RECORD, f, indent=1)
