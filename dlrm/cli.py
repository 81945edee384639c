"""The ``dlrm`` command line. Every verb is a function of argv, so tests call it
in-process; heavy imports happen inside the verbs so ``dlrm --help`` is instant.

    dlrm generate --out DIR [--rows N] [--config FILE] [--seed S]
    dlrm convert-criteo INPUT... --out DIR [--ids vocabulary|raw|hash] [--min-frequency N]
                        [--max-ind-range R] [--eval-days K | --eval-fraction F] [--workers N]
    dlrm fit --config FILE --data PATH --out DIR [key.sub=value ...]
    dlrm train --config FILE [--out RUN_DIR] [--print-config] [key.sub=value ...]
    dlrm eval --checkpoint RUN_DIR --data PATH [--plots DIR] [--device auto|cpu|cuda] [--strict-ids] [--tables stored|int8]
              [--scores FILE.parquet [--keep COL,...]]
    dlrm export --checkpoint RUN_DIR --out DIR [--tables int8|stored]
    dlrm predict --checkpoint RUN_DIR --data PATH --out FILE.parquet [--keep COL,...] [--device auto|cpu|cuda]
    dlrm plot RUN_DIR [--out FILE.png]
    dlrm plan --config FILE --world-size N [--memory-per-rank SIZE]
    dlrm bench --config FILE [--ranks 1,2] [--steps N] [--out DIR] [--reader-only] [key.sub=value ...]

Exit codes: 0 done; 2 a user error (bad data, config or checkpoint), one line naming
the culprit; 3 a collective failed (a peer rank died or hangs past train.timeout_s);
75 `dlrm train` stopped by SIGTERM or SIGINT after saving a checkpoint: the same
command resumes (dlrm/train/preemption.py); 130 interrupted (Ctrl-C) outside training.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from data.errors import UserError
from data.outputs import local_path, not_the_data, output_dir
from dlrm.train.preemption import PREEMPTED, ignore_agent_signals


def cmd_generate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dlrm generate", description="Write synthetic Criteo-like Parquet data.")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--rows", type=int, default=None, help="rows to write (default: generate.rows)")
    p.add_argument("--config", default=None, help="YAML config; its generate: section is used")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: config seed)")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    a = p.parse_intermixed_args(argv)  # key=value before and after the options
    if a.rows is not None and a.rows < 1:  # 0 wrote no file and said generate.rows' count
        raise UserError(f"--rows {a.rows}: must be >= 1 (default: generate.rows)")
    output_dir(a.out, "--out")  # before any work: a file there is one line, not a traceback
    from data.generate import generate_dataset
    from dlrm.config import load_config

    cfg = load_config(a.config, a.overrides)
    seed = cfg.seed if a.seed is None else a.seed
    files = generate_dataset(a.out, cfg.generate, seed=seed, rows=a.rows)
    print(json.dumps({"out": a.out, "files": len(files), "rows": cfg.generate.rows if a.rows is None else a.rows}))
    return 0


def cmd_convert_criteo(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="dlrm convert-criteo",
        description="Criteo TSV to Parquet: small dense ids, optionally a train/eval split.")
    p.add_argument("inputs", nargs="+", help="Criteo Kaggle/Terabyte TSV files (.gz too), in order (a shell "
                   "glob's text order, day_10 before day_2, is put in day order)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--ids", choices=("vocabulary", "raw", "hash"), default=None,
                   help="vocabulary (default): ids by frequency in the train rows, 0 empty, "
                        "1 rare or unseen; raw: hashed ids, dlrm train maps them; "
                        "hash: h %% (R - 1) + 1 (the default with --max-ind-range)")
    p.add_argument("--min-frequency", type=int, default=1,
                   help="vocabulary: values seen fewer times in the train rows share id 1")
    p.add_argument("--max-ind-range", type=int, default=0, help="hash categorical ids into [0, R)")
    p.add_argument("--eval-days", type=int, default=0,
                   help="the last K inputs (day files) become OUT/eval, the rest OUT/train")
    p.add_argument("--eval-fraction", type=float, default=0.0,
                   help="the last fraction of the rows becomes OUT/eval, the rest OUT/train")
    p.add_argument("--workers", type=int, default=0,
                   help="processes that parse the inputs (one job per input file) and write the "
                        "output parts (0, the default: one per core)")
    a = p.parse_args(argv)
    output_dir(a.out, "--out")
    if a.workers < 0:
        raise UserError(f"--workers {a.workers} must be >= 0")
    from data.criteo_dataset import convert_criteo_dataset, held_out_note, in_day_order

    ids = a.ids or ("hash" if a.max_ind_range else "vocabulary")
    inputs, reordered = in_day_order(a.inputs)
    for note in (reordered, held_out_note(inputs, a.eval_days)):
        if note:
            print(note, file=sys.stderr)
    summary = convert_criteo_dataset(
        inputs, a.out, ids=ids, min_frequency=a.min_frequency, max_ind_range=a.max_ind_range,
        eval_days=a.eval_days, eval_fraction=a.eval_fraction, workers=a.workers)
    print(json.dumps(summary))
    return 0


def cmd_train(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dlrm train", description="Train a DLRM.")
    p.add_argument("--config", default=None, help="YAML config (see configs/)")
    p.add_argument("--out", default="runs/latest", help="run directory (resumed if it has a checkpoint)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config and the full plan (train.print_config=true)")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    a = p.parse_intermixed_args(argv)  # key=value before and after the options
    output_dir(a.out, "--out")
    from dlrm.checkpoint.manager import checkpoints
    from dlrm.config import load_config
    from dlrm.train.trainer import train

    # a resume may keep a removed value its run started with (dlrm/config.py REMOVED_KEYS)
    cfg = load_config(a.config, a.overrides + ["train.print_config=true"] * a.print_config, warn=_rank0_print,
                      resuming=bool(checkpoints(Path(a.out))))
    summary = train(cfg, a.out)
    if summary.get("preempted"):
        ignore_agent_signals()  # checkpoint saved: this process only leaves now
        return PREEMPTED
    return 0


def _rank0_print(line: str) -> None:
    """Print once under torchrun (before its process group: by the RANK it sets)."""
    if os.environ.get("RANK", "0") == "0":
        print(line)


def cmd_fit(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dlrm fit", description="Fit the vocabularies and dense "
                                "statistics once; runs reuse them with data.preprocessing=DIR.")
    p.add_argument("--config", default=None, help="YAML config (its data.* keys)")
    p.add_argument("--data", required=True, help="training Parquet file, directory or glob")
    p.add_argument("--out", required=True, help="directory for preprocessing.json")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    a = p.parse_intermixed_args(argv)  # key=value before and after the options
    output_dir(a.out, "--out")
    from dlrm.config import load_config
    from dlrm.fit import fit_and_save

    cfg = load_config(a.config, a.overrides)
    main = True
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: each rank counts 1/W of it
        from dlrm.parallel.distributed import init_distributed

        # gloo: the pass's exchanges are host arrays, whatever the training backend
        main = init_distributed("gloo", "cpu", cfg.train.timeout_s).is_main
    for line in fit_and_save(cfg, a.data, a.out, write=main):
        if main:
            print(line)
    return 0


def cmd_eval(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dlrm eval", description="Offline metrics of a trained run.")
    p.add_argument("--checkpoint", required=True, help="run directory or checkpoint directory")
    p.add_argument("--data", required=True, help="Parquet file, directory or glob")
    p.add_argument("--plots", default=None, help="write ROC and calibration PNGs here")
    p.add_argument("--batch-size", type=int, default=None, help="default: the run's data.eval_batch_size")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                   help="where to score (default: the run's train.device); a run trained "
                        "on a GPU is evaluated on a CPU-only machine with --device cpu")
    p.add_argument("--tables", choices=("stored", "int8"), default="stored",
                   help="int8: also score with the tables quantised int8 row-wise (AUC beside the stored one)")
    p.add_argument("--strict-ids", action="store_true",
                   help="refuse an id past its trained table (default: look it up as nothing "
                        "and count it per column in unseen_ids)")
    p.add_argument("--scores", default=None,
                   help="write every row's score and label to this Parquet file, in the data's order")
    p.add_argument("--keep", default="",
                   help="with --scores: data columns written beside them (comma-separated, e.g. id,hour)")
    a = p.parse_args(argv)
    keep = list(dict.fromkeys(c.strip() for c in a.keep.split(",") if c.strip()))  # a name given twice: once
    if keep and not a.scores:
        raise UserError("--keep names columns of the --scores file: give --scores FILE.parquet too")
    local_path(a.checkpoint, "--checkpoint")
    if a.scores:
        local_path(a.scores, "--scores")
    if a.scores and Path(a.scores).is_dir():
        raise UserError(f"--scores {a.scores}: is a directory; name a .parquet file")
    if a.scores:
        output_dir(Path(a.scores).parent, "--scores")  # before the eval, as --plots
        not_the_data(a.scores, a.data, "--scores")
    if a.plots is not None:
        output_dir(a.plots, "--plots")
    if a.batch_size is not None and a.batch_size < 1:  # 0 read as "not given" before
        raise UserError(f"--batch-size {a.batch_size}: must be >= 1 (default: the run's data.eval_batch_size)")
    from dlrm.eval.evaluate import evaluate_checkpoint

    result = evaluate_checkpoint(a.checkpoint, a.data, plots_dir=a.plots, batch_size=a.batch_size,
                                 device=a.device, strict_ids=a.strict_ids, tables=a.tables,
                                 scores_path=a.scores, keep=keep)
    if result is not None:  # rank 0 of a torchrun job, or the only process
        print(json.dumps(result))
    return 0


def cmd_predict(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dlrm predict",
                                description="Scores of Parquet rows (no label needed), in the data's order.")
    p.add_argument("--checkpoint", required=True, help="run directory, checkpoint or export directory")
    p.add_argument("--data", required=True, help="Parquet file, directory or glob")
    p.add_argument("--out", required=True, help="the Parquet file to write")
    p.add_argument("--keep", default="", help="data columns written beside the score (comma-separated, e.g. id)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where to score (auto: CUDA if there is one)")
    p.add_argument("--strict-ids", action="store_true",
                   help="refuse an id past its trained table (default: look it up as nothing and count it)")
    a = p.parse_args(argv)
    local_path(a.checkpoint, "--checkpoint")
    local_path(a.out, "--out")
    if Path(a.out).is_dir():
        raise UserError(f"--out {a.out}: is a directory; name a .parquet file")
    output_dir(Path(a.out).parent, "--out")
    not_the_data(a.out, a.data, "--out")
    from dlrm.eval.predict_files import predict_files

    keep = list(dict.fromkeys(c.strip() for c in a.keep.split(",") if c.strip()))  # a name given twice: once
    print(json.dumps(predict_files(a.checkpoint, a.data, a.out, keep, a.device, a.strict_ids)))
    return 0


def cmd_export(argv: list[str]) -> int:
    """A serving copy of a run's model: dense part and whole tables, int8 row-wise or as
    stored (dlrm/eval/export.py); ``dlrm eval --checkpoint DIR`` scores it."""
    p = argparse.ArgumentParser(prog="dlrm export", description="Write a serving copy of a trained run.")
    p.add_argument("--checkpoint", required=True, help="run directory or checkpoint directory")
    p.add_argument("--out", required=True, help="new (or empty) directory for the copy")
    p.add_argument("--tables", choices=("int8", "stored"), default="int8",
                   help="int8: every table int8 row-wise (dim + 8 bytes a row); stored: the run's dtypes")
    a = p.parse_args(argv)
    output_dir(a.out, "--out")
    from dlrm.eval.export import export_run

    body = export_run(a.checkpoint, a.out, a.tables)
    print(json.dumps({"out": a.out, "tables": body["tables"], "table_bytes": body["table_bytes"],
                      "step": body["step"]}))
    return 0


def cmd_plan(argv: list[str]) -> int:
    """Print the sharding plan and per-rank memory of a run; nothing is launched.

    The schema comes from ``--data`` or the config's ``data.train`` when either is
    given (Parquet footers only), else from its ``generate:`` section, so a plan can
    be looked at before any data exists."""
    p = argparse.ArgumentParser(
        prog="dlrm plan", description="Print the sharding plan and per-rank memory of a run."
    )
    p.add_argument("--config", required=True, help="YAML config (see configs/)")
    p.add_argument("--world-size", type=int, required=True, help="ranks to plan for")
    p.add_argument("--memory-per-rank", default=None,
                   help='budget like "16GB" or "512MiB" (default: embeddings.memory_per_rank)')
    p.add_argument("--data", default=None,
                   help="Parquet file, directory or glob (default: data.train)")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    a = p.parse_intermixed_args(argv)  # key=value before and after the options
    from dlrm.config import load_config
    from dlrm.parallel.planning import hotline_note, plan_from_config, run_schema, sizes_source
    from dlrm.parallel.process_memory import (
        half_tables,
        process_bytes,
        process_note,
        tables_in_host_memory,
    )

    cfg = load_config(a.config, a.overrides, warn=print)
    schema, pooling = run_schema(cfg, a.data)
    print(sizes_source(cfg, schema, a.data))
    on_host, why = tables_in_host_memory(cfg)
    process = process_bytes(half_tables(cfg)) if on_host else None
    _, text = plan_from_config(cfg, schema, a.world_size, memory_per_rank=a.memory_per_rank,
                               pooling_factors=pooling, process=process)
    print(text)
    print(process_note(process, why))
    if cfg.embeddings.placement == "hotline":
        print(hotline_note(cfg, schema))
    return 0


def cmd_plot(argv: list[str]) -> int:
    """Training curves of a run (loss, eval points, samples/s by step) from its
    metrics.jsonl, to RUN/curves.png or ``--out``."""
    p = argparse.ArgumentParser(prog="dlrm plot", description="Draw a run's training curves to PNG.")
    p.add_argument("run", help="run directory of dlrm train (reads RUN/metrics.jsonl)")
    p.add_argument("--out", default=None,
                   help="PNG file, or a directory for curves.png (default: RUN/curves.png)")
    a = p.parse_args(argv)
    from pathlib import Path

    from dlrm.eval.curves import CURVES_FILE, write_curves

    out = None
    if a.out is not None:
        out = Path(a.out) / CURVES_FILE if Path(a.out).is_dir() else Path(a.out)
        output_dir(out.parent, "--out")
    path, curves = write_curves(a.run, out)
    print(json.dumps({"out": str(path), "train_points": len(curves.loss),
                      "eval_points": len(curves.eval_auc)}))
    return 0


def cmd_bench(argv: list[str]) -> int:
    from dlrm.bench.run import cmd_bench as bench

    return bench(argv)


VERBS: dict[str, Callable[[list[str]], int]] = {
    "generate": cmd_generate,
    "convert-criteo": cmd_convert_criteo,
    "fit": cmd_fit,
    "train": cmd_train,
    "eval": cmd_eval,
    "export": cmd_export,
    "predict": cmd_predict,
    "plan": cmd_plan,
    "plot": cmd_plot,
    "bench": cmd_bench,
}


def main(argv: list[str] | None = None) -> int:
    """Run a verb; a reader that goes away (``dlrm plan ... | head``) ends it quietly."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # inside the try: a pipe closed early fails here, not at exit
        return code
    except BrokenPipeError:
        # Python's recipe (docs: signal, "Note on SIGPIPE"): point stdout at devnull so
        # the interpreter's last flush has nowhere to fail, and exit as SIGPIPE would.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + 13


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in VERBS:
        print(__doc__.strip(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"dlrm: error: unknown verb {argv[0]!r}", file=sys.stderr)
            return 2
        return 0 if argv else 2
    verb = argv[0]
    # torch.fx warns once, on torchrec's import, about an API we do not use.
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    ok = False
    try:
        code = VERBS[verb](argv[1:])
        ok = code in (0, PREEMPTED)  # a preempted run's ranks all stopped at the same step
        return code
    except UserError as e:
        _error_line(f"dlrm {verb}: error: {e}")
        return 2
    except KeyboardInterrupt:
        _error_line(f"dlrm {verb}: interrupted")
        return 130
    except OSError as e:
        line = _unwritable(e)
        if line is None:
            raise  # a bug: keep the traceback
        _error_line(f"dlrm {verb}: error: {line}")
        return 2
    except RuntimeError as e:
        line = _collective_failure(e)
        if line is None:
            raise  # a bug: keep the traceback
        _error_line(f"dlrm {verb}: error: {line}")
        return 3
    finally:
        _leave_process_group(together=ok)


def _error_line(line: str) -> None:
    """``line`` to stderr in one write, newline included: under torchrun every rank
    writes its error to the same pipe, and ``print``'s two writes (the text, then the
    newline) let two ranks' lines run together on one line (seen 2026-11-26)."""
    sys.stderr.flush()
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


# A disk that is full, over quota, read-only or not ours: the user's to fix, whatever wrote.
_UNWRITABLE = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)


def _unwritable(error: OSError) -> str | None:
    """One line for a file that could not be written for a reason of the disk's, else None."""
    if error.errno not in _UNWRITABLE:
        return None
    if not error.filename:  # a close's flush: the writer did not say which file
        return f"a file could not be written: {error.strerror}"
    from data.atomic import free_bytes
    from embeddings.plan.sizes import format_bytes

    free = free_bytes(error.filename)
    room = f"; {format_bytes(free)} free on its file system" if free is not None else ""
    return f"cannot write {error.filename}: {error.strerror}{room}"


def _collective_failure(error: RuntimeError) -> str | None:
    """One line for a collective whose peer died or hangs (train.timeout_s), else None."""
    if "torch.distributed" not in sys.modules:
        return None
    from dlrm.parallel.distributed import collective_failure

    return collective_failure(error)


def _leave_process_group(together: bool) -> None:
    """Destroy the torchrun process group (if a verb made one) before exit; after
    success all ranks leave together (a barrier), after an error at once."""
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # A rank whose peers already closed their connections can be aborted by
        # gloo's background threads; after an error the peers may never arrive.
        if together:
            dist.barrier()
        dist.destroy_process_group()
