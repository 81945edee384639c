"""Training loop: steps, LR schedule, periodic eval, metrics as JSON lines, checkpoints.

One step, whatever the embedding placement:

    model.begin_step(sparse_lr)        sparse lr for a fused (in-backward) update
    loss = BCE(model(dense, sparse))   forward
    loss.backward()                    KV gradients for the tables, dense grads for MLPs
    dense_opt.step(); model.end_step() dense update; kept KV gradients applied

Resuming from ``RUN/checkpoint`` continues at the exact next batch (the reader's
batch t is a pure function of seed, epoch and t) with the same optimizer state,
so a resumed run ends with the same parameters as one never stopped.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from data.errors import DataError
from data.schema import Schema
from dlrm import checkpoint as ckpt_io
from dlrm.build import build_dense_optimizer, build_model, lr_factor
from dlrm.config import Config, to_dict, to_yaml


@dataclass
class RunData:
    train_files: list[str]
    eval_files: list[str]
    schema: Schema


def resolve_data(cfg: Config) -> RunData:
    """Expand data paths and fix the schema (inferred from train + eval footers)."""
    from data.files import expand_paths
    from data.schema import check_files, infer_schema

    if not cfg.data.train:
        raise DataError("no training data: set data.train=PATH (file, directory or glob)")
    train_files = expand_paths(cfg.data.train)
    eval_files = expand_paths(cfg.data.eval) if cfg.data.eval else []
    schema = infer_schema(
        train_files + eval_files,
        label=cfg.data.label,
        dense=cfg.data.dense or None,
        sparse=cfg.data.sparse or None,
        rows=cfg.data.rows or None,
        tables=cfg.data.tables or None,
    )
    check_files(train_files, schema)
    if eval_files:
        check_files(eval_files, schema)
    return RunData(train_files, eval_files, schema)


def make_reader(
    cfg: Config, files: list[str], schema: Schema, train: bool, rank: int = 0, world_size: int = 1
):
    from data.reader import ParquetReader

    return ParquetReader(
        files,
        schema,
        cfg.data.batch_size if train else cfg.data.eval_batch_size,
        rank=rank,
        world_size=world_size,
        shuffle=cfg.data.shuffle and train,
        seed=cfg.seed,
        shuffle_buffer=cfg.data.shuffle_buffer,
        prefetch=cfg.data.prefetch,
        id_policy=cfg.data.id_policy,
        dense_nan=cfg.data.dense_nan,
    )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise DataError("train.device=cuda but this machine has no CUDA device")
    return torch.device(name)


@torch.no_grad()
def predict(
    model: torch.nn.Module, batches: Iterable, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities and labels over ``batches`` (float64 on the CPU, [N])."""
    was_training = model.training
    model.eval()
    scores, labels = [], []
    for batch in batches:
        if batch.size == 0:
            continue
        batch = batch.to(device, non_blocking=True)
        scores.append(torch.sigmoid(model(batch.dense, batch.sparse)).double().cpu())
        labels.append(batch.labels.double().cpu())
    model.train(was_training)
    if not scores:
        return torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)
    return torch.cat(scores), torch.cat(labels)


def evaluate(model: torch.nn.Module, reader, device: torch.device | str = "cpu") -> dict[str, Any]:
    from dlrm.metrics import evaluate_predictions

    scores, labels = predict(model, reader.epoch(0), device)
    return evaluate_predictions(scores.numpy(), labels.numpy())


class JsonLog:
    """Appends one JSON object per line to RUN/metrics.jsonl."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")


def train(cfg: Config, run_dir: str | Path, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Train ``cfg`` into ``run_dir`` (resuming its checkpoint if there is one)."""
    run_dir = Path(run_dir)
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    echo("config:\n" + to_yaml(cfg).rstrip())
    data = resolve_data(cfg)  # before creating anything: bad data leaves no run dir
    schema = data.schema
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_io.write_atomic(run_dir / "config.yaml", to_yaml(cfg))
    ckpt_io.write_atomic(
        run_dir / "schema.json", json.dumps(ckpt_io.schema_to_json(schema), indent=1)
    )
    device = resolve_device(cfg.train.device)
    model = build_model(cfg, schema, device)
    with contextlib.closing(model):  # the torchrec backend owns a process group
        dense_opt = build_dense_optimizer(cfg, model.dense_parameters())
        progress = ckpt_io.Progress()

        existing = ckpt_io.find_checkpoint(run_dir)
        if existing is not None:
            if cfg.embeddings.backend == "torchrec" and cfg.optim.sparse != "sgd":
                raise ckpt_io.CheckpointError(
                    f"checkpoint {existing}: resuming embeddings.backend=torchrec needs optim.sparse=sgd "
                    "(its fused optimizer state is not saved); use a new --out"
                )
            meta = ckpt_io.load_meta(existing)
            ckpt_io.check_compatible(meta, to_dict(cfg), schema, existing)
            state = ckpt_io.load_state(existing)
            restore(model, dense_opt, state)
            progress = ckpt_io.Progress(**meta["progress"])
            echo(f"resumed from {existing} at step {progress.global_step}")

        reader = make_reader(cfg, data.train_files, schema, train=True)
        steps_per_epoch = reader.steps_per_epoch()
        total_steps = cfg.train.max_steps or cfg.train.epochs * steps_per_epoch
        eval_reader = (
            make_reader(cfg, data.eval_files, schema, train=False) if data.eval_files else None
        )
        log = JsonLog(run_dir / "metrics.jsonl")
        loss_fn = torch.nn.BCEWithLogitsLoss()
        base_dense_lr = cfg.optim.dense_lr

        def save() -> None:
            ckpt_io.save_checkpoint(run_dir, snapshot(model, dense_opt), progress, to_dict(cfg), schema)

        def run_eval() -> dict[str, Any] | None:
            if eval_reader is None:
                return None
            metrics = evaluate(model, eval_reader, device)
            log.write({"event": "eval", "step": progress.global_step, **metrics})
            return metrics

        from tqdm import tqdm

        bar = tqdm(
            total=total_steps,
            initial=progress.global_step,
            disable=not cfg.train.progress,
            file=sys.stderr,
            unit="step",
            dynamic_ncols=True,
        )
        model.train()
        timed_samples, timed_seconds, warmup = 0, 0.0, 5
        window_loss = torch.zeros(())
        window_steps = 0
        last_eval = None
        # total_steps bounds the loop: epochs x steps_per_epoch, or max_steps if set.
        while progress.global_step < total_steps:
            batches = reader.epoch(progress.epoch, start_step=progress.step_in_epoch)
            for batch in batches:
                if progress.global_step >= total_steps:
                    break
                batch = batch.to(device, non_blocking=True)
                t0 = time.perf_counter()
                factor = lr_factor(cfg, progress.global_step)
                for group in dense_opt.param_groups:
                    group["lr"] = base_dense_lr * factor
                model.begin_step(cfg.optim.sparse_lr * factor)
                logits = model(batch.dense, batch.sparse)
                loss = loss_fn(logits, batch.labels)
                dense_opt.zero_grad(set_to_none=True)
                loss.backward()
                dense_opt.step()
                model.end_step()
                window_loss += loss.detach()
                window_steps += 1
                progress.global_step += 1
                progress.step_in_epoch += 1
                elapsed = time.perf_counter() - t0
                if progress.global_step > warmup:
                    timed_samples += batch.size
                    timed_seconds += elapsed
                bar.update(1)
                step = progress.global_step
                if cfg.train.log_every and step % cfg.train.log_every == 0:
                    rate = timed_samples / timed_seconds if timed_seconds else 0.0
                    mean_loss = float(window_loss) / window_steps
                    log.write({"event": "train", "step": step, "loss": mean_loss, "samples_per_s": rate})
                    bar.set_postfix(loss=f"{mean_loss:.4f}", sps=f"{rate:,.0f}")
                    window_loss.zero_()
                    window_steps = 0
                if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < total_steps:
                    last_eval = run_eval()
                if cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0:
                    save()
            else:
                progress.epoch += 1
                progress.step_in_epoch = 0
                continue
            break
        bar.close()
        save()
        last_eval = run_eval() or last_eval
        rate = timed_samples / timed_seconds if timed_seconds else 0.0
        summary = {"event": "summary", "steps": progress.global_step, "samples_per_s": rate}
        if last_eval is not None:
            summary.update({f"eval_{k}": v for k, v in last_eval.items()})
        log.write(summary)
        echo(json.dumps(summary))
        line = f"trained {progress.global_step} steps at {rate:,.0f} samples/s"
        if last_eval is not None:
            line += f"; eval AUC {last_eval['auc']:.4f}, logloss {last_eval['logloss']:.4f}"
        echo(line)
        return summary


def snapshot(model: torch.nn.Module, dense_opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Everything a resume needs, as tensors and plain values (loadable weights_only)."""
    return {
        **model.export_state(),
        "dense_optimizer": dense_opt.state_dict(),
        "rng": torch.get_rng_state(),
    }


def restore(model: torch.nn.Module, dense_opt: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
    try:
        model.import_state(state)
        if dense_opt is not None:
            dense_opt.load_state_dict(state["dense_optimizer"])
    except (KeyError, ValueError) as e:
        raise ckpt_io.CheckpointError(f"checkpoint does not fit the model: {e}") from None
    torch.set_rng_state(state["rng"])
