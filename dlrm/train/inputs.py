"""A run's input: its files and schema, and each rank's reader of them.

    data.train / data.eval ──expand──► files ──footers──► Schema (fixed for the run)
    data.train ──one pass──► Preprocessing (vocabularies, dense statistics; saved in RUN,
                            loaded instead on resume): encodings and table rows of the Schema
    files ──ParquetReader(rank r of W)──► batch t of epoch e: a pure function of (seed, e, t)
    data.shuffle_buffer=auto ──► rows (the checkpoint's on resume, else from the footers),
                            decided by rank 0, saved in RUN/config.yaml and every checkpoint
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from data import preprocess as prep_io
from data import shuffle_window
from data.decode_workers import auto_workers, available_cores
from data.errors import DataError
from data.files import expand_paths
from data.fit_settings import check_settings
from data.merged import MergedReader
from data.outputs import local_path
from data.reader import ParquetReader
from data.schema import Schema, check_files, infer_schema, screen_files
from dlrm.checkpoint.manager import checkpoints
from dlrm.checkpoint.manifest import CheckpointError, load_meta
from dlrm.config import Config
from dlrm.parallel.distributed import DistInfo, all_to_all_arrays, broadcast_object


@dataclass
class RunData:
    train_files: list[str]
    eval_files: list[str]
    schema: Schema
    preprocess: prep_io.Preprocessing | None = None


def prep_options(cfg: Config) -> prep_io.Options:
    """The fit's options; under a process group, this rank's share of the pass and the
    all-gather that merges the ranks' counts (the same vocabulary on every rank)."""
    import torch.distributed as dist

    d = cfg.data
    opts = prep_io.Options(d.encoding, dict(d.encodings), d.min_frequency, d.max_rows,
                           d.hash_rows, dict(d.rows), d.dense_transform,
                           dict(d.dense_transforms), d.on_error, d.fit_workers, d.fit_sketch)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        opts.rank, opts.world, opts.gather = dist.get_rank(), dist.get_world_size(), _gather
        opts.exchange = all_to_all_arrays
    opts.progress = opts.rank == 0
    return opts


def _gather(obj: object) -> list[object]:
    """Every rank's ``obj`` in rank order (all_gather_object over the default group)."""
    import torch.distributed as dist

    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def resolve_data(cfg: Config, run_dir: str | Path | None = None) -> RunData:
    """Expand data paths and fix the schema (inferred from the training files' footers:
    an eval id past a table is an unseen id, counted, as README "Ids training never saw"
    says; until 2026-12-07 the eval files sized the tables too, so the eval set changed
    the model trained, and one eval id of 2,000,000 made a 2M-row table) and the
    preprocessing: RUN/preprocessing.json if the run has one (a resume never refits),
    else fitted over the training files (the same on every rank)."""
    if not cfg.data.train:
        raise DataError("no training data: set data.train=PATH (file, directory or glob)")
    train_files = expand_paths(cfg.data.train)
    eval_files = expand_paths(cfg.data.eval) if cfg.data.eval else []
    schema = infer_run_schema(cfg, train_files)
    check_named_columns(cfg, schema)
    usable = screen_files(train_files, schema, cfg.data.on_error).files  # skip: bad files out
    saved = Path(run_dir) / prep_io.FILE if run_dir is not None else None
    if saved is not None and saved.is_file():
        prep = prep_io.load(saved.parent)
        check_settings(prep, prep_options(cfg), schema,
                       str(saved), "a run directory keeps its fit (a rerun, a resume): give the run the "
                       "fit's setting, or train in another --out to fit anew")
    elif cfg.data.preprocessing:
        local_path(cfg.data.preprocessing, "data.preprocessing")
        prep = prep_io.load(Path(cfg.data.preprocessing), usable)
        check_fit_covers(prep, schema, cfg.data.preprocessing)
        check_settings(prep, prep_options(cfg), schema,
                       f"data.preprocessing={cfg.data.preprocessing}", "a reused fit is taken as it is: give "
                       "this run the fit's setting, or fit again (dlrm fit)")
    else:
        prep = prep_io.fit(usable, schema, prep_options(cfg))
        if prep.vocabularies and run_dir is not None:
            prep.notes.append(f"preprocessing: another run on the same data reuses this fit "
                              f"with data.preprocessing={run_dir}")
    schema = prep.apply(schema)
    check_table_sizes(cfg, schema)
    check_files(train_files, schema, cfg.data.on_error)  # skip: reported by the readers
    if eval_files:
        check_files(eval_files, schema, cfg.data.on_error)
    return RunData(train_files, eval_files, schema, prep)


def infer_run_schema(cfg: Config, files: list[str]) -> Schema:
    """``infer_schema`` of ``files`` with the columns ``cfg.data`` names (before the fit)."""
    return infer_schema(files, label=cfg.data.label, dense=cfg.data.dense or None,
                        sparse=cfg.data.sparse or None, rows=cfg.data.rows or None,
                        tables=cfg.data.tables or None, on_error=cfg.data.on_error,
                        exclude=cfg.data.exclude or None)


MAX_TABLE_BYTES = 2**50  # 1 PiB: no machine, nor any run of them, holds a table this big


def check_fit_covers(prep: prep_io.Preprocessing, schema: Schema, where: str) -> None:
    """A reused fit (data.preprocessing=DIR) maps every sparse table of this run: one
    fitted with other columns (another data.exclude or data.sparse) would leave a table
    to identity, sized by its raw ids."""
    missing = [f.name for f in schema.sparse if f.table_name not in prep.encodings]
    if missing:
        raise DataError(f"data.preprocessing={where} has no mapping for the sparse column"
                        f"{'s' * (len(missing) > 1)} {', '.join(missing)}: it was fitted over other "
                        "columns; run with the data.sparse / data.exclude it was fitted with, or fit again")


def check_table_sizes(cfg: Config, schema: Schema) -> None:
    """A table beyond MAX_TABLE_BYTES, which only ids as wide as 64-bit hashes taken as
    rows (identity, max id + 1) give: one line naming it and the ways out, before
    anything is written or allocated (allocating it was an overflow traceback)."""
    from embeddings.rounding import weight_dtype

    for f in schema.sparse:
        table = f.table_name
        dtype = weight_dtype(cfg.embeddings.dtypes.get(table, cfg.embeddings.dtype))
        weights = f.rows * cfg.model.embedding_dim * dtype.itemsize
        if weights > MAX_TABLE_BYTES:
            columns = [g.name for g in schema.sparse if g.table_name == table]
            raise DataError(
                f"table {table!r} would have {f.rows:,} rows (identity ids up to {f.rows - 1:,}, from "
                f"the footers), {weights / 2**50:,.0f} PiB of weights: more than any machine holds; map "
                f"the ids with data.encodings={{{columns[0]}: vocabulary}} (or hash), size the table "
                f"with data.rows={{{columns[0]}: N}} and data.id_policy=hash, or leave the column out "
                f"with data.exclude=[{columns[0]}]")


def check_named_columns(cfg: Config, schema: Schema) -> None:
    """Config keys that name columns or tables name ones the data has: a typo in
    data.encodings, data.dense_transforms, embeddings.plan or embeddings.dtypes would otherwise be
    ignored (the column trained as if it were not named) without a word."""
    tables = {f.table_name for f in schema.sparse}
    named = [("data.encodings", cfg.data.encodings, {f.name for f in schema.sparse}, "sparse feature"),
             ("data.dense_transforms", cfg.data.dense_transforms, set(schema.dense), "dense column"),
             ("embeddings.plan", cfg.embeddings.plan, tables, "table"),
             ("embeddings.dtypes", cfg.embeddings.dtypes, tables, "table")]
    for key, mapping, known, kind in named:
        for name in mapping:
            if name not in known:
                raise DataError(f"config key {key} names {name!r}, which is not a {kind} of the data "
                                f"(there are {len(known)}: {', '.join(sorted(known)[:8])}"
                                f"{', ...' if len(known) > 8 else ''})")


def eval_id_policy(cfg: Config) -> str:
    """Eval's policy for an id past its trained table: the training data's hash or
    modulo (the same rows training used); else "drop" (looked up as nothing, counted
    per column beside the AUC), or "error" with data.eval_strict_ids=true."""
    if cfg.data.id_policy != "error":
        return cfg.data.id_policy
    return "error" if cfg.data.eval_strict_ids else "drop"


def resolve_shuffle_buffer(cfg: Config, data: RunData, run_dir: str | Path,
                           info: DistInfo) -> Config:
    """``cfg`` with data.shuffle_buffer as rows, the same on every rank (rank 0 decides):
    ``auto`` takes the value the run's newest readable checkpoint was written with, so a
    resume keeps its batches (a run from before ``auto`` saved 65536, the default then);
    a new run's from the training files' footers (data/shuffle_window.py), as each
    reader would. The caller saves it in RUN/config.yaml and the checkpoints."""
    value = cfg.data.shuffle_buffer
    if shuffle_window.setting(value) != shuffle_window.AUTO:
        return cfg
    rows = None
    if info.is_main:
        rows = saved_shuffle_buffer(Path(run_dir))
        if rows is None:
            screened = screen_files(data.train_files, data.schema, cfg.data.on_error)
            rows = shuffle_window.auto_rows(screened.row_groups, data.schema)
    rows = broadcast_object(rows, info)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, shuffle_buffer=str(rows)))


def saved_shuffle_buffer(run_dir: Path) -> int | None:
    """data.shuffle_buffer in the config of ``run_dir``'s newest checkpoint whose
    meta.json reads (None: no checkpoint, or it says ``auto``)."""
    for ckpt in checkpoints(run_dir):
        try:
            value = load_meta(ckpt)["config"]["data"]["shuffle_buffer"]
        except (CheckpointError, KeyError, TypeError):
            continue  # corrupt or of another version: the resume itself says so
        setting = shuffle_window.setting(value)
        return None if setting == shuffle_window.AUTO else int(setting)
    return None


def make_reader(
    cfg: Config, files: list[str], schema: Schema, train: bool, rank: int = 0, world_size: int = 1,
    preprocess: prep_io.Preprocessing | None = None, pin_memory: bool = False,
) -> ParquetReader | MergedReader:
    """This rank's reader; with data.order_world_size=W on one process, the merged
    reader of a W-rank job's ranks (same global batches, same order). ``pin_memory``
    (training on CUDA): batches page-locked by the reader's thread (the merged
    reader's are made on the consumer's thread: not pinned)."""

    def reader(r: int, w: int, prefetch: int, workers: int = 0, pin: bool = False) -> ParquetReader:
        return order_reader(cfg, files, schema, preprocess, r, w, cfg.data.batch_size if train else
                            cfg.data.eval_batch_size, cfg.seed, cfg.data.shuffle and train,
                            cfg.data.shuffle_buffer, train, prefetch, workers, pin)

    order = cfg.data.order_world_size
    if order > 1 and world_size == 1:
        return MergedReader([reader(r, order, cfg.data.prefetch) for r in range(order)])
    return reader(rank, world_size, cfg.data.prefetch, decode_workers(cfg), pin_memory)


def order_reader(
    cfg: Config, files: list[str], schema: Schema, preprocess: prep_io.Preprocessing | None, rank: int,
    world_size: int, batch_size: int, seed: int, shuffle: bool, shuffle_buffer: str | int, train: bool = True,
    prefetch: int | None = None, workers: int = 0, pin: bool = False,
) -> ParquetReader:
    """Rank ``rank`` of ``world_size``'s reader in the order (batch size, seed, shuffle)
    given, with ``cfg``'s other data settings (dlrm/train/carry_order.py reads an old
    order's streams with it)."""
    return ParquetReader(
        files,
        schema,
        batch_size,
        rank=rank,
        world_size=world_size,
        shuffle=shuffle,
        seed=seed,
        shuffle_buffer=shuffle_window.setting(shuffle_buffer),
        prefetch=cfg.data.prefetch if prefetch is None else prefetch,
        id_policy=cfg.data.id_policy if train else eval_id_policy(cfg),
        dense_nan=cfg.data.dense_nan,
        on_error=cfg.data.on_error,
        preprocess=preprocess,
        workers=workers,
        pin_memory=pin,
        # the processes of a machine share /dev/shm; auto fits the workers to it
        shm_share=1.0 / _local_ranks(),
        fit_workers=cfg.data.workers == "auto",
    )


def decode_workers(cfg: Config) -> int:
    """data.workers as a count: ``auto`` is, with CUDA, the cores the training processes
    leave free (cores / LOCAL_WORLD_SIZE minus the trainer's one thread), and 0 on CPU,
    where the trainer's intra-op threads already use every core."""
    if cfg.data.workers != "auto":
        return int(cfg.data.workers)
    device = cfg.train.device
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return 0
    return auto_workers(available_cores(), _local_ranks(), trainer_threads=1)


def _local_ranks() -> int:
    """This machine's training processes (torchrun's LOCAL_WORLD_SIZE; 1 without it)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def reader_remedy(cfg: Config) -> str:
    """What the reader-bottleneck warning tells the user to change: the decode workers,
    by what this run has and the cores this process may use."""
    workers, cores = decode_workers(cfg), available_cores()
    if workers == 0:
        return (f"decode in worker processes beside the step: data.workers=N (0 in this run; "
                f"{cores} cores here)")
    return f"more data.workers where cores are free ({workers} in this run; {cores} cores here)"
