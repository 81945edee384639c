"""Offline evaluation of a saved run on any Parquet data with the run's schema, whatever
placement trained it (dlrm/eval/model.py: which collection scores it)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from data.bad_data import count
from data.errors import UserError
from data.files import expand_paths
from data.preprocess import load as load_preprocessing
from data.schema import check_files
from dlrm.checkpoint.manager import (
    CHECKPOINTS,
    CheckpointError,
    find_checkpoint,
    load_checkpoint,
    prune_after_read,
)
from dlrm.checkpoint.manifest import load_meta, schema_from_json
from dlrm.checkpoint.readers import reading
from dlrm.config import Config, from_dict
from dlrm.eval.export import EXPORT_FILE, is_export, load_export, read_export
from dlrm.eval.metrics import NotFinite
from dlrm.eval.model import eval_model
from dlrm.eval.predict import evaluate
from dlrm.eval.scores import check_keep, write_scores
from dlrm.parallel.distributed import init_distributed
from dlrm.parallel.shared_dir import check_same_file
from dlrm.train.bad_data_report import gather_lines, records_by_split
from dlrm.train.inputs import make_reader


def evaluate_checkpoint(
    run: str | Path,
    data: str,
    plots_dir: str | None = None,
    batch_size: int | None = None,
    device: str | None = None,
    strict_ids: bool = False,
    tables: str = "stored",
    scores_path: str | None = None,
    keep: list[str] | None = None,
) -> dict[str, Any] | None:
    """Metrics (auc, logloss, ne, calibration, ctr, rows) of a checkpoint on ``data``,
    scored on ``device`` (auto/cpu/cuda; None: the run's ``train.device``): state.pt is
    read onto the CPU and the tables into the model's device, so a run trained on a
    GPU is evaluated on a CPU-only machine with ``device="cpu"``, and back.
    An id past its trained table is looked up as nothing and counted per column in
    ``unseen_ids``; ``strict_ids`` refuses it instead.

    Under torchrun every rank scores its share; the metrics are computed over all
    rows gathered, so they equal one process's. Returns None on ranks other than 0.

    ``tables="int8"``: also scored with every table quantised int8 row-wise
    (embeddings/int8.py), under ``result["int8"]`` beside the stored tables' metrics.

    ``scores_path``: every row's score and label, and the ``keep`` columns, written there
    in the data's order (dlrm/eval/scores.py); ``result["scores"]`` names it.
    """
    with contextlib.ExitStack() as hold:  # the checkpoint stays while it is read
        cfg, schema, prep, fill, identity = open_scored(Path(run), hold)
        if batch_size:
            cfg.data.eval_batch_size = batch_size
        if device is not None:
            cfg.train.device = device  # type: ignore[assignment]  # one of the CLI's choices
        cfg.data.eval_strict_ids = strict_ids  # default: ids training never saw look up as nothing
        files = expand_paths(data)
        check_files(files, schema, cfg.data.on_error)
        if scores_path:
            check_keep(files, keep or [], schema.label)
        info = init_distributed(cfg.train.backend, cfg.train.device, cfg.train.timeout_s)
        check_same_file(identity, info, "checkpoint's file")  # every rank reads the same one
        model = eval_model(cfg, schema, info)
        with contextlib.closing(model):
            fill(model, info)  # verified as it is read
            hold.close()  # read: a run still training may remove it now
            reader = make_reader(cfg, files, schema, False, info.rank, info.world_size, prep)
            try:
                result, scores, labels = evaluate(model, reader, info)
            except NotFinite as e:  # the data's values are checked as read: the weights are bad
                if e.name != "scores":
                    raise UserError(f"data {data}: {e}") from None
                raise UserError(f"checkpoint {identity.parent}: the model's scores are NaN or infinite: its weights "
                                "are (a run that diverged before its loss was checked)") from None
            except ValueError as e:
                raise UserError(f"data {data}: {e}") from None
            if cfg.data.on_error == "skip":  # the run's policy: say what was dropped
                records = records_by_split(gather_lines({"eval": reader}, info)).get("eval", [])
                result["bad_data"] = {**count(records), "records": [r.to_json() for r in records]}
            if tables == "int8":
                result["int8"] = _int8_metrics(model, cfg, files, schema, info, prep)
    if not info.is_main:
        return None
    if scores_path:
        result["scores"] = write_scores(scores_path, files, scores.numpy(), labels.numpy(), keep or [])
    if plots_dir:
        from dlrm.eval.plots import write_plots

        caption = f"{identity.parent}\n{data}, {result['rows']:,} rows"
        result["plots"] = write_plots(scores.numpy(), labels.numpy(), plots_dir, caption=caption)
    return result


def open_scored(run: Path, hold: contextlib.ExitStack
            ) -> tuple[Config, Any, Any, Callable[[Any, Any], None], Path]:
    """(config, schema, preprocessing, fill(model, info), the file naming what is
    scored) of a run's newest checkpoint or of an export (dlrm/eval/export.py); the
    checkpoint is held against the run's pruning until ``hold`` closes."""
    if is_export(run):
        body, cfg = read_export(run)
        prep = load_preprocessing(run) if (run / "preprocessing.json").is_file() else None
        return (cfg, schema_from_json(body["schema"]), prep,
                lambda model, info: load_export(run, body, model), run / EXPORT_FILE)
    ckpt = hold.enter_context(reading(run, find_checkpoint, then=prune_after_read))
    if ckpt is None:
        several = int(os.environ.get("WORLD_SIZE", "1")) > 1
        raise CheckpointError(
            f"no checkpoint in {run} (expected {run}/{CHECKPOINTS}/step-N/meta.json)"
            + (f" on rank {os.environ.get('RANK', '?')} ({socket.gethostname()}); with several "
               "machines the run directory must be on a file system they all mount" if several else ""))
    meta = load_meta(ckpt)
    cfg: Config = from_dict(Config, meta["config"], "")
    schema = schema_from_json(meta["schema"])
    # the run's vocabularies and dense transforms (its sha256 is checked on load)
    prep = load_preprocessing(ckpt.parent.parent) if meta.get("preprocessing") else None
    return (cfg, schema, prep, lambda model, info: load_checkpoint(ckpt, model, None, None, schema, info),
            ckpt / "meta.json")


def _int8_metrics(model: Any, cfg: Config, files: list[str], schema: Any, info: Any, prep: Any) -> dict[str, Any]:
    """The metrics with this rank's tables replaced by their int8 row-wise values
    (a column shard is quantised per slice), and the int8 tables' bytes. The values are
    replaced in place, a chunk at a time (the local tables export views of themselves):
    a table near the memory size is not held twice."""
    import torch

    from embeddings.int8 import int8_bytes, round_trip_

    tensors = model.embeddings.export_tables()
    nbytes = 0
    with torch.no_grad():
        for key, value in tensors.items():
            if key.endswith(".weight"):
                round_trip_(value)
                nbytes += int8_bytes(value.shape[0], value.shape[1])
        model.embeddings.import_tables(tensors)
    model.embeddings.tables_loaded()
    reader = make_reader(cfg, files, schema, False, info.rank, info.world_size, prep)
    metrics, _, _ = evaluate(model, reader, info)
    return {"auc": metrics["auc"], "logloss": metrics["logloss"], "table_bytes": nbytes}
