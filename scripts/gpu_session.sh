#!/usr/bin/env bash
# Issue 16's GPU session in two commands, each within a 10-minute limit, with the
# machine's own python3 and torch (no .venv, no torchrec needed):
#
#   bash scripts/gpu_session.sh tests           # the gpu-marked tests (tests/test_gpu.py)
#   bash scripts/gpu_session.sh bench [ARGS]    # dlrm bench's GPU rows, configs/bench_gpu.yaml
#
# Everything worth keeping lands in $OUT (default ./gpu_out): env.txt (GPU, driver,
# torch, CUDA), test_gpu.log and .xml (every test's outcome and the worst relative
# differences it printed), bench.log, bench.json, bench.png and each row's training log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  nvidia-smi
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA")'
} >"$OUT/env.txt" 2>&1
case "${1:-tests}" in
  tests)
    # the gpu-marked tests, and the Triton kernels' own tests compiled on CUDA tensors
    # (in CI they run in the interpreter)
    timeout 570 "$PY" -m pytest tests -m "gpu or kernels" -rA -s --durations=30 --junitxml="$OUT/test_gpu.xml" \
      >"$OUT/test_gpu.log" 2>&1
    code=$?
    grep -E "worst relative|hotline timeline|PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/test_gpu.log" | tail -80
    exit $code
    ;;
  bench)
    shift
    BENCH=${BENCH:-/tmp/bench_gpu}  # data and runs stay off $OUT (GBs of checkpoints)
    timeout 580 "$PY" -m dlrm bench --config configs/bench_gpu.yaml \
      --engines native,hotline,host_embedding --out "$BENCH" "$@" >"$OUT/bench.log" 2>&1
    code=$?
    cp "$BENCH"/bench.json "$BENCH"/bench.png "$BENCH"/runs/*.log "$OUT"/ 2>/dev/null
    tail -40 "$OUT/bench.log"
    exit $code
    ;;
  *)
    echo "usage: $0 tests | bench [dlrm bench args]" >&2
    exit 2
    ;;
esac
