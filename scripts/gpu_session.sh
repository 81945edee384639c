#!/usr/bin/env bash
# The GPU session in two calls of the device tool, sized for its budget: 15 minutes of
# device time for the whole session, the machine's start (1-2 min) and idle time
# counted in. With the machine's own python3 and torch (no .venv, no torchrec):
#
#   bash scripts/gpu_session.sh tests   # run with timeout_s=270: at most 250 s
#   bash scripts/gpu_session.sh bench   # then at once (warm machine), timeout_s=440: 420 s
#
# The device's copy of the tree has no .git: prefix each call with the commit,
# DLRM_COMMIT=<git rev-parse --short HEAD here> bash scripts/gpu_session.sh ..., so
# env.txt and every bench.json (ran_on) name it.
#
# Together about 12 of the 15 minutes; the rest is the start and the transfers. Each
# call does its most important step first and gives every later step what is left
# (SECONDS_BUDGET overrides a call's seconds), so a slow step costs the extras, never
# the call. Everything worth keeping lands in $OUT (default ./gpu_out) as each step
# ends, and each step's key lines are printed (the tool returns the output's tail).
#
# tests, in order:
#   1. first, up to 65 s, the Triton kernels' own tests (tests/test_kernels_*.py; compiled
#      for the first time on the 2026-11-27 H200: 20 s, 14 test faults, fixed since),
#      then up to 110 s the GPU tests of code no GPU has run yet or that failed on the
#      last one (NEW_TESTS, a -k expression over the files in NEW_FILES), spread over
#      12 pytest-xdist processes where xdist is installed (the image has it). Each test's
#      outcome and time go to $OUT/test_gpu.jsonl as it ends (a cut run still names its
#      failures), summed up in the output
#   2. up to 100 s the reader's rows/s at data.workers 0,4,16 (issue 23: $OUT/reader.json),
#      with data.shuffle_buffer=65536 (READER_WINDOW): 16 windows in the 1,048,576 rows, the
#      set copied until an epoch holds 8 windows a worker (dlrm/bench/reader_sweep.py).
#      2026-11-27 H200: steady 4 workers 2.52x, 16 workers 4.81x one core's rate;
#      2026-11-28 H200 (53f03e8): 2.36x, 4.64x, the taking thread 0.479 ms of CPU a batch
#      (16 workers 54% busy: it bounds them), its pinned copy four allocations and copies
#      then; 6db8c5d: 5.32x, 0.384 ms, one copy; the slots registered with CUDA since, no
#      copy. Then, where 120 s are left, 16 workers with each batch copied out of its slot
#      as before (DLRM_SHM_PIN=0)
#   3. the vocabulary fit at data.fit_workers 0,16 (issue 26: $OUT/fit.json), up to 40 s;
#      then the other gpu- and kernels-marked tests (tests/test_gpu.py's CUDA-equals-CPU
#      matrix is most of it: ~40 s a case) in what is left, and the failures alone,
#      again, one process, so a failure caused by the sharing is told from a real one
#      ($OUT/test_gpu.log, test_gpu_rerun.log)
# bench (configs/bench_gpu.yaml: 26 Criteo-Kaggle-sized tables, 8.6 GB fp32, 100 steps
# of 4096), in order:
#   1. the rows the open issues are judged by, each printed as it ends: native (fp32
#      tables), hotline (on a GPU its whole step captured: hotline.graph_step=auto, the
#      default since the 2026-11-27 H200 measured 1.84x the eager step), hotline_eager
#      (graph_step=off), host_embedding (captured too) (issue 22: hotline / host_embedding
#      >= 2x, hotline / native >= 0.8x), native_bf16_tables and hotline_bf16_tables
#      (issue 24: each over its fp32 row; Hotline's budget then holds twice the rows),
#      in_memory (issue 23: native / in_memory >= 0.95), hotline_in_memory (Hotline on
#      batches kept in host memory: what the reader's thread and workers cost the step
#      loop; hotline / hotline_in_memory printed)                  ($OUT/bench.json);
#      each captured row's step mode says its replays' GPU time (graphs.ReplayTimer,
#      since 2026-11-27): beside the step's wall time, device- or host-bound
#   2. in this order, each in what the call has left: hotline and hotline_bf16_tables
#      with the cold rows read in place (hotline.cold_path=mapped), the hotline.budget
#      sweep at 64MB, 512MB and 2GB, host_embedding read in place too (the baseline
#      as strong as mapped makes it), hotline with the gather on the step loop
#      (hotline.pipeline=false), hotline with the workers' batches taken on the step loop
#      (DLRM_TAKE_THREAD=0), a helper thread beside a loop of small torch ops
#      (dlrm.bench.gil_handoff), hotline with the GIL switch interval at 0.1 ms (the main
#      rows: 0.5), hotline with torch's intra-op threads at 1 (train.threads=1; the main
#      rows: a thread a core), hotline's step loop
#      under cProfile (train.profile_mode=python: where its host time goes,
#      $OUT/hostprof.txt), native's and hotline's steps under torch.profiler (their
#      kernels' GPU time, $OUT/kprof-*.txt), the embedding kernels alone (python -m
#      dlrm.bench.kernels: eager and graph-replayed, and the run segment at 16), hotline
#      with a refresh every 30 steps (issue 22: the refresh's pause), hotline and
#      host_embedding with the gather before (hotline.gather_threads=0: torch's 16
#      intra-op threads beside 15 decode workers), hotline's gather on 4 threads of ours,
#      the host gather alone, hotline and hotline_bf16_tables with the cold update before
#      (hotline.cold_update=host), native with optim.dense=adagrad (the default),
#      native_fp16_tables and torch_baseline
# Rows that fail are listed and the others still run (dlrm bench --keep-going).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
PY=${PY:-python3}
CONFIG=${CONFIG:-configs/bench_gpu.yaml}  # a dry run elsewhere: a small config
# the GPU tests of code changed since the last GPU run (all 30 of the list before passed
# on the 2026-11-28 H200 at 53f03e8): the Triton kernels' blocked launches, run heads and
# segment tiles since (the kernels' own tests run first, compiled), so the whole
# CUDA-equals-CPU matrix (fused or not, both run the Triton backward) and every static
# Hotline step: 43 tests, ~100 s over 12 processes. Before f00af98 triton 3.6 could not
# compile those lookups at D = 64 (bench_gpu's): every bench row would have failed at
# its first step; tests/test_kernels_compile.py now compiles with 3.6 here, without a GPU.
# Since 2026-11-28's evening: the reader's pinned batches made by numpy's copies
# (data/pinned.py; in the reader's thread and from decode workers' slots), 3 tests.
# Since 2026-11-28's night: the split graphs replay on after a refresh that keeps the hot
# tensors (no capture): static_hotline's refresh test trains through them on a GPU; a
# refresh's entering rows pinned on the planner thread, its index tensors kept on the
# device (hotline_on_cuda, splits_and_dense and static_hotline refresh)
# and the refresh window fed the split's stacked ids, copied out of the split graphs'
# buffers (window_on_cuda_counts_through_split_graphs)
# Since 2026-12-07: hotline.cold_path=mapped, the tables registered with CUDA and read in
# place (reads_the_host_rows_in_place, reads_its_cold_rows_in_place; the static steps'
# write-back case in update_their_cold_rows)
NEW_TESTS=${NEW_TESTS:-"reads_the_host_rows_in_place or reads_its_cold_rows_in_place or update_their_cold_rows or cold_update_host or static_hotline or static_step_with_no_hot_row or cuda_equals_cpu or hotline_on_cuda or splits_and_dense or graph_replayed or gather_and_copy_hidden or hands_out_pinned or pin_memory_is_pinned or one_copy_of_one_block or registered_slots or window_on_cuda_counts_through_split_graphs"}
NEW_FILES=${NEW_FILES:-"tests/test_gpu.py tests/test_hotline_graph.py tests/test_device_prefetch.py tests/test_pinned.py tests/test_hotline_access_window.py tests/test_hotline_mapped.py"}
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  nvidia-smi
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA")'
  "$PY" -c 'import triton; print("triton", triton.__version__)'
  # half tables' host-side rounding (Hotline's cold tier) is numba-compiled where numba
  # imports, else torch ops ~7x slower (embeddings/rounding.py): hotline_bf16_tables' 0.864x
  # of fp32 at 153cd2f would be that if numba is missing (the image list of 2026-11-17 has it)
  "$PY" -c 'import numba; print("numba", numba.__version__)' 2>/dev/null || echo "numba none"
  # cores as the reader's and the fit's scaling targets count them (16 vCPUs may be 8 cores
  # x 2 threads), and the shared memory the decode workers' slots live in
  echo "cpus $(nproc) | $(lscpu 2>/dev/null | grep -E '^(Model name|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\))' | tr -s ' ' | paste -sd '|')"
  echo "shm $(df -h /dev/shm 2>/dev/null | tail -1)"
  # the host tier's tables are advised onto 2 MiB pages (embeddings/huge_pages.py): THP
  # "never" leaves the cold gather a TLB miss a row; the Hotline line says what it got
  echo "thp $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null) defrag $(cat /sys/kernel/mm/transparent_hugepage/defrag 2>/dev/null) | $(grep -E '^(MemFree|AnonHugePages)' /proc/meminfo | tr -s ' ' | paste -sd ' ')"
  git log -1 --format='commit %H %s' 2>/dev/null || echo "commit ${DLRM_COMMIT:-unknown: call with DLRM_COMMIT=\$(git rev-parse --short HEAD) from the checkout}"
} >"$OUT/env.txt" 2>&1
grep -E "^(python|triton|numba|commit|cpus|shm|thp)|NVIDIA H" "$OUT/env.txt"

mode=${1:-tests}
[ $# -gt 0 ] && shift
case "$mode" in
  tests) budget=${SECONDS_BUDGET:-250} ;;
  bench) budget=${SECONDS_BUDGET:-420} ;;
  *) echo "usage: $0 tests | bench [dlrm bench overrides]" >&2; exit 2 ;;
esac
end=$((SECONDS + budget))
left() { echo $((end - SECONDS > 5 ? end - SECONDS : 5)); }
# at most $1 seconds, and never past the call's end
upto() { local l; l=$(left); echo $(($1 < l ? $1 : l)); }

# what the tests' record (tests/conftest.py: DLRM_TEST_RECORD) says so far: counts, each
# failure with its error's last lines, the slowest tests (it is written as tests end, so
# a run cut by its time limit still says what failed and what took the time)
record_summary() {
  "$PY" - "$1" <<'PYEOF'
import json, os, sys
rows = [json.loads(line) for line in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []
calls = [r for r in rows if r["when"] == "call"]
failed = [r for r in rows if r["outcome"] == "failed"]
print(f"record: {sum(r['outcome'] == 'passed' for r in calls)} passed, {len(failed)} failed, "
      f"{sum(r['outcome'] == 'skipped' for r in calls)} skipped of {len(calls)} run")
for r in failed[:25]:
    tail = [line for line in r["error"].splitlines() if line.strip()][-3:]
    print(f"FAILED {r['test']} ({r['when']}): " + " | ".join(t.strip()[:160] for t in tail))
slow = sorted(calls, key=lambda r: -r["seconds"])[:8]
print("slowest: " + ", ".join(f"{r['test'].split('::')[-1][:50]} {r['seconds']:.0f}s" for r in slow))
PYEOF
}

tests() {
  local xdist=() code=0
  "$PY" -c 'import xdist' 2>/dev/null && xdist=(-n 12 --dist load)
  rm -f "$OUT/test_gpu.jsonl"
  echo "== the Triton kernels' own tests, compiled"
  # shellcheck disable=SC2046  # the kernels' test files, one word each
  DLRM_TEST_RECORD="$OUT/test_gpu.jsonl" timeout -k 5 "$(upto 65)" "$PY" -m pytest \
    $(ls tests/test_kernels_*.py) -m "kernels and not slow" "${xdist[@]}" -rfE >"$OUT/test_gpu.log" 2>&1
  record_summary "$OUT/test_gpu.jsonl"
  # then the GPU tests of code no GPU has run yet (NEW_TESTS, a pytest -k expression:
  # 110 s, as a test cut here is not run again below); one record and one log for all
  # the runs (at most 8 files come back from a call)
  echo "== tests of code not yet run on a GPU: $NEW_TESTS"
  # shellcheck disable=SC2086  # NEW_FILES: several paths
  DLRM_TEST_RECORD="$OUT/test_gpu.jsonl" timeout -k 5 "$(upto 110)" "$PY" -m pytest \
    $NEW_FILES -m "gpu or kernels" -k "$NEW_TESTS" "${xdist[@]}" -rfE >>"$OUT/test_gpu.log" 2>&1
  record_summary "$OUT/test_gpu.jsonl"
  echo "== reader: rows/s by data.workers"
  timeout -k 5 "$(upto 100)" "$PY" -m dlrm bench --config "$CONFIG" --reader-only \
    --workers 0,4,16 --out /tmp/bench_reader generate.rows=${READER_ROWS:-1048576} \
    data.shuffle_buffer=${READER_WINDOW:-65536} >"$OUT/reader.log" 2>&1
  cp /tmp/bench_reader/bench.json "$OUT"/reader.json 2>/dev/null
  tail -10 "$OUT/reader.log"
  if [ "$(left)" -gt 120 ]; then  # into reader.log; the same --out: its sets and copies reused
    # the workers' slots copied into pinned blocks by the taking thread, as before their
    # registration with CUDA (data/shm_batch.py; 0.384 ms of that thread a batch, 16
    # workers 5.32x one core, on the 2026-11-28 H200)
    echo "== reader: 16 workers, DLRM_SHM_PIN=0 (each batch copied out of its slot)"
    DLRM_SHM_PIN=0 timeout -k 5 "$(upto 40)" "$PY" -m dlrm bench --config "$CONFIG" --reader-only \
      --workers 16 --out /tmp/bench_reader generate.rows=${READER_ROWS:-1048576} \
      data.shuffle_buffer=${READER_WINDOW:-65536} >>"$OUT/reader.log" 2>&1
    grep -E "steady|taking" "$OUT/reader.log" | tail -4
  fi
  if [ "$(left)" -gt 25 ]; then
    echo "== vocabulary fit: rows/s by data.fit_workers"
    timeout -k 5 "$(upto 40)" "$PY" -m dlrm bench --config "$CONFIG" --fit-only \
      --fit-workers 0,16 --fit-rows ${FIT_ROWS:-4194304} --no-fit-memory --out /tmp/bench_fit >"$OUT/fit.log" 2>&1
    cp /tmp/bench_fit/bench.json "$OUT"/fit.json 2>/dev/null
    tail -6 "$OUT/fit.log"
  fi
  echo "== the other gpu and kernels tests"
  # what the reader and the fit left (the 2026-11-27 evening run cut the reader's worker
  # sweep when it came after these); the kernels' files ran above
  local others=$(($(left) > 10 ? $(left) : 10))
  # shellcheck disable=SC2046
  DLRM_TEST_RECORD="$OUT/test_gpu.jsonl" timeout -k 5 "$others" "$PY" -m pytest tests \
    -m "gpu or kernels" -k "not ($NEW_TESTS)" $(for f in tests/test_kernels_*.py; do echo "--ignore=$f"; done) \
    "${xdist[@]}" -rfE --durations=15 >>"$OUT/test_gpu.log" 2>&1
  code=$?
  grep -E "worst relative|hotline timeline|ops per step| passed| failed" "$OUT/test_gpu.log" | tail -10
  record_summary "$OUT/test_gpu.jsonl"
  # pytest's exit 1: tests failed (not a time-out, 124, or a crash)
  if [ $code -eq 1 ] && [ "$(left)" -gt 45 ]; then
    echo "== the failures again, one process"
    timeout -k 5 "$(upto 40)" "$PY" -m pytest tests -m "gpu or kernels" --lf -x -rfE \
      >"$OUT/test_gpu_rerun.log" 2>&1
    grep -E "FAILED|ERROR|passed|failed|Error" "$OUT/test_gpu_rerun.log" | tail -8
  fi
  return $code
}

# dlrm bench on configs/bench_gpu.yaml into /tmp/bench_gpu/$1 (the data generated once
# in /tmp/bench_gpu/data, shared); $2 seconds at most; the rest: dlrm bench arguments
bench_part() {
  local dir=/tmp/bench_gpu/$1 secs=$2
  shift 2
  mkdir -p "$dir"
  [ "$dir" != /tmp/bench_gpu/main ] && ln -sfn /tmp/bench_gpu/main/data "$dir/data"
  timeout -k 5 "$(upto "$secs")" "$PY" -m dlrm bench --config "$CONFIG" --steps 100 \
    --out "$dir" "$@"
}

# each thread's CPU and context switches a step over timed steps 80..159 (train.profile_mode=
# threads: read from /proc before and after, nothing during the steps, which stay captured):
# RUN/profile/rank-0-threads.txt of each row (in runs.tgz), printed by threads_census
THREADS=(train.profile_mode=threads train.profile_start=80 train.profile_steps=80)

# the thread census of each run under /tmp/bench_gpu/$1, its busiest threads printed (the
# files come back in runs.tgz: at most 8 files come back from $OUT, and the bench's 8 are there)
threads_census() {
  local table row
  for table in /tmp/bench_gpu/"$1"/runs/*/profile/rank-0-threads.txt; do
    [ -f "$table" ] || continue
    row=$(basename "$(dirname "$(dirname "$table")")")
    echo "== $1 $row: each thread's CPU a step ($table)"
    sed -n 3,9p "$table" | cut -c1-110
  done
}

bench() {
  local code
  bench_part main 350 \
    --engines native,hotline,hotline_eager,host_embedding,native_bf16_tables,hotline_bf16_tables,in_memory,hotline_in_memory "$@" \
    "${THREADS[@]}" >"$OUT/bench.log" 2>&1
  code=$?
  cp /tmp/bench_gpu/main/bench.json "$OUT"/ 2>/dev/null  # the rest in runs.tgz: 8 files come back
  grep -E "^  [a-z_0-9]+@|FAILED|generated|hotline|from Parquet|tables:|steps:|gpu:|bound" \
    "$OUT/bench.log" | tail -30
  threads_census main | grep -A7 -E "main (hotline|native|hotline_in_memory)_1:"
  {
    # hotline.cold_path=mapped (embeddings/hotline/mapped.py, new 2026-12-07, never run on
    # a GPU): the host tables registered with CUDA and read in place by the device on the
    # step loop's stream; no gather thread (whose GIL hand-offs with the step loop are the
    # suspect of the ~3 ms host-bound step), no pinned buffer, no H2D copy. Its thread
    # census beside the main hotline row's says what is left on the host
    echo "== hotline, hotline.cold_path=mapped (the cold rows read in place by the device)"
    bench_part mapped 45 --engines hotline,hotline_bf16_tables "$@" hotline.cold_path=mapped "${THREADS[@]}"
    # issue 22's budget sweep (64MB, 512MB, 2GB; 128MB is the main rows'): each row's hit
    # rate, popular share and samples/s, and OUT/bench_budgets.png. Cut by the call's time
    # on the 2026-11-28 evening H200 (last of the extras then; 64MB never ran): now second,
    # after the mapped row (the main rows took ~250 of the call's 420 s there)
    echo "== hotline.budget sweep (128MB: the main rows)"
    bench_part budgets 100 --engines "" --hotline-budgets 64MB,512MB,2GB "$@"
    # the baseline read in place too (issue 22 wants the strongest simple alternative):
    # host_embedding with every row read by the device over the bus, no host gather, no
    # copy; the mapped hotline row above over this one is the fair ratio if mapped wins
    echo "== host_embedding, hotline.cold_path=mapped (every row read in place by the device)"
    bench_part mappedbase 40 --engines host_embedding "$@" hotline.cold_path=mapped "${THREADS[@]}"
    # the cold gather on the step loop itself (hotline.pipeline=false: no gather thread,
    # the host's gather then the copy, while the previous step's replay runs): against the
    # main row's gather thread, whether the threads' hand-offs cost more than they hide
    echo "== hotline, hotline.pipeline=false (the host gather on the step loop)"
    bench_part nopipe 35 --engines hotline "$@" hotline.pipeline=false "${THREADS[@]}"
    # the workers' batches taken on the step loop's thread, not the reader's own
    # (DLRM_TAKE_THREAD=0, data/reader.py): one Python thread fewer beside the step loop
    echo "== hotline, DLRM_TAKE_THREAD=0 (the workers' batches taken on the step loop)"
    DLRM_TAKE_THREAD=0 bench_part takeinline 35 --engines hotline "$@" "${THREADS[@]}"
    # a helper thread's task beside a loop of small torch ops (the lock's hand-offs alone,
    # no GPU; the 2026-12-07 2-core CPU: 0.61-0.76 ms took 1.5-2.7 ms beside 1,000 ops)
    echo "== a helper thread beside a loop of small torch ops (dlrm.bench.gil_handoff)"
    timeout -k 5 "$(upto 15)" "$PY" -m dlrm.bench.gil_handoff --rounds 30 --intervals 5,0.5
    # the interpreter's GIL switch interval (a Hotline run on a GPU sets 0.5 ms since the
    # 2026-11-28 evening H200, 6db8c5d: 1,695,430 samples/s against 1,367,569-1,480,759 at
    # Python's 5 ms in the same call; the step loop is Python beside the gather, update,
    # pinning and split threads): 0.1 ms, shorter still (Python's 5 ms measured then)
    echo "== hotline, GIL switch interval 0.1 ms (the main rows' 0.5 ms)"
    DLRM_GIL_SWITCH_MS=0.1 bench_part gil01 40 --engines hotline "$@" "${THREADS[@]}"
    # torch's intra-op threads at 1 (train.threads; 0, the main rows', is torch's default:
    # one a core, 16 here). data.workers=auto leaves the trainer one core, so a CPU op of
    # the step loop's (copies, fills, an index_select) waits for 16 threads, 15 of whose
    # cores hold decode workers; the 2026-11-28 cProfile counted 171 voluntary context
    # switches a step (a CPU run here: 5.5 a step on the step loop's thread at 1 thread,
    # 120 at 2)
    echo "== hotline, train.threads=1 (the main rows': torch's default, a thread a core)"
    bench_part threads1 40 --engines hotline "$@" train.threads=1 "${THREADS[@]}"
    # where the captured Hotline step's host time goes (its replay took 1.47 ms of GPU time
    # of a 3.44 ms step on the 2026-11-27 H200): cProfile of the step loop's thread, the
    # steps still captured (train.profile_mode=python), microseconds a step per function
    echo "== hotline, the step loop under cProfile (steps 60..89)"
    bench_part hostprof 45 --engines hotline "$@" train.profile_mode=python train.profile_start=60 \
      train.profile_steps=30
    # where each step's GPU time goes, kernel by kernel (torch.profiler, the steps eager:
    # each kernel's device time is the one it takes in the replay): native's 1.43 ms and
    # hotline's 2.06 ms a replay on the 2026-11-28 H200, nothing said of which kernels.
    # $OUT/kprof-<row>.txt: operators and kernels by self CUDA time
    echo "== native and hotline steps under torch.profiler (steps 40..44, eager)"
    bench_part kprof 50 --engines native,hotline "$@" train.profile_mode=torch train.profile_start=40 \
      train.profile_steps=5
    # 2026-11-28 H200 (53f03e8), triton: forward 0.157 ms, backward+update 1.111 ms (torch's
    # 0.667 / 1.364); native's replay 1.43 ms of GPU time, hotline's 2.06 (1.48 with the cold
    # update on the host). Since: run heads by a sorted search (a cummax was one thread
    # block), no partials for the staged rows, blocked lookups, linearize, patch and keep,
    # a run's segment (and its partials) loaded as one tile, not a walk of dependent loads
    echo "== embedding kernels alone"
    timeout -k 5 "$(upto 40)" "$PY" -m dlrm.bench.kernels --config "$CONFIG"
    # the run segment's A/B (a long run's serial walk against its partials' count), by the
    # graph-replayed figures (*_graph_ms: GPU time; the eager ones may be the host's)
    DLRM_KERNEL_RUN_SEGMENT=16 timeout -k 5 "$(upto 20)" "$PY" -m dlrm.bench.kernels --config "$CONFIG" \
      --kernels triton
    # issue 22's "refresh without a stall": 292 ms a refresh under the captured step on
    # the 2026-11-27 H200, 47.5 ms on the 2026-11-28 one (4 in 163 steps: 639,567 samples/s
    # against 1,319,650)
    # under cProfile over steps 55..64 (a refresh at 60: where its pause goes; the table in
    # runs.tgz, refresh/runs/hotline_1/profile/rank-0-python.txt; cProfile cost the
    # 2026-11-28 hostprof row 3% of its samples/s)
    echo "== hotline, hotline.refresh_every=30"
    bench_part refresh 45 --engines hotline "$@" hotline.refresh_every=30 train.profile_mode=python \
      train.profile_start=55 train.profile_steps=10
    # the gather before (hotline.gather_threads=0: one index_select over torch's 16
    # intra-op threads, beside data.workers=auto's 15 decode workers; the main rows'
    # gathers run on threads of ours since 2026-11-28's evening, embeddings/host_rows.py,
    # and the reader's pinned copies are numpy's). The 2026-11-28 H200's in-step gather
    # took 1.3 ms a step where the gather alone (host_gather below) took 0.05 ms over 16
    # idle threads and 0.22 in one. Then hotline's gather on 4 threads of ours (the main
    # row's: 1, the gather thread itself; host_embedding's: 4)
    echo "== hotline.gather_threads=0 (the gather before): hotline, host_embedding"
    bench_part gather0 50 --engines hotline,host_embedding "$@" hotline.gather_threads=0
    echo "== hotline.gather_threads=4: hotline"
    bench_part gather4 30 --engines hotline "$@" hotline.gather_threads=4
    # the cold gather alone (1.3 ms a step for ~4,500 rows in the step on the 2026-11-28
    # H200; alone 0.05 ms over 16 threads, 0.22 in one): 2 MiB pages or not, torch's
    # index_select and ours (embeddings/host_rows.py) on 1 / 4 / 16 threads, beside 15
    # spinning processes as a run's decode workers (the mean and p90 show the stragglers)
    echo "== host gather beside 15 busy processes"
    timeout -k 5 "$(upto 40)" "$PY" -m dlrm.bench.host_gather --config "$CONFIG" --busy 15 --threads 1,4,16
    # the static step's cold rows before 2026-11-28: their gradient home, the host tier's
    # update (2026-11-28 H200: 1,196,840 samples/s, 1.48 ms a replay, against 1,319,650
    # and 2.06 ms updated in the replay)
    echo "== hotline, hotline.cold_update=host (the cold update before)"
    bench_part coldhost 60 --engines hotline,hotline_bf16_tables "$@" hotline.cold_update=host
    # the default dense optimizer (adagrad; bench_gpu.yaml's is sgd): ours, graphed
    # (dlrm/train/adagrad.py; 2026-11-28 H200: 2,537,587 samples/s, 0.95x SGD's)
    echo "== native, optim.dense=adagrad (the default dense optimizer)"
    bench_part adagrad 45 --engines native "$@" optim.dense=adagrad
    grep -h '"step_mode"' /tmp/bench_gpu/adagrad/bench.json 2>/dev/null | head -1
    echo "== native_fp16_tables, torch_baseline"
    bench_part extra 90 --engines native_fp16_tables,torch_baseline "$@"
  } >"$OUT/bench_extra.log" 2>&1
  grep -E "^  [a-z_0-9]+@|FAILED|^==|budget|GB/s|gb_per_s|switch_interval_ms|\"kernels\"|^ +[0-9]+[KMGT]?B |hot hit rate|steps: hotline step static|\"step_mode\"" \
    "$OUT/bench_extra.log" | tail -40
  threads_census mapped
  threads_census mappedbase
  threads_census nopipe
  threads_census takeinline
  threads_census gil01
  threads_census threads1
  local prof
  prof=$(find /tmp/bench_gpu/hostprof -name 'rank-0-python.txt' 2>/dev/null | head -1)
  if [ -n "$prof" ]; then  # the whole file comes back too (runs.tgz came back too big on 2026-11-28)
    cp "$prof" "$OUT/hostprof.txt"
    echo "== hotline's step loop under cProfile ($prof)"
    head -2 "$prof"
    grep -A16 "== by own" "$prof"
    grep -A24 "== by with callees" "$prof"
  fi
  local table row
  for table in /tmp/bench_gpu/kprof/runs/*/profile/rank-0.txt; do
    [ -f "$table" ] || continue
    row=$(basename "$(dirname "$(dirname "$table")")")
    cp "$table" "$OUT/kprof-$row.txt"
    echo "== $row: kernels by self CUDA time ($OUT/kprof-$row.txt)"
    sed -n 1,22p "$table" | cut -c1-200
  done
  # the runs' small text files only (the whole of them came back too big on 2026-11-28:
  # at most 16 MiB a file, 8 files a call)
  (cd /tmp/bench_gpu && find . -path '*/data' -prune -o -type f -size -1024k \( -name '*.txt' -o -name '*.json' \
    -o -name '*.log' \) ! -path '*/profile/rank-*.json' -print | tar czf "$OUT/runs.tgz" -T - 2>/dev/null)
  return $code
}

"$mode" "$@"
code=$?
echo "gpu_session $mode: exit $code after $SECONDS s (budget $budget s); files in $OUT"
exit $code
