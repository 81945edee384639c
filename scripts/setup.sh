#!/usr/bin/env bash
# Creates .venv with the pinned stack. Idempotent: a second run only checks.
#
# Order matters: torch first (pinned, so nothing pulls a CUDA build), then the
# fbgemm build that matches it (CPU or CUDA, never both: they provide the same
# module), then torchrec with --no-deps (its metadata asks for the CUDA
# fbgemm-gpu, a 490 MB wheel that fails to load with CPU torch) plus the
# packages torchrec really needs. numpy goes in with torch, before anything imports
# torch: torch imported without numpy warns "Failed to initialize NumPy".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
STAMP="$VENV/.setup-done"
if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt scripts/setup.sh ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip install -q --disable-pip-version-check"
$PIP "torch==2.13.0" numpy
if "$VENV/bin/python" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)'; then
  FBGEMM=fbgemm-gpu; OTHER=fbgemm-gpu-cpu
else
  FBGEMM=fbgemm-gpu-cpu; OTHER=fbgemm-gpu
fi
"$VENV/bin/python" -m pip uninstall -q -y "$OTHER" 2>/dev/null || true
$PIP "$FBGEMM==1.8.0"
$PIP --no-deps "torchrec==1.8.0"
$PIP tensordict "torchmetrics==1.0.3" tqdm pyre-extensions
$PIP -e ".[test]"
# triton 3.6, the GPU machine's (beside the venv's 3.9, whose interpreter the kernels'
# tests need), in a folder of its own: tests/test_kernels_compile.py compiles every
# kernel with both. 3.6 alone failed to compile the lookups' 64-wide tiles (D = 64) and
# nothing but a GPU session would have said so. Only where torch is a CPU build: on a
# GPU the kernels tests compile for real, with the machine's triton.
if [ "$FBGEMM" = fbgemm-gpu-cpu ] && [ ! -d "$VENV/triton-3.6.0/triton" ]; then
  $PIP --no-deps --target "$VENV/triton-3.6.0" "triton==3.6.0"
fi
"$VENV/bin/python" -c 'import torch, fbgemm_gpu, torchrec; print("setup ok: torch", torch.__version__)'
touch "$STAMP"
