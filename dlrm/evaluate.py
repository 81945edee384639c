"""Offline evaluation of a saved run on any Parquet data with the run's schema."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from data.errors import UserError
from dlrm import checkpoint as ckpt_io


def evaluate_checkpoint(
    run: str | Path, data: str, plots_dir: str | None = None, batch_size: int | None = None
) -> dict[str, Any]:
    """Metrics JSON (auc, logloss, ne, calibration, ctr, rows) of a checkpoint on ``data``."""
    from data.files import expand_paths
    from data.schema import check_files
    from dlrm.build import build_model
    from dlrm.config import Config, from_dict
    from dlrm.metrics import evaluate_predictions
    from dlrm.trainer import make_reader, predict, resolve_device, restore

    ckpt = ckpt_io.find_checkpoint(Path(run))
    if ckpt is None:
        raise ckpt_io.CheckpointError(f"no checkpoint in {run} (expected {run}/checkpoint/meta.json)")
    meta = ckpt_io.load_meta(ckpt)
    cfg: Config = from_dict(Config, meta["config"], "")
    if batch_size:
        cfg.data.eval_batch_size = batch_size
    schema = ckpt_io.schema_from_json(meta["schema"])
    files = expand_paths(data)
    check_files(files, schema)
    device = resolve_device(cfg.train.device)
    model = build_model(cfg, schema, device)
    with contextlib.closing(model):
        restore(model, None, ckpt_io.load_state(ckpt))
        scores, labels = predict(model, make_reader(cfg, files, schema, train=False).epoch(0), device)
    try:
        result = evaluate_predictions(scores.numpy(), labels.numpy())
    except ValueError as e:
        raise UserError(f"data {data}: {e}") from None
    if plots_dir:
        from dlrm.plots import write_plots

        result["plots"] = write_plots(scores.numpy(), labels.numpy(), plots_dir)
    return result
