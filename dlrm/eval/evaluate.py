"""Offline evaluation of a saved run on any Parquet data with the run's schema."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from data.errors import UserError
from dlrm.checkpoint import manager as ckpt_io


def evaluate_checkpoint(
    run: str | Path, data: str, plots_dir: str | None = None, batch_size: int | None = None
) -> dict[str, Any] | None:
    """Metrics (auc, logloss, ne, calibration, ctr, rows) of a checkpoint on ``data``.

    Under torchrun every rank scores its share; the metrics are computed over all
    rows gathered, so they equal one process's. Returns None on ranks other than 0.
    """
    from data.files import expand_paths
    from data.schema import check_files
    from dlrm.parallel.parallelize import build_model
    from dlrm.config import Config, from_dict
    from dlrm.parallel.distributed import init_distributed
    from dlrm.train.trainer import evaluate, make_reader

    ckpt = ckpt_io.find_checkpoint(Path(run))
    if ckpt is None:
        raise ckpt_io.CheckpointError(
            f"no checkpoint in {run} (expected {run}/{ckpt_io.CHECKPOINTS}/step-N/meta.json)")
    meta = ckpt_io.load_meta(ckpt)
    cfg: Config = from_dict(Config, meta["config"], "")
    if batch_size:
        cfg.data.eval_batch_size = batch_size
    schema = ckpt_io.schema_from_json(meta["schema"])
    files = expand_paths(data)
    check_files(files, schema, cfg.data.on_error)
    info = init_distributed(cfg.train.backend, cfg.train.device, cfg.train.timeout_s)
    model = build_model(cfg, schema, info.device, info)
    with contextlib.closing(model):
        ckpt_io.load_checkpoint(ckpt, model, None, None, schema, info)  # verified first
        reader = make_reader(cfg, files, schema, False, info.rank, info.world_size)
        try:
            result, scores, labels = evaluate(model, reader, info)
        except ValueError as e:
            raise UserError(f"data {data}: {e}") from None
        if cfg.data.on_error == "skip":  # the run's policy: say what was dropped
            from data.bad_data import count
            from dlrm.train.bad_data_report import gather_lines, records_by_split

            records = records_by_split(gather_lines({"eval": reader}, info)).get("eval", [])
            result["bad_data"] = {**count(records), "records": [r.to_json() for r in records]}
    if not info.is_main:
        return None
    if plots_dir:
        from dlrm.eval.plots import write_plots

        result["plots"] = write_plots(scores.numpy(), labels.numpy(), plots_dir)
    return result
