#!/usr/bin/env bash
# The GPU session in two commands, each within a 10-minute limit, with the machine's
# own python3 and torch (no .venv, no torchrec needed):
#
#   bash scripts/gpu_session.sh tests           # gpu- and kernels-marked tests, then the
#                                               # reader at data.workers 0,1,4,8,16 (issue 23)
#                                               # and, if a minute is left, the vocabulary
#                                               # fit at data.fit_workers 0,1,4,8,16 (issue 26)
#   bash scripts/gpu_session.sh bench [ARGS]    # dlrm bench's GPU rows, configs/bench_gpu.yaml
#
# bench, in order, each step given what is left of the call's 580 s: the rows native
# (fp32 tables, TF32 on by train.tf32), native_bf16_tables and native_fp16_tables (the
# same with every table in bf16 / fp16: issue 24's GPU speed target, printed as samples/s
# and table bytes over native's), in_memory (native on batches kept on the GPU),
# native_bf16 (bf16 MLPs), torch_baseline, hotline, host_embedding;
# the embedding kernels alone (python -m dlrm.bench.kernels: bytes/s per path);
# native with train.tf32=false; native with train.cuda_graphs=off; a hotline.budget sweep
# (64MB 128MB 512MB 2GB: hit rate, popular share, samples/s; --hotline-budgets).
# tests includes tests/test_sync_audit.py's gpu case (set_sync_debug_mode("error")
# over steady-state steps, op count printed).
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
    # (in CI they run in the interpreter); then, in what is left of the call, the
    # reader's rows/s at data.workers 0,1,4,8,16 (issue 23: $OUT/reader.json)
    end=$((SECONDS + 575))
    timeout 450 "$PY" -m pytest tests -m "gpu or kernels" -rA -s --durations=30 --junitxml="$OUT/test_gpu.xml" \
      >"$OUT/test_gpu.log" 2>&1
    code=$?
    grep -E "worst relative|hotline timeline|ops per step|PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/test_gpu.log" | tail -80
    BENCH=${BENCH:-/tmp/bench_reader}
    timeout $((end - SECONDS > 10 ? end - SECONDS : 10)) "$PY" -m dlrm bench --config configs/bench_gpu.yaml \
      --reader-only --workers 0,1,4,8,16 --out "$BENCH" generate.rows=2097152 >"$OUT/reader.log" 2>&1
    cp "$BENCH"/bench.json "$OUT"/reader.json 2>/dev/null
    tail -10 "$OUT/reader.log"  # rates, cold read, per-worker rows/s and 0.8·N scaling
    # the vocabulary pass's rows/s at data.fit_workers 0,1,4,8,16 (issue 26: $OUT/fit.json),
    # rates only, if a minute is left (8M rows of bench_gpu's schema: about 4 s one
    # process; each row also printed with the workers' start-up, timed alone, taken out)
    if [ $((end - SECONDS)) -gt 60 ]; then
      timeout $((end - SECONDS)) "$PY" -m dlrm bench --config configs/bench_gpu.yaml --fit-only \
        --fit-workers 0,1,4,8,16 --fit-rows 8388608 --no-fit-memory --out /tmp/bench_fit \
        >"$OUT/fit.log" 2>&1
      cp /tmp/bench_fit/bench.json "$OUT"/fit.json 2>/dev/null
      tail -7 "$OUT/fit.log"
    fi
    exit $code
    ;;
  bench)
    shift
    BENCH=${BENCH:-/tmp/bench_gpu}  # data and runs stay off $OUT (GBs of checkpoints)
    end=$((SECONDS + 580))
    left() { echo $((end - SECONDS > 5 ? end - SECONDS : 5)); }
    timeout "$(left)" "$PY" -m dlrm bench --config configs/bench_gpu.yaml \
      --engines native,native_bf16_tables,native_fp16_tables,in_memory,native_bf16,torch_baseline,hotline,host_embedding \
      --out "$BENCH" "$@" \
      >"$OUT/bench.log" 2>&1
    code=$?
    cp "$BENCH"/bench.json "$BENCH"/bench.png "$OUT"/ 2>/dev/null
    {
      echo "== embedding kernels alone"
      timeout "$(left)" "$PY" -m dlrm.bench.kernels --config configs/bench_gpu.yaml
      echo "== native, train.tf32=false"
      mkdir -p "$BENCH/fp32" && ln -sfn "$BENCH/data" "$BENCH/fp32/data"  # the same data, not regenerated
      timeout "$(left)" "$PY" -m dlrm bench --config configs/bench_gpu.yaml --engines native \
        --out "$BENCH/fp32" "$@" train.tf32=false | tail -8
      echo "== native, train.cuda_graphs=off (the main rows replay a captured step where they can)"
      mkdir -p "$BENCH/eager" && ln -sfn "$BENCH/data" "$BENCH/eager/data"
      timeout "$(left)" "$PY" -m dlrm bench --config configs/bench_gpu.yaml --engines native \
        --out "$BENCH/eager" "$@" train.cuda_graphs=off | tail -8
      echo "== hotline.budget sweep"
      mkdir -p "$BENCH/budgets" && ln -sfn "$BENCH/data" "$BENCH/budgets/data"
      timeout "$(left)" "$PY" -m dlrm bench --config configs/bench_gpu.yaml --engines hotline \
        --hotline-budgets 64MB,128MB,512MB,2GB --out "$BENCH/budgets" "$@" | tail -14
      cp "$BENCH"/budgets/bench_budgets.png "$OUT"/ 2>/dev/null
    } >"$OUT/bench_extra.log" 2>&1
    tar czf "$OUT/runs.tgz" -C "$BENCH" --exclude='checkpoints' runs 2>/dev/null
    tail -40 "$OUT/bench.log"
    tail -40 "$OUT/bench_extra.log"
    exit $code
    ;;
  *)
    echo "usage: $0 tests | bench [dlrm bench args]" >&2
    exit 2
    ;;
esac
