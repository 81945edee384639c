"""``dlrm bench``: our engine against TorchRec on this machine, under real ranks.

    OUT/data/                 the config's generate: section (reused while unchanged)
    OUT/runs/<engine>_<N>/    one `torchrun --nproc_per_node=N -m dlrm train` per row
                              (N=1: `python -m dlrm train`)
    OUT/bench.json, .png      every figure; samples/s per row as bars

Each row's samples/s is the median of the trainer's logged windows after the first
(warm-up). Sections (ms per step) and peak memory are the trainer's summary, shown
as "-" where a backend does not report them. The machine limit (dlrm/bench/limits.py)
bounds samples/s from measured matmul rate and memory bandwidth. ``--checkpoint``
measures a checkpoint's save and resume instead (dlrm/bench/checkpoint.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from data.atomic import atomic_path, write_atomic
from data.errors import UserError
from data.outputs import output_dir
from dlrm.bench.budgets import (
    budget_engines,
    format_sweep,
    split_engine,
    sweep_rows,
    write_sweep_png,
)
from dlrm.bench.provenance import provenance, provenance_line
from dlrm.config import Config, load_config

REPO = Path(__file__).resolve().parents[1]
# Engine → training overrides. The host-embedding baseline is Hotline with no hot
# row and no pipeline: every table in host memory, gathered every step.
ENGINES = {
    "native": ["embeddings.backend=native"],
    # Mixed precision: bf16 matmuls in the MLPs and the interaction (opt-in; its
    # AUC stays within 0.005 of fp32 in tests/test_quality_vs_torchrec.py).
    # precision_fallback=none: the bf16 rows measure bf16 even where it is slow.
    "native_bf16": ["embeddings.backend=native", "train.precision=bf16", "train.precision_fallback=none"],
    "torchrec": ["embeddings.backend=torchrec"],
    # TorchRec under the same autocast: the bf16 rows' ratio is taken against it.
    "torchrec_bf16": ["embeddings.backend=torchrec", "train.precision=bf16",
                      "train.precision_fallback=none"],
    # Stock PyTorch (nn.EmbeddingBag sparse=True, torch.optim), as facebookresearch/dlrm
    # trains: the floor any engine of ours must beat. One rank only.
    "torch_baseline": ["embeddings.backend=torch_baseline"],
    # The native engine on the first batches read once and kept in (device) memory,
    # replayed (data.in_memory, dlrm/train/staged.py): native / in_memory is the share of
    # the step rate the Parquet input keeps.
    "in_memory": ["embeddings.backend=native", "data.in_memory=true"],
    # Hotline: on a GPU its whole step captured and replayed (hotline.graph_step's
    # default, auto); hotline_eager the eager step with its graphed parts, beside it
    "hotline": ["embeddings.placement=hotline"],
    "hotline_eager": ["embeddings.placement=hotline", "hotline.graph_step=off"],
    # Hotline on the first batches read once and kept in host memory (it copies each to
    # the device itself): hotline / hotline_in_memory is the share of its step rate the
    # Parquet input keeps, the reader's thread and decode workers running beside the step
    # loop's Python or not (a Hotline step on a GPU is bound by that thread's time)
    "hotline_in_memory": ["embeddings.placement=hotline", "data.in_memory=true"],
    # Half-precision tables (issue 24): the same engine with every table stored in
    # bf16 / fp16, beside native's fp32 rows (``vs_fp32_tables``: rate and table bytes).
    "native_bf16_tables": ["embeddings.backend=native", "embeddings.dtype=bf16"],
    "native_fp16_tables": ["embeddings.backend=native", "embeddings.dtype=fp16"],
    # Hotline with bf16 tables: twice the hot rows in the same hotline.budget (beside hotline)
    "hotline_bf16_tables": ["embeddings.placement=hotline", "embeddings.dtype=bf16"],
    # the baseline Hotline must beat: every row gathered on the host and copied each step,
    # its step captured too where Hotline's is (the strongest simple alternative): its
    # gather, ~10x Hotline's cold rows (bench_gpu: ~10 MB a step), on 4 threads of ours
    "host_embedding": ["embeddings.placement=hotline", "hotline.budget=1B", "hotline.pipeline=false",
                       "hotline.gather_threads=4"],
}
SECTIONS = ("data_wait", "input_alltoall", "lookup", "output_alltoall", "mlp",
            "embedding_update", "dense_update")
SECTION_HEADS = ("wait", "in a2a", "lookup", "out a2a", "mlp", "emb upd", "dense upd")
STAMP = "generate.json"
TIMING_WARMUP = 5  # the trainer's default train.timing_warmup


class BenchError(UserError):
    """A benchmark that cannot go on; names what failed."""


class RunFailed(BenchError):
    """One training run that exited non-zero: its message names the run and its log."""

    def __init__(self, message: str, code: int, log: Path) -> None:
        super().__init__(message)
        self.code = code
        self.log = log


# ------------------------------------------------------------------ command


def cmd_bench(argv: list[str]) -> int:
    """Entry point of ``dlrm bench``; see the module docstring."""
    a = _parse(argv)
    cfg = load_config(a.config, a.overrides)
    if a.checkpoint:
        return checkpoint_only(a)
    if a.fit_only:
        return fit_only(a)
    out = output_dir(a.out, "--out").resolve()
    if not a.reader_only:
        a.engines = runnable_engines(a.engines)  # before generating data: fail fast
    out.mkdir(parents=True, exist_ok=True)
    data_dir = ensure_dataset(cfg, out / "data")
    if a.reader_only:
        return reader_only(a, cfg, out, data_dir)
    steps = a.steps or cfg.train.max_steps or 200
    # The generator's stated sizes, exactly: a table is not sized by the ids its rows drew.
    a.overrides = [stated_rows_override(cfg), *a.overrides]
    # Rounds interleave the engines (A B A B, not A A B B), so a slow spell of a
    # shared machine falls on every engine rather than on one.
    untimed = untimed_steps(cfg)
    ran_on = provenance()
    print(f"bench: {provenance_line(ran_on)}; config {a.config}", flush=True)
    print(f"timing {steps} steps a row, after {untimed} untimed ones (Hotline's profile window, "
          "the warm-up): every row the same batches", flush=True)
    runs, failed = run_all(a, steps, data_dir, out / "runs", untimed)
    if not runs:
        raise BenchError("every run failed:\n" + "\n".join(f["error"] for f in failed))
    rows = merge_rounds(runs)
    for row in rows:
        settings = [o for o in [*engine_overrides(row["engine"]), *a.overrides]
                    if o.startswith("train.precision=")]
        row["precision"] = "bf16" if settings and settings[-1] == "train.precision=bf16" else "fp32"
    add_ratios(rows)
    from dlrm.bench.limits import machine_limit

    limit = machine_limit(cfg)
    add_bounds(rows, cfg, limit)
    print(format_table(rows))
    add_input_ratio(rows)
    for line in half_table_lines(rows):
        print(line)
    for row in rows:
        if row.get("vs_in_memory") is not None:
            print(f"{row['engine']}@{row['ranks']}: from Parquet / in memory = {row['vs_in_memory']:.3f} "
                  "(the input's share of the step: target >= 0.95)")
    for row in rows:  # replayed CUDA graphs or eager steps, and why (train.cuda_graphs)
        if row.get("step_mode"):
            print(f"{row['engine']}@{row['ranks']} steps: {row['step_mode']}")
    for row in rows:
        if row.get("hotline"):
            print(_hotline_line(row))
    sweep = sweep_rows(rows)
    if sweep:
        print(format_sweep(sweep))
        write_sweep_png(out / "bench_budgets.png", sweep)
    print(format_limit(limit, rows))
    if "h2d_pinned_gb_s" in limit:
        print(format_gpu(limit, rows))
    report = {"config": a.config, "steps": steps, "ran_on": ran_on, "rows": rows, "limit": limit,
              **({"hotline_budgets": sweep} if sweep else {}), **({"failed": failed} if failed else {})}
    write_json(out / "bench.json", report)
    write_png(out / "bench.png", rows, limit,
              f"{a.config}, {steps} steps a row; tables {_tables_cell(rows[0].get('tables'))}; "
              f"{provenance_line(ran_on)}")
    print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
    for f in failed:
        print(f"FAILED {f['engine']}@{f['ranks']}: exit {f['code']}, log {f['log']}")
    return 1 if failed else 0


def run_all(a: argparse.Namespace, steps: int, data_dir: Path, runs_dir: Path, untimed: int = TIMING_WARMUP
            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every (round, ranks, engine) run: (their rows, the failed ones). Each row is
    printed as it ends, so a bench cut short by a time limit still shows what it
    measured; ``--keep-going`` (the default) goes on past a failed run, which is
    reported and makes the exit code 1 (``--no-keep-going``: the first failure ends it)."""
    runs: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    for r in range(a.repeat):
        for n in a.ranks:
            for engine in a.engines:
                if engine == "torch_baseline" and n > 1:  # one process by design
                    continue
                try:
                    row = run_engine(a.config, a.overrides, engine, n, steps, data_dir, runs_dir,
                                     round_=r, untimed=untimed)
                except RunFailed as e:
                    if not a.keep_going:
                        raise
                    print(f"FAILED {e}", flush=True)
                    failed.append({"engine": engine, "ranks": n, "round": r, "code": e.code,
                                   "log": str(e.log), "error": str(e)})
                    continue
                print(row_line(row), flush=True)
                runs.append(row)
    return runs, failed


def row_line(row: dict[str, Any]) -> str:
    """One run's result as it ends: samples/s, step sections, wall time."""
    sections = " / ".join(f"{k} {v:.1f}" for k, v in (row.get("sections_ms") or {}).items() if v is not None)
    return (f"  {row['engine']}@{row['ranks']}: {row['samples_per_s']:,.0f} samples/s"
            + (f" (ms/step: {sections})" if sections else "") + f", {row['wall_s']:.0f} s wall")


def reader_only(a: argparse.Namespace, cfg: Config, out: Path, data_dir: Path) -> int:
    """``--reader-only``: the reader's rates (and ``--workers``' sweep) into OUT/bench.json."""
    from dlrm.bench.cold_read import format_cold

    reader = reader_rate(cfg, data_dir)
    print(f"reader: {reader['rows_per_s']:,.0f} rows/s decoded into batches of "
          f"{reader['batch_size']} on one core ({reader['rows']} rows); shuffled "
          f"{reader['modes']['shuffled']:,.0f}, shuffled through vocabularies "
          f"{reader['modes']['vocabulary_shuffled']:,.0f}")
    print(format_cold(reader["cold"]))
    if a.workers is not None:
        from data.shuffle_window import setting as window_setting
        from dlrm.bench.reader_sweep import format_workers, reader_sweep

        reader["workers"] = reader_sweep(reader.pop("files"), reader.pop("schema"),
                                         cfg.data.batch_size, a.workers, out,
                                         window_setting(cfg.data.shuffle_buffer), cfg.data.prefetch,
                                         a.worker_depth)
        print(format_workers(reader["workers"]))
    reader.pop("files", None), reader.pop("schema", None)
    path = out / "bench.json"  # kept beside the training rows of an earlier bench
    report = json.loads(path.read_text()) if path.is_file() else {"config": a.config}
    write_json(path, {**report, "reader": reader})
    return 0


def checkpoint_only(a: argparse.Namespace) -> int:
    """``--checkpoint``: save and resume the config's model (no data, no training);
    the figures join OUT/bench.json under "checkpoint"."""
    from dlrm.bench.checkpoint import checkpoint_bench, format_checkpoint

    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    result = checkpoint_bench(a.config, a.overrides, out)
    print(format_checkpoint(result))
    path = out / "bench.json"  # kept beside the training rows of an earlier bench
    report = json.loads(path.read_text()) if path.is_file() else {"config": a.config}
    write_json(path, {**report, "checkpoint": result})
    return 0


def fit_only(a: argparse.Namespace) -> int:
    """``--fit-only``: the vocabulary pass by ranks x workers and its peak memory per
    distinct value (dlrm/bench/fit_bench.py); figures join OUT/bench.json under "fit"."""
    from dlrm.bench.fit_bench import fit_bench, format_fit

    out = Path(a.out).resolve()
    workers = [int(x) for x in a.fit_workers.split(",")]
    cfg = load_config(a.config, a.overrides)
    result = fit_bench(out / "fit-data", a.fit_rows or cfg.generate.rows, list(a.ranks), workers,
                       cfg.generate, cfg.seed, a.fit_memory)
    print(format_fit(result))
    path = out / "bench.json"
    report = json.loads(path.read_text()) if path.is_file() else {"config": a.config}
    write_json(path, {**report, "fit": result})
    return 0


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dlrm bench", description="Benchmark engines on this machine.")
    p.add_argument("--config", default="configs/bench.yaml", help="YAML config with a generate: section")
    p.add_argument("--ranks", default="1", help="comma-separated rank counts, e.g. 1,2")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default: train.max_steps)")
    p.add_argument("--out", default="runs/bench", help="output directory")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of every run, interleaved; each row is the median round")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help=f"comma-separated subset of {', '.join(ENGINES)} (default: all; "
                        "empty with --hotline-budgets: the sweep's rows alone)")
    p.add_argument("--hotline-budgets", default=None,
                   help="comma-separated hotline.budget sizes, one hotline row each (e.g. 64MB,2GB)")
    p.add_argument("--reader-only", action="store_true", help="only Parquet decode rate on one core")
    p.add_argument("--workers", default=None,
                   help="with --reader-only: comma-separated data.workers counts to sweep, "
                        "e.g. 0,1,2 (bench and Avazu-shaped string schemas)")
    p.add_argument("--worker-depth", type=int, default=None,
                   help="with --workers: batches each decode worker decodes ahead (default: "
                        "the reader's, a shuffle window's)")
    p.add_argument("--checkpoint", action="store_true",
                   help="only checkpoint save/resume GB/s and peak RSS of the config's model")
    p.add_argument("--fit-only", action="store_true",
                   help="only the vocabulary pass: rows/s by --ranks x --fit-workers, B/distinct")
    p.add_argument("--fit-rows", type=int, default=None,
                   help="--fit-only: generated rows (default: the config's generate.rows)")
    p.add_argument("--fit-workers", default="0", help="--fit-only: comma-separated worker counts")
    p.add_argument("--fit-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="--fit-only: also the peak-memory runs (--no-fit-memory: rates only)")
    p.add_argument("--keep-going", action=argparse.BooleanOptionalAction, default=True,
                   help="go on past a failed run, report it and exit 1 (--no-keep-going: stop at it)")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    a = p.parse_intermixed_args(argv)  # key=value before and after the options
    try:
        a.ranks = [int(r) for r in a.ranks.split(",") if r.strip()]
    except ValueError:
        raise BenchError(f"--ranks {a.ranks!r}: expected comma-separated integers") from None
    if not a.ranks or min(a.ranks) < 1:
        raise BenchError(f"--ranks {a.ranks}: rank counts must be >= 1")
    a.engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    unknown = [e for e in a.engines if e not in ENGINES]
    if unknown or not (a.engines or a.hotline_budgets):  # --engines "" with budgets: the sweep alone
        raise BenchError(f"--engines {unknown or a.engines}: choose from {', '.join(ENGINES)}")
    a.engines += budget_engines(a.hotline_budgets)
    if a.repeat < 1:
        raise BenchError(f"--repeat {a.repeat}: must be >= 1")
    if a.workers is not None:
        try:
            a.workers = [int(w) for w in a.workers.split(",") if w.strip()]
        except ValueError:
            raise BenchError(f"--workers {a.workers!r}: expected comma-separated integers") from None
        if not a.workers or min(a.workers) < 0:
            raise BenchError(f"--workers {a.workers}: worker counts must be >= 0")
    if a.steps is not None and a.steps < 1:
        raise BenchError(f"--steps {a.steps}: must be >= 1")
    if a.worker_depth is not None and a.worker_depth < 1:
        raise BenchError(f"--worker-depth {a.worker_depth}: must be >= 1")
    return a


def torchrec_missing() -> str | None:
    """Why the TorchRec engines cannot run here (None: torchrec and fbgemm_gpu are
    installed). Looked up, not imported: the bench process stays free of both."""
    for name in ("torchrec", "fbgemm_gpu"):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a blocked import, a module without a spec
            found = False
        if not found:
            return f"{name} is not installed"
    return None


def runnable_engines(engines: list[str]) -> list[str]:
    """``engines`` without the TorchRec ones where torchrec is missing (the GPU machine
    has plain torch), each skipped with a line; a BenchError if none is left."""
    needs = [e for e in engines if "embeddings.backend=torchrec" in engine_overrides(e)]
    why = torchrec_missing() if needs else None
    if why is None:
        return engines
    print(f"skipping {', '.join(needs)}: {why} (the native rows need neither torchrec nor fbgemm)")
    left = [e for e in engines if e not in needs]
    if not left:
        raise BenchError(f"--engines {','.join(engines)}: nothing to run without torchrec ({why})")
    return left


def add_bounds(rows: list[dict[str, Any]], cfg: Config, limit: dict[str, Any]) -> None:
    """Each row's fraction of the machine's bound. On a GPU the bound is the engine's
    own (``limits.engine_bound``: its share of lookups served from GPU memory, its HBM
    and PCIe bytes per sample), with the bandwidths it reached."""
    from dlrm.bench.limits import engine_bound

    gpu = "h2d_pinned_gb_s" in limit
    for row in rows:
        bf16 = row["precision"] == "bf16"  # measured against the bf16 matmul rate
        if not gpu:
            row["fraction_of_bound"] = row["samples_per_s"] / limit[
                "samples_per_s_bound_bf16" if bf16 else "samples_per_s_bound"]
            continue
        hit = (row.get("hotline") or {}).get("hot_hit_rate", 1.0)
        row.update(engine_bound(cfg, limit, hit, bf16))
        row["device_hit_rate"] = hit
        row["fraction_of_bound"] = row["samples_per_s"] / row["samples_per_s_bound"]
        row["hbm_gb_s"] = row["samples_per_s"] * row["hbm_bytes_per_sample"] / 1e9
        row["pcie_gb_s"] = row["samples_per_s"] * row["pcie_bytes_per_sample"] / 1e9


# ------------------------------------------------------------------ dataset


def ensure_dataset(cfg: Config, data_dir: Path) -> Path:
    """Generate ``cfg.generate`` under ``data_dir`` unless a stamp says it is there.

    The stamp (written last, so a half-written set is redone) holds the generate
    section and seed; any difference regenerates from scratch.
    """
    from data.generate import generate_dataset

    want = {"generate": dataclasses.asdict(cfg.generate), "seed": cfg.seed}
    stamp = data_dir / STAMP
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        print(f"reusing dataset {data_dir}")
        return data_dir
    if data_dir.exists():
        shutil.rmtree(data_dir)
    t0 = time.perf_counter()
    generate_dataset(str(data_dir), cfg.generate, seed=cfg.seed)
    write_atomic(stamp, json.dumps(want, indent=1))
    print(f"generated {cfg.generate.rows} rows in {data_dir} ({time.perf_counter() - t0:.1f} s)")
    return data_dir


def stated_rows_override(cfg: Config) -> str:
    """``data.rows={C1: 1460, ...}``: every generated table at generate.table_rows (with
    identity ids, a table is otherwise sized by the largest id its rows drew)."""
    from data.generate import generator_schema

    return "data.rows=" + json.dumps({f.name: f.rows for f in generator_schema(cfg.generate).sparse})


# ------------------------------------------------------------------ one run


def run_engine(config: str, overrides: list[str], engine: str, ranks: int, steps: int,
               data_dir: Path, runs: Path, round_: int = 0, untimed: int = TIMING_WARMUP) -> dict[str, Any]:
    """Train ``engine`` on ``ranks`` torchrun processes for ``untimed`` + ``steps``
    steps; return its row (timed over ``steps``)."""
    run_dir = runs / (f"{engine}_{ranks}" + (f"_round{round_}" if round_ else ""))
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a run dir with a checkpoint would resume
    run_dir.mkdir(parents=True)
    cmd = launch_command(config, overrides, engine, ranks, steps, data_dir, run_dir, untimed)
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks)),
           "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    print(f"running {engine} on {ranks} rank(s), {steps} steps"
          + (f" (round {round_ + 1})" if round_ else "") + " ...", flush=True)
    log = run_dir.parent / f"{run_dir.name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        tail = log.read_text()[-2000:]
        raise RunFailed(f"{engine} on {ranks} rank(s) exited {code}; log {log}:\n{tail}", code, log)
    row = collect(run_dir / "metrics.jsonl", untimed)
    if row["steps"] is not None:  # the timed steps; the untimed ones apart
        row.update(steps=row["steps"] - untimed, untimed_steps=untimed)
    row.update(engine=engine, ranks=ranks, wall_s=time.perf_counter() - t0)
    return row


def engine_overrides(engine: str) -> list[str]:
    """The training overrides of a row: ``ENGINES``' own, a sweep row's budget after."""
    base, extra = split_engine(engine)
    return [*ENGINES[base], *extra]


def untimed_steps(cfg: Config) -> int:
    """Steps every row runs untimed before its ``--steps``: Hotline's profile window
    (its batches are the profiled ones, every row they touch is hot: on the first H200
    bench, 61 of 100 steps at a 100% hit rate, against 94% after) and the warm-up.
    Every row skips the same steps, so all time the same batches."""
    from embeddings.hotline.profile import default_max_batches

    batches = cfg.generate.rows // max(cfg.data.batch_size, 1)
    return default_max_batches(batches, cfg.hotline.profile_fraction) + TIMING_WARMUP


def launch_command(config: str, overrides: list[str], engine: str, ranks: int, steps: int,
                   data_dir: Path, run_dir: Path, untimed: int = TIMING_WARMUP) -> list[str]:
    """``python -m torch.distributed.run ... -m dlrm train`` for one bench row (one rank:
    ``python -m dlrm train``): ``untimed`` steps, then ``steps`` timed ones."""
    log_every = max(1, min(10, steps // 5))  # at least a few windows after the warm-up
    # no checkpoint at the end: of no use to the bench, and bench_gpu's tables are 8.6 GB
    train = [*engine_overrides(engine), f"train.max_steps={untimed + steps}", "train.progress=false",
             "train.time_sections=true", f"train.log_every={log_every}", "train.checkpoint_every=0",
             "train.final_checkpoint=false",
             f"train.timing_warmup={untimed}", "train.eval_every=0", f"data.train={data_dir}", "data.eval="]
    # one rank: the trainer alone, as a torchrun of one would run it (no process group;
    # dlrm/parallel/distributed.py), without the launcher's own process and its second
    # import of torch (1.2 s a row on the 2-core machine)
    launcher = ([] if ranks == 1 else
                ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"])
    return [sys.executable, *launcher, "-m", "dlrm", "train", "--config", str(Path(config).resolve()),
            "--out", str(run_dir), *overrides, *train]


def collect(metrics: Path, untimed: int = TIMING_WARMUP) -> dict[str, Any]:
    """Samples/s (median of the log windows after the ``untimed`` steps), sections and
    peak memory of a run."""
    events = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    summary = next((e for e in reversed(events) if e.get("event") == "summary"), {})
    train = [e for e in events if e.get("event") == "train" and "window_samples_per_s" in e]
    every = train[0]["step"] if train else 1  # the first window ends at step log_every
    windows = [e["window_samples_per_s"] for e in train if e["step"] - every >= untimed]
    rate = statistics.median(windows) if windows else float(summary.get("samples_per_s", 0.0))
    sections = summary.get("sections_ms") or {}
    return {
        "samples_per_s": rate,
        "windows": len(windows),
        "steps": summary.get("steps"),
        "sections_ms": {k: sections.get(k) for k in SECTIONS},
        "peak_memory_mb": summary.get("peak_memory_mb"),
        "hotline": summary.get("hotline"),  # hit rate, popular share, gather hidden
        "tables": summary.get("tables"),  # what the run built: count, rows, bytes
        "step_mode": summary.get("step_mode"),  # graphs replayed, or eager and why
    }


def merge_rounds(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (engine, ranks): the round of median samples/s (the lower middle
    of an even count), with every round's rate kept in ``rounds``."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["engine"], run["ranks"]), []).append(run)
    rows = []
    for group in groups.values():
        ordered = sorted(group, key=lambda r: r["samples_per_s"])
        row = dict(ordered[(len(ordered) - 1) // 2])
        row["rounds"] = [r["samples_per_s"] for r in group]
        rows.append(row)
    return rows


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's samples/s over the TorchRec row of the same rank count and precision;
    without a TorchRec row of its precision, over the fp32 one (None without either).
    ``vs_torchrec_precision`` says which was used."""
    base = {(r["ranks"], r["precision"]): r["samples_per_s"]
            for r in rows if r["engine"] in ("torchrec", "torchrec_bf16")}
    for r in rows:
        precision = r["precision"] if (r["ranks"], r["precision"]) in base else "fp32"
        b = base.get((r["ranks"], precision))
        r["vs_torchrec"] = r["samples_per_s"] / b if b else None
        r["vs_torchrec_precision"] = precision if b else None


# each engine that reads Parquet → its row on batches kept in memory
IN_MEMORY = {"native": "in_memory", "hotline": "hotline_in_memory"}


def add_input_ratio(rows: list[dict[str, Any]]) -> None:
    """``vs_in_memory`` on each native and hotline row: its samples/s over its in-memory
    row's (``IN_MEMORY``) at the same rank count (None without one)."""
    staged = {(r["engine"], r["ranks"]): r["samples_per_s"] for r in rows if r["engine"] in IN_MEMORY.values()}
    for r in rows:
        if r["engine"] in IN_MEMORY:
            b = staged.get((IN_MEMORY[r["engine"]], r["ranks"]))
            r["vs_in_memory"] = r["samples_per_s"] / b if b else None


def half_table_lines(rows: list[dict[str, Any]]) -> list[str]:
    """``vs_fp32_tables`` on each half-table row (``<engine>_bf16_tables``): its samples/s
    and table bytes over its engine's fp32-table row (native, hotline) at the same rank
    count; one line each (none without that row)."""
    by = {(r["engine"], r["ranks"]): r for r in rows}
    lines = []
    for r in rows:
        if not r["engine"].endswith("_tables"):
            continue
        engine = r["engine"].rsplit("_", 2)[0]  # native_bf16_tables -> native
        base = by.get((engine, r["ranks"]))
        if base is None:
            continue
        rate = r["samples_per_s"] / base["samples_per_s"] if base["samples_per_s"] else None
        mine, theirs = (x.get("tables") or {} for x in (r, base))
        size = mine["bytes"] / theirs["bytes"] if mine.get("bytes") and theirs.get("bytes") else None
        r["vs_fp32_tables"] = {"samples_per_s": rate, "table_bytes": size}
        lines.append(f"{r['engine']}@{r['ranks']} / {engine}@{r['ranks']}: samples/s {_fmt(rate, '.3f')}x, "
                     f"table bytes {_fmt(size, '.3f')}x (issue 24: >= 1.0x at 0.5x +- 2% of the bytes)")
    return lines


def _hotline_line(row: dict[str, Any]) -> str:
    """A Hotline row's stats in one line: hits, the gather, where the step loop waited."""
    h = row["hotline"]
    return (f"{row['engine']}: hot hit rate {h['hot_hit_rate']:.1%}, popular share "
            f"{h['popular_share']:.1%}, {_cold_rows_cost(h)}, hot tier on "
            f"{'triton' if h.get('hot_tier_triton') else 'torch'}, "
            f"{h.get('split_ahead', 0.0):.0%} of mini-batches split a step ahead"
            + (f", {h['refreshes']:.0f} refreshes pausing {h['refresh_pause_ms']:.1f} ms each "
               f"({h.get('refresh_wait_ms', 0.0):.1f} of it waiting for the plan; the planner "
               f"{h.get('plan_ms', 0.0):.0f} ms a plan, {h.get('count_ms', 0.0):.2f} ms a step counting)"
               if h.get("refreshes") else "")
            + (f", {h['split_graphed']:.0%} split by a graph replay" if h.get("split_graphed") else "")
            + (f"; the step loop waited {h['gather_wait_ms']:.2f} ms/step for cold rows, "
               f"{h.get('header_wait_ms', 0.0):.2f} for the next split's header; the gather "
               f"{h.get('update_wait_ms', 0.0):.2f} for host updates")
            + (f"; CPU a step: the step loop {h['loop_cpu_ms']:.2f} ms of its {h['loop_wall_ms']:.2f} ms, "
               + (f"{h.get('gather_cpu_ms', 0.0):.2f} of it in the reads" if h.get("cold_in_place")  # no thread
                  else f"the gather thread {h.get('gather_cpu_ms', 0.0):.2f}")
               + f", the update thread {h.get('update_cpu_ms', 0.0):.2f}" if h.get("loop_wall_ms") else "")
            + " "
            f"({row['ranks']} rank{'s' if row['ranks'] > 1 else ''}, rank 0's view)")


def _cold_rows_cost(h: dict[str, Any]) -> str:
    """What a step's cold rows cost: the host's gather and the copy's issue, and how much
    of both the hot side hid; read in place (hotline.cold_path=mapped) there is neither,
    only the step loop's time to issue the device's reads (its wait for host writes
    is said with the waits)."""
    if h.get("cold_in_place"):
        return (f"{_gather_how(h)}, {h['transfer_ms']:.2f} ms/step on the step loop issuing the reads"
                + (f" ({h['ids_wait_ms']:.2f} waiting for the cold ids' copy)"
                   if h.get("ids_wait_ms", 0.0) >= 0.005 else ""))
    return (f"host gather {h['gather_ms']:.1f} ms/step"
            + (f" ({h['ids_wait_ms']:.1f} of it waiting for the cold ids' copy)" if h.get("ids_wait_ms") else "")
            + f", transfer {h['transfer_ms']:.1f} ms/step, {h['gather_hidden']:.0%} of both hidden, "
            f"{_gather_how(h)}")


def _gather_how(h: dict[str, Any]) -> str:
    """How a Hotline row gathered its cold rows (hotline.gather_threads; hotline.cold_path=
    mapped: read in place by the device)."""
    threads = int(h.get("gather_threads", 1))
    if h.get("cold_in_place"):
        how = "read in place by the device (hotline.cold_path=mapped)"
    elif threads:
        how = f"{threads} gather thread{'s' if threads > 1 else ''} of ours"
    else:
        how = f"gather in one call over {h.get('gather_torch_threads', 1):.0f} torch thread(s)"
    if "host_huge_pages" in h:  # tables under 64 MB are not advised: no share
        how += f" from a host tier {h['host_huge_pages']:.0%} on 2 MiB pages"
    return how


# ------------------------------------------------------------------ reader


def reader_rate(cfg: Config, data_dir: Path) -> dict[str, Any]:
    """Rows/s of ParquetReader decoding the bench set into batches on one core: under
    ``cold`` the first read, of files dropped from the page cache, beside the disk's own
    rate (dlrm/bench/cold_read.py); in stored order with the generator's ids (the
    top-level figures; a second pass, the first warms the page cache), and under
    ``modes`` shuffled, and shuffled through vocabularies fitted on the set (neither the fit
    nor the lookup tables' build at a first read is timed)."""
    import pyarrow as pa
    import torch

    torch.set_num_threads(1)
    threads = pa.cpu_count()
    pa.set_cpu_count(1)  # one core: pyarrow decodes a row group's columns in this thread
    try:
        return _reader_rates(cfg, data_dir)
    finally:
        pa.set_cpu_count(threads)


def _reader_rates(cfg: Config, data_dir: Path) -> dict[str, Any]:
    from data import preprocess
    from data.files import expand_paths
    from data.generate import generator_schema
    from dlrm.bench.cold_read import cold_read

    files, schema = expand_paths(str(data_dir)), generator_schema(cfg.generate)
    _read_rate(files[:1], schema, cfg.data.batch_size, shuffle=False)  # imports
    cold = cold_read(files, lambda: _read_rate(files, schema, cfg.data.batch_size, shuffle=False))
    _read_rate(files, schema, cfg.data.batch_size, shuffle=False)  # warm: page cache
    out = _read_rate(files, schema, cfg.data.batch_size, shuffle=False)
    prep = preprocess.fit(files, schema, preprocess.Options(encoding="vocabulary"))
    mapped = prep.apply(schema)
    # Untimed: each vocabulary's lookup table is built at its first lookup, once per
    # process (data/vocabulary.py); timed in the epoch it cost 10-20% of its rate here.
    _read_rate(files[:1], mapped, cfg.data.batch_size, shuffle=True, prep=prep)
    out["modes"] = {
        "shuffled": _read_rate(files, schema, cfg.data.batch_size, shuffle=True)["rows_per_s"],
        "vocabulary_shuffled": _read_rate(files, mapped, cfg.data.batch_size,
                                          shuffle=True, prep=prep)["rows_per_s"],
    }
    out["cold"] = cold
    out["files"], out["schema"] = files, schema  # for a workers sweep; not written
    return out


def _read_rate(files: list[str], schema: Any, batch_size: int, shuffle: bool,
               prep: Any = None) -> dict[str, Any]:
    """One epoch of ParquetReader in the calling thread: rows, seconds, rows/s."""
    from data.reader import ParquetReader

    reader = ParquetReader(files, schema, batch_size, shuffle=shuffle, prefetch=0, preprocess=prep)
    rows = 0
    t0 = time.perf_counter()
    for batch in reader.epoch(0):
        rows += batch.size
    seconds = time.perf_counter() - t0
    return {"rows": rows, "seconds": seconds, "rows_per_s": rows / seconds if seconds else 0.0,
            "batch_size": batch_size}


# ------------------------------------------------------------------ report


def _fmt(value: Any, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[dict[str, Any]]) -> str:
    """One line per row: samples/s, ratio, ms per step by section, peak MB per rank."""
    head = ["engine", "ranks", "samples/s", "vs torchrec", *SECTION_HEADS, "peak MB/rank", "tables"]
    body = []
    for r in rows:
        peak = r["peak_memory_mb"]
        body.append([
            r["engine"], str(r["ranks"]), _fmt(r["samples_per_s"], ",.0f"),
            _fmt(r["vs_torchrec"], ".2f") + ("x" if r["vs_torchrec"] is not None else ""),
            *(_fmt(r["sections_ms"][k]) for k in SECTIONS),
            "/".join(f"{m:.0f}" for m in peak) if peak else "-",
            _tables_cell(r.get("tables")),
        ])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "sections: ms per step (rank 0)\n" + "\n".join(lines)


def _tables_cell(tables: dict[str, Any] | None) -> str:
    """"26 x 33.8M rows, 8.65 GB fp32": what the row trained, read from its summary."""
    if not tables:
        return "-"
    return (f"{tables['count']} x {tables['rows'] / 1e6:.1f}M rows, {tables['bytes'] / 1e9:.2f} GB "
            f"{tables['dtype']}")


def format_limit(limit: dict[str, float], rows: list[dict[str, Any]]) -> str:
    """The measured machine, the model's cost and each row's fraction of the bound."""
    fractions = ", ".join(f"{r['engine']}@{r['ranks']} {100 * r['fraction_of_bound']:.1f}%" for r in rows)
    above = [f"{r['engine']}@{r['ranks']}" for r in rows if r["fraction_of_bound"] > 1.0]
    warning = (f"\nwarning: {', '.join(above)} above the bound: the row's timing or the bound's "
               "model is wrong (a bound is measured; no run can pass it)") if above else ""
    return (
        f"machine: mm fp32{' (TF32)' if limit.get('tf32') else ''} {limit['matmul_fp32_gflops']:.1f} GFLOP/s, "
        f"mm bf16 {limit['matmul_bf16_gflops']:.1f} GFLOP/s, copy {limit['bandwidth_gb_s']:.1f} GB/s\n"
        f"model: {limit['flops_per_sample'] / 1e6:.2f} MFLOP/sample (fwd+bwd), "
        f"{limit['embedding_bytes_per_sample'] / 1e3:.1f} kB embedding traffic/sample\n"
        f"limit: {limit['samples_per_s_bound']:,.0f} samples/s with fp32 matmuls, "
        f"{limit['samples_per_s_bound_bf16']:,.0f} with bf16; fraction of its own reached: {fractions}"
        + warning
    )


def format_gpu(limit: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The GPU's measured copies and, per row, its bytes per sample, the bandwidths it
    reached and its own bound; then Hotline against host_embedding and native."""
    lines = [(
        f"gpu: {limit['device']} (torch {limit['torch']}, CUDA {limit['cuda']}): HBM copy "
        f"{limit['hbm_gb_s']:.0f} GB/s, pinned host-to-device {limit['h2d_pinned_gb_s']:.1f} GB/s, "
        f"device-to-host {limit['d2h_pinned_gb_s']:.1f} GB/s"
    )]
    for r in rows:
        lines.append(
            f"{r['engine']}@{r['ranks']}: {r['device_hit_rate']:.1%} of lookups on the GPU; "
            f"HBM {r['hbm_bytes_per_sample'] / 1e3:.1f} kB/sample ({r['hbm_gb_s']:.1f} GB/s, "
            f"{r['hbm_gb_s'] / limit['hbm_gb_s']:.1%} of measured), PCIe "
            f"{r['pcie_bytes_per_sample'] / 1e3:.2f} kB/sample ({r['pcie_gb_s']:.2f} GB/s, "
            f"{r['pcie_gb_s'] / limit['h2d_pinned_gb_s']:.1%}); bound "
            f"{r['samples_per_s_bound']:,.0f} samples/s, {r['fraction_of_bound']:.1%} of it")
    by = {(r["engine"], r["ranks"]): r["samples_per_s"] for r in rows}
    for (engine, ranks), rate in by.items():
        if engine != "hotline":
            continue
        for other in ("host_embedding", "native"):
            if (other, ranks) in by:
                lines.append(f"hotline / {other} at {ranks} rank(s): {rate / by[other, ranks]:.2f}x")
    return "\n".join(lines)


def write_json(path: Path, report: dict[str, Any]) -> None:
    """All figures as JSON, written to a temp name and renamed."""
    write_atomic(path, json.dumps(report, indent=1) + "\n")


def write_png(path: Path, rows: list[dict[str, Any]], limit: dict[str, float], ran: str = "") -> None:
    """Bars of samples/s per row, labelled with their value; the machine limit in
    the title (as a line it would flatten the bars), what ran (config, steps, tables,
    commit, device) under it. Temp name, then rename."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1.6 * len(rows) + 3, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    labels = [f"{r['engine']}\n{r['ranks']} rank(s)" for r in rows]
    palette = dict(zip(ENGINES, ("tab:blue", "tab:cyan", "tab:orange", "tab:olive", "tab:red",
                                 "tab:green", "tab:gray")))
    colors = [palette.get(r["engine"], "tab:purple") for r in rows]
    bars = ax.bar(labels, [r["samples_per_s"] for r in rows], color=colors)
    ax.bar_label(bars, labels=[f"{r['samples_per_s']:,.0f}" for r in rows])
    ax.set(ylabel="samples/s",
           title=f"dlrm bench (machine limit {limit['samples_per_s_bound']:,.0f} samples/s)"
                 + (f"\n{ran}" if ran else ""))
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
