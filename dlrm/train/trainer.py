"""Training loop: steps, LR schedule, periodic eval, metrics as JSON lines, checkpoints.

One step, whatever the embedding placement or the number of ranks:

    model.begin_step(sparse_lr)         sparse lr for a fused (in-backward) update
    for each of k micro-batches:        (k = train.accumulate; DDP syncs on the last)
        loss = sum(BCE(model(dense, sparse))) * W / rows of the k global batches
        loss.backward()                 KV gradients for the tables, dense grads for MLPs
    dense_opt.step(); model.end_step()  dense update; kept KV gradients applied

Under torchrun every rank runs this loop on its share of each global batch
(see dlrm/parallel.py for why the loss is scaled by W); rank 0 prints, logs and
writes the run directory's files.

Resuming from ``RUN/checkpoints/`` continues at the exact next batch (the reader's
batch t is a pure function of seed, epoch and t) with the same optimizer state,
so a resumed run ends with the same parameters as one never stopped.
"""

from __future__ import annotations

import contextlib
import itertools
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
from dlrm.checkpoint import manager as ckpt_io
from dlrm.parallel.parallelize import build_dense_optimizer, build_model, lr_factor
from dlrm.config import Config, to_dict, to_yaml
from dlrm.parallel.distributed import DistInfo, all_gather_rows, all_reduce_sum, barrier, init_distributed
from dlrm.train.host_memory import reuse_freed_memory
from dlrm.parallel.ddp import loss_scale
from dlrm.train.profiling import StepProfiler
from embeddings.timing import EMBEDDING_SECTIONS, TIMER

SECTIONS = ("data_wait", "input_alltoall", "lookup", "output_alltoall", "mlp",
            "embedding_update", "dense_update")


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
        on_error=cfg.data.on_error,
    )
    check_files(train_files, schema, cfg.data.on_error)  # skip: bad files left out, reported
    if eval_files:
        check_files(eval_files, schema, cfg.data.on_error)
    return RunData(train_files, eval_files, schema)


def make_reader(
    cfg: Config, files: list[str], schema: Schema, train: bool, rank: int = 0, world_size: int = 1
):
    """This rank's reader; with data.order_world_size=W on one process, the merged
    reader of a W-rank job's ranks (same global batches, same order)."""
    from data.reader import ParquetReader

    def reader(r: int, w: int, prefetch: int) -> ParquetReader:
        return ParquetReader(
            files,
            schema,
            cfg.data.batch_size if train else cfg.data.eval_batch_size,
            rank=r,
            world_size=w,
            shuffle=cfg.data.shuffle and train,
            seed=cfg.seed,
            shuffle_buffer=cfg.data.shuffle_buffer,
            prefetch=prefetch,
            id_policy=cfg.data.id_policy,
            dense_nan=cfg.data.dense_nan,
            on_error=cfg.data.on_error,
        )

    order = cfg.data.order_world_size
    if order > 1 and world_size == 1:
        from data.merged import MergedReader

        return MergedReader([reader(r, order, cfg.data.prefetch) for r in range(order)])
    return reader(rank, world_size, cfg.data.prefetch)


@torch.no_grad()
def predict(
    model: torch.nn.Module, batches: Iterable, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities and labels over ``batches`` (float64 on the CPU, [N]).

    Every batch goes through the model, empty ones too: with several ranks each
    forward is a collective."""
    was_training = model.training
    model.eval()
    scores, labels = [torch.zeros(0, dtype=torch.float64)], [torch.zeros(0, dtype=torch.float64)]
    for batch in batches:
        batch = batch.to(device, non_blocking=True)
        scores.append(torch.sigmoid(model(batch.dense, batch.sparse)).double().cpu())
        labels.append(batch.labels.double().cpu())
    model.train(was_training)
    return torch.cat(scores), torch.cat(labels)


def evaluate(
    model: torch.nn.Module, reader, info: DistInfo | None = None
) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """Metrics of the whole eval set (all ranks' shares gathered), scores, labels."""
    from dlrm.eval.metrics import evaluate_predictions

    info = info or DistInfo()
    scores, labels = predict(model, reader.epoch(0), info.device)
    scores, labels = all_gather_rows(scores, info), all_gather_rows(labels, info)
    return evaluate_predictions(scores.numpy(), labels.numpy()), scores, labels


class JsonLog:
    """Appends one JSON object per line to RUN/metrics.jsonl (rank 0 only)."""

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path = path
        self.enabled = enabled

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")


def train(cfg: Config, run_dir: str | Path, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Train ``cfg`` into ``run_dir`` (resuming its checkpoint if there is one)."""
    run_dir = Path(run_dir)
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    if cfg.train.reuse_host_memory:
        reuse_freed_memory()
    info = init_distributed(cfg.train.backend, cfg.train.device, cfg.train.timeout_s)
    say = echo if info.is_main else (lambda _: None)
    say("config:\n" + to_yaml(cfg).rstrip())
    data = resolve_data(cfg)  # before creating anything: bad data leaves no run dir
    schema = data.schema
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt_io.write_atomic(run_dir / "config.yaml", to_yaml(cfg))
        ckpt_io.write_atomic(
            run_dir / "schema.json", json.dumps(ckpt_io.schema_to_json(schema), indent=1)
        )
    hot_profile = None
    if cfg.embeddings.placement == "hotline":
        from dlrm.parallel.parallelize import tables_from_schema
        from dlrm.train.hotline import make_profile

        tables = tables_from_schema(schema, cfg.model.embedding_dim, cfg.embeddings.pooling)
        reader = make_reader(cfg, data.train_files, schema, True, info.rank, info.world_size)
        hot_profile = make_profile(cfg, tables, reader, run_dir, say, info)
    model = build_model(cfg, schema, info.device, info, hot_profile)
    plan = getattr(model.embeddings, "plan", None) if hasattr(model, "embeddings") else None
    if plan is not None and info.is_main:
        from dlrm.parallel.planning import describe
        from embeddings.plan.sizes import parse_size

        say(describe(cfg, schema, plan, parse_size(cfg.embeddings.memory_per_rank)))
        ckpt_io.write_atomic(run_dir / "plan.json", plan.to_json())
    barrier(info)
    with contextlib.closing(model):  # the torchrec backend owns a process group
        return _fit(cfg, run_dir, model, data, info, say)


def _fit(
    cfg: Config,
    run_dir: Path,
    model: torch.nn.Module,
    data: RunData,
    info: DistInfo,
    say: Callable[[str], None],
) -> dict[str, Any]:
    schema = data.schema
    dense_opt = build_dense_optimizer(cfg, model.dense_parameters())
    progress = ckpt_io.Progress()
    existing = ckpt_io.find_resumable(run_dir, info, say)  # newest that verifies
    if existing is not None:
        if cfg.embeddings.backend == "torchrec" and cfg.optim.sparse != "sgd":
            raise ckpt_io.CheckpointError(
                f"checkpoint {existing}: resuming embeddings.backend=torchrec needs optim.sparse=sgd "
                "(its fused optimizer state is not saved); use a new --out"
            )
        progress = ckpt_io.load_checkpoint(existing, model, dense_opt, to_dict(cfg), schema, info,
                                           verified=True)
        say(f"resumed from {existing} at step {progress.global_step}")

    reader = make_reader(cfg, data.train_files, schema, True, info.rank, info.world_size)
    accumulate = cfg.train.accumulate
    steps_per_epoch = -(-reader.steps_per_epoch() // accumulate)  # optimizer steps
    total_steps = cfg.train.max_steps or cfg.train.epochs * steps_per_epoch
    eval_reader = (
        make_reader(cfg, data.eval_files, schema, False, info.rank, info.world_size)
        if data.eval_files else None
    )
    bad_data = None  # data.on_error=skip: what the readers dropped, RUN/bad_data.jsonl
    if cfg.data.on_error == "skip":
        from dlrm.train.bad_data_report import BadDataReport

        readers = {"train": reader, **({"eval": eval_reader} if eval_reader else {})}
        bad_data = BadDataReport(run_dir, info, readers, resumed=existing is not None)
    log = JsonLog(run_dir / "metrics.jsonl", enabled=info.is_main)
    loss_fn = torch.nn.BCEWithLogitsLoss(reduction="sum")

    schedule = ckpt_io.CheckpointSchedule(
        cfg.train.checkpoint_every, cfg.train.checkpoint_seconds, cfg.train.keep_checkpoints, info,
        saved_step=progress.global_step if existing is not None else None)
    trace = None
    if cfg.train.trace_rows:
        from dlrm.train.trace import RowTrace

        trace = RowTrace(run_dir, cfg.train.trace_rows, schema, info.rank, progress.global_step)

    def save() -> None:
        if schedule.saved_step == progress.global_step:
            return  # saved at this step already
        ckpt_io.save_checkpoint(run_dir, model, dense_opt, progress, to_dict(cfg), schema, info,
                                keep=cfg.train.keep_checkpoints)
        schedule.saved(progress.global_step)
        if bad_data is not None:
            bad_data.write()  # the records so far, kept through a crash

    def run_eval() -> dict[str, Any] | None:
        if eval_reader is None:
            return None
        metrics = evaluate(model, eval_reader, info)[0]
        log.write({"event": "eval", "step": progress.global_step, **metrics})
        return metrics

    hotline = None
    if cfg.embeddings.placement == "hotline":
        from dlrm.train.hotline import HotlineSteps

        hotline = HotlineSteps(model, cfg, info)

    # train.precision=bf16: matmuls of the dense arch in bf16 (embedding lookups and
    # all-to-alls are not autocast ops: they stay fp32), loss and updates in fp32.
    autocast = torch.autocast(info.device.type, dtype=torch.bfloat16,
                              enabled=cfg.train.precision == "bf16")

    from tqdm import tqdm

    bar = tqdm(total=total_steps, initial=progress.global_step, unit="step", file=sys.stderr,
               disable=not (cfg.train.progress and info.is_main), dynamic_ncols=True)
    model.train()
    timed_rows, timed_seconds, timed_steps, warmup = 0, 0.0, 0, 5
    # BCE sum (a device tensor: no sync per step) and rows of this rank since the last log
    window_loss, window_local_rows = torch.zeros((), device=info.device), 0
    window_rows, window_seconds = 0, 0.0  # global rows and wall time since the last log
    TIMER.enabled = cfg.train.time_sections
    TIMER.reset()
    profiler = StepProfiler(cfg.train.profile_start, cfg.train.profile_steps, run_dir, info.rank,
                            info.device)
    last_eval = None
    while progress.global_step < total_steps:
        batches = iter(reader.epoch(progress.epoch, start_step=progress.step_in_epoch))
        while progress.global_step < total_steps:
            first = progress.step_in_epoch
            t_fetch = time.perf_counter()
            group = list(itertools.islice(batches, accumulate))
            if not group:  # epoch done
                progress.epoch += 1
                progress.step_in_epoch = 0
                break
            t0 = time.perf_counter()
            if bad_data is None:
                global_rows = sum(reader.global_batch_size(first + i) for i in range(len(group)))
            else:  # dropped rows shorten batches: count what this step trains on all ranks
                global_rows = int(all_reduce_sum([sum(b.size for b in group)], info)[0])
                bad_data.rows_trained += global_rows
            factor = lr_factor(cfg, progress.global_step)
            for param_group in dense_opt.param_groups:
                param_group["lr"] = cfg.optim.dense_lr * factor
            profiler.before(progress.global_step)
            model.begin_step(cfg.optim.sparse_lr * factor)
            dense_opt.zero_grad(set_to_none=True)
            embedding_before = sum(TIMER.totals[s] for s in EMBEDDING_SECTIONS)
            for i, batch in enumerate(group):
                # Hotline: popular then non-popular micro-batch, cold rows gathered ahead.
                micro = hotline.micro_batches(batch) if hotline else [(batch, None, True)]
                for part, cold, last in micro:
                    sync = last and i == len(group) - 1  # DDP syncs on the step's last backward
                    part = part.to(info.device, non_blocking=True)
                    with contextlib.nullcontext() if sync else _no_sync(model):
                        with autocast:
                            logits = (model(part.dense, part.sparse) if cold is None
                                      else model(part.dense, part.sparse, cold=cold))
                        bce = loss_fn(logits.float(), part.labels)
                        (bce * loss_scale(info, global_rows, cfg)).backward()
                    window_loss += bce.detach()
                    window_local_rows += part.size
            t_dense = time.perf_counter()
            forward_backward = t_dense - t0
            dense_opt.step()
            dense_update = time.perf_counter() - t_dense
            model.end_step()
            if hotline:
                hotline.after_step(progress.global_step + 1)
            profiler.after(progress.global_step)
            progress.global_step += 1
            progress.step_in_epoch = first + len(group)
            if trace:
                trace.write(progress, first, group)
            elapsed = time.perf_counter() - t_fetch  # data wait included
            window_rows += global_rows
            window_seconds += elapsed
            if progress.global_step == warmup:
                TIMER.reset()  # sections count timed steps only
            if progress.global_step > warmup:
                timed_rows += global_rows
                timed_seconds += elapsed
                timed_steps += 1
                if TIMER.enabled:
                    inside = sum(TIMER.totals[s] for s in EMBEDDING_SECTIONS) - embedding_before
                    TIMER.totals["data_wait"] += t0 - t_fetch
                    TIMER.totals["mlp"] += forward_backward - inside
                    TIMER.totals["dense_update"] += dense_update
            bar.update(1)
            step = progress.global_step
            if cfg.train.log_every and step % cfg.train.log_every == 0:
                loss_sum, rows = all_reduce_sum([float(window_loss), window_local_rows], info)
                rate = timed_rows / timed_seconds if timed_seconds else 0.0
                log.write({"event": "train", "step": step, "loss": loss_sum / max(rows, 1),
                           "samples_per_s": rate,
                           "window_samples_per_s": window_rows / max(window_seconds, 1e-9)})
                window_rows, window_seconds = 0, 0.0
                if hotline:
                    log.write({"event": "hotline", "step": step, **hotline.stats()})
                bar.set_postfix(loss=f"{loss_sum / max(rows, 1):.4f}", sps=f"{rate:,.0f}")
                window_loss.zero_()
                window_local_rows = 0
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < total_steps:
                last_eval = run_eval()
            if schedule.due(step):
                save()
    bar.close()
    profiler.close()
    save()
    last_eval = run_eval() or last_eval
    rate = timed_rows / timed_seconds if timed_seconds else 0.0
    summary: dict[str, Any] = {"event": "summary", "steps": progress.global_step,
                               "samples_per_s": rate, "world_size": info.world_size,
                               "peak_memory_mb": peak_memory_mb(info)}
    if TIMER.enabled and timed_steps:
        summary["sections_ms"] = {
            name: 1000 * TIMER.totals[name] / timed_steps for name in SECTIONS
        }
    TIMER.enabled = False
    if hotline:
        summary["hotline"] = hotline.stats(whole_run=True)
        hotline.close()
    if last_eval is not None:
        summary.update({f"eval_{k}": v for k, v in last_eval.items()})
    if bad_data is not None:
        summary["bad_data"] = bad_data.write()
    log.write(summary)
    say(json.dumps(summary))
    line = f"trained {progress.global_step} steps at {rate:,.0f} samples/s"
    if last_eval is not None:
        line += f"; eval AUC {last_eval['auc']:.4f}, logloss {last_eval['logloss']:.4f}"
    say(line)
    if bad_data is not None:
        say(bad_data.line(summary["bad_data"]))
    return summary


def peak_memory_mb(info: DistInfo) -> list[float]:
    """Peak memory of every rank: CUDA allocations on a GPU, else the process's max RSS."""
    if info.device.type == "cuda":
        mine = torch.cuda.max_memory_allocated(info.device) / 2**20
    else:
        import resource

        mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return all_gather_rows(torch.tensor([mine], dtype=torch.float64), info).tolist()


def _no_sync(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """DDP's no_sync for micro-batches before the last one (nothing without DDP)."""
    from torch.nn.parallel import DistributedDataParallel

    arch = getattr(model, "dense_arch", None)
    if isinstance(arch, DistributedDataParallel):
        return arch.no_sync()
    return contextlib.nullcontext()
