"""Training: one ``Trainer`` per run; ``step()`` is one optimizer step.

    Trainer.step(batches)                    k = train.accumulate batches of this rank
        model.begin_step(sparse_lr)          sparse lr for a fused (in-backward) update
        for each batch, its pass:            (Hotline: the batch once, its cold rows
                                              gathered meanwhile; else the batch)
            loss = sum(BCE(model(dense, sparse))) * loss_scale
            loss.backward()                  KV gradients for the tables, dense grads for
                                             the MLPs (DDP syncs on the step's last one)
        dense_opt.step(); model.end_step()   dense update; kept KV gradients applied

Around it ``fit()`` logs, evaluates and checkpoints on schedule, and stops after a
step with a checkpoint when any rank got SIGTERM or SIGINT (dlrm/train/preemption.py).
Under torchrun every rank runs this loop on its share of each global batch
(dlrm/parallel/ddp.py says why the loss is scaled as it is); rank 0 prints, logs and
writes the run directory's files.

Resuming from ``RUN/checkpoints/`` continues at the exact next batch (the reader's
batch t is a pure function of seed, epoch and t) with the same optimizer state,
so a resumed run ends with the same parameters as one never stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tqdm import tqdm

from data.atomic import write_atomic
from data.batch import Batch
from data.preprocess import FILE as PREP_FILE
from data.preprocess import save as save_preprocessing
from dlrm.checkpoint.manager import (
    CHECKPOINTS,
    CheckpointError,
    Progress,
    find_checkpoint,
    resume_checkpoint,
    save_checkpoint,
    will_resume,
)
from dlrm.checkpoint.manifest import load_meta, schema_to_json
from dlrm.checkpoint.schedule import CheckpointSchedule
from dlrm.checkpoint.warm_start import check_init_from, init_from
from dlrm.config import Config, ConfigError, to_dict, to_yaml
from dlrm.eval.metrics import NotFinite
from dlrm.eval.predict import evaluate
from dlrm.models.dlrm import unwrap
from dlrm.models.interface import RecModel
from dlrm.parallel.ddp import loss_scale
from dlrm.parallel.distributed import (
    DistInfo,
    all_reduce_sum,
    barrier,
    broadcast_object,
    init_distributed,
)
from dlrm.parallel.parallelize import build_model
from dlrm.parallel.planning import describe, plan_from_config, run_tables
from dlrm.parallel.shared_dir import check_shared_dir
from dlrm.train.bad_data_report import BadDataReport
from dlrm.train.best import best_eval, logged_evals, mark
from dlrm.train.carry_order import (
    ORDER_KEYS,
    CarriedEpoch,
    carried_epoch,
    differences,
    order_then,
    reading_order,
)
from dlrm.train.dense_graphs import DenseGraphs
from dlrm.train.dense_graphs import why_not as dense_graphs_why_not
from dlrm.train.device_prefetch import DevicePrefetcher
from dlrm.train.divergence import Diverged, DivergenceGuard
from dlrm.train.graphs import WARMUP as GRAPH_WARMUP
from dlrm.train.graphs import GraphedStep, set_lrs
from dlrm.train.graphs import why_not as graphs_why_not
from dlrm.train.header import header
from dlrm.train.host_memory import reuse_freed_memory
from dlrm.train.hotline import HotlineSteps, make_profile
from dlrm.train.hotline_graph import HotlineGraph
from dlrm.train.hotline_graph import why_not as hotline_graph_why_not
from dlrm.train.inputs import (
    RunData,
    make_reader,
    order_reader,
    reader_remedy,
    resolve_data,
    resolve_shuffle_buffer,
)
from dlrm.train.lookahead import Lookahead
from dlrm.train.meter import JsonLog, Meter
from dlrm.train.optim import build_dense_optimizer, lr_factor
from dlrm.train.precision import decide_precision
from dlrm.train.preemption import PREEMPTED, Preemption, signal_name
from dlrm.train.profiling import StepProfiler
from dlrm.train.run_lock import RunLock
from dlrm.train.same_data import check_resume_data, data_identity, eval_overlap
from dlrm.train.staged import StagedBatches
from dlrm.train.trace import RowTrace
from embeddings.collection import warn_fp16_overflow
from embeddings.interface import Prefetched
from embeddings.kernels import why_not_triton
from embeddings.narrow import bf16_small_lr
from embeddings.plan.sizes import format_bytes, parse_size
from embeddings.timing import EMBEDDING_SECTIONS, TIMER

INIT_NOTE_BYTES = 1 << 30  # tables that take seconds to fill (about 1 s/GiB a core)


def train(cfg: Config, run_dir: str | Path, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Train ``cfg`` into ``run_dir`` (resuming its checkpoint if there is one)."""
    run_dir = Path(run_dir)
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    if cfg.train.reuse_host_memory:
        reuse_freed_memory()
    info = init_distributed(cfg.train.backend, cfg.train.device, cfg.train.timeout_s)
    if info.device.type == "cuda":  # TF32 products for fp32 matmuls (train.tf32)
        torch.backends.cuda.matmul.allow_tf32 = cfg.train.tf32
        torch.backends.cudnn.allow_tf32 = cfg.train.tf32
    say = echo if info.is_main else (lambda _: None)
    why = why_not_triton(cfg.embeddings.kernels, info.device)
    if why is not None:  # before any work: the first launch died in a triton traceback
        raise ConfigError(why)
    check_shared_dir(run_dir, info)  # several machines: before any rank reads or writes it
    # bf16 only where it is fast; the config printed and saved says what ran
    precision = decide_precision(cfg.train, info.device, info, say)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision))
    data = resolve_data(cfg, run_dir)  # before creating anything: bad data leaves no run dir
    cfg = resolve_shuffle_buffer(cfg, data, run_dir, info)  # saved below: a resume keeps it
    if cfg.train.print_config:  # as resolved (data.shuffle_buffer=auto: its rows)
        say("config:\n" + to_yaml(cfg).rstrip())
    for note in data.preprocess.notes if data.preprocess else ():
        say(note)
    narrow_type_warning(cfg, data.schema, say)
    if cfg.train.init_from:  # a source this run cannot take leaves no run directory
        check_init_from(to_dict(cfg), data.schema, run_dir, info)
    if info.world_size == 1 and cfg.embeddings.memory_per_rank:
        # One process makes no plan, so its budget went unchecked (dlrm plan --world-size 1
        # refused what this then ran): the planner's check, before anything is written.
        plan_from_config(cfg, data.schema, 1)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    with RunLock(run_dir, info):  # one job per run directory, before it writes a file
        return _train_locked(cfg, run_dir, data, info, say)


def _train_locked(cfg: Config, run_dir: Path, data: RunData, info: DistInfo,
                  say: Callable[[str], None]) -> dict[str, Any]:
    """The run's files, the model and the training loop, with the run directory held."""
    # A resume loads every table: they are not randomly initialised first.
    resume = will_resume(run_dir, info)
    hot_profile = None
    if cfg.embeddings.placement == "hotline":  # first: a refused budget leaves config.yaml as it was
        reader = make_reader(cfg, data.train_files, data.schema, True, info.rank, info.world_size,
                             data.preprocess)
        hot_profile = make_profile(cfg, run_tables(cfg, data.schema), reader, run_dir, say, info, resume)
    if info.is_main and data.preprocess is not None and not (run_dir / PREP_FILE).is_file():
        save_preprocessing(data.preprocess, run_dir)
    run_files = {"config.yaml": to_yaml(cfg), "schema.json": json.dumps(schema_to_json(data.schema), indent=1)}
    if not resume:  # a resume's once its checkpoint took this run (below)
        _write_run_files(run_dir, run_files, info)
    table_bytes = sum(t.bytes for t in run_tables(cfg, data.schema))
    if table_bytes >= INIT_NOTE_BYTES and not resume:  # many seconds before the header: say why
        say(f"initialising {format_bytes(table_bytes)} of tables ...")
    model = build_model(cfg, data.schema, info.device, info, hot_profile, resume=resume)
    if model.plan is not None and info.is_main:
        if cfg.train.print_config:
            say(describe(cfg, data.schema, model.plan, parse_size(cfg.embeddings.memory_per_rank)))
        run_files["plan.json"] = model.plan.to_json()
        if not resume:
            _write_run_files(run_dir, {"plan.json": run_files["plan.json"]}, info)
    if info.is_main:
        for line in header(cfg, data.schema, data.train_files, data.eval_files, model.plan,
                           str(info.device), run_dir):
            say(line)
    barrier(info)
    with contextlib.closing(model):  # the torchrec backend owns a process group
        trainer = Trainer(cfg, run_dir, model, data, info, say)
        if resume:  # a resume the checkpoint refused (another embedding dim) left them as they were
            _write_run_files(run_dir, run_files, info)
        return trainer.fit()


def _write_run_files(run_dir: Path, files: dict[str, str], info: DistInfo) -> None:
    """RUN/config.yaml, schema.json, plan.json: what the run's checkpoints were trained with."""
    if info.is_main:
        for name, text in files.items():
            write_atomic(run_dir / name, text)


def narrow_type_warning(cfg: Config, schema: Any, say: Callable[[str], None]) -> None:
    """One line where bf16 tables get steps below their spacing (embeddings/narrow.py)."""
    rows = {t.name: t.rows for t in run_tables(cfg, schema) if t.dtype == "bf16"}
    if rows:
        note = bf16_small_lr(cfg.optim.sparse_lr, rows, cfg.optim.sparse)
        if note:
            say(f"warning: {note}")


def micro_batch_name(sparse: Any) -> str:
    """``hotline.mini_batch`` (Hotline's one pass over the whole mini-batch) / ``micro_batch``."""
    return "hotline.mini_batch" if isinstance(sparse, Prefetched) else "micro_batch"


class StepDone(NamedTuple):
    rows: int  # of every rank
    inside_s: float  # forward + backward outside the embedding sections
    dense_update_s: float


class Trainer:
    """One run: its model, dense optimizer, readers, schedule and what it writes."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        model: RecModel,
        data: RunData,
        info: DistInfo,
        say: Callable[[str], None],
    ) -> None:
        self.cfg, self.run_dir, self.model, self.info, self.say = cfg, run_dir, model, info, say
        self.schema, self.preprocess = data.schema, data.preprocess
        self.dense_opt = build_dense_optimizer(cfg, model.dense_parameters())
        resumed = self.resumed = self._resume()
        self.first_step = self.progress.global_step  # where this invocation starts
        cuda = info.device.type == "cuda"  # batches pinned by the reader's thread, copied as DMA
        self.reader = make_reader(cfg, data.train_files, self.schema, True, info.rank,
                                  info.world_size, data.preprocess, pin_memory=cuda)
        # the training files in stream order and the order they are read in, recorded with
        # each checkpoint; a resume over other files, or in another order
        self.order = reading_order(cfg, info.world_size)
        self.train_data = {**broadcast_object(
            data_identity(data.train_files, self.reader.steps_per_epoch()) if info.is_main else None, info),
            "order": self.order}
        overlap = eval_overlap(self.train_data, data.eval_files) if info.is_main and data.eval_files else None
        if overlap:
            say(overlap)
        self._carry: CarriedEpoch | None = None  # an old order's epoch, read to its end
        if resumed:
            meta = load_meta(self.resumed_from)
            if check_resume_data(meta.get("train_data"), self.train_data, self.resumed_from,
                                 self.progress.step_in_epoch, self.progress.epoch, say):
                self.progress.epoch, self.progress.step_in_epoch = self.progress.epoch + 1, 0
            else:
                self._carry_old_order(meta, data)
        steps_per_epoch = -(-self.reader.steps_per_epoch() // cfg.train.accumulate)  # optimizer steps
        self.total_steps = self.planned_steps = cfg.train.max_steps or self._epoch_steps(steps_per_epoch)
        self.best = best_eval(cfg, run_dir, info, self.progress.global_step if resumed else None)
        if self.best.stopped:  # it stopped early before: it resumes as finished
            self.total_steps = self.progress.global_step
        self.eval_reader = (
            make_reader(cfg, data.eval_files, self.schema, False, info.rank, info.world_size,
                        data.preprocess, pin_memory=cuda)
            if data.eval_files else None
        )
        self.bad_data = None  # data.on_error=skip: what the readers dropped, RUN/bad_data.jsonl
        if cfg.data.on_error == "skip":
            readers = {"train": self.reader, **({"eval": self.eval_reader} if self.eval_reader else {})}
            self.bad_data = BadDataReport(run_dir, info, readers, resumed=resumed)
        self.log = JsonLog(run_dir / "metrics.jsonl", enabled=info.is_main,
                           tensorboard=cfg.train.tensorboard)
        self.loss_fn = torch.nn.BCEWithLogitsLoss(reduction="sum")
        self.schedule = CheckpointSchedule(
            cfg.train.checkpoint_every, cfg.train.checkpoint_seconds, cfg.train.keep_checkpoints,
            info, saved_step=self.progress.global_step if resumed else None)
        self.trace = (RowTrace(run_dir, cfg.train.trace_rows, self.schema, info.rank,
                               self.progress.global_step) if cfg.train.trace_rows else None)
        self.hotline = HotlineSteps(model, cfg, info, say) if cfg.embeddings.placement == "hotline" else None
        if self.hotline is not None and resumed:
            self.hotline.resume()
        # train.precision=bf16: matmuls of the dense arch in bf16 (embedding lookups and
        # all-to-alls are not autocast ops: they stay fp32), loss and updates in fp32.
        self.autocast = torch.autocast(info.device.type, dtype=torch.bfloat16,
                                       enabled=cfg.train.precision == "bf16")
        self.meter = Meter(info, cfg.train.time_sections, warmup=cfg.train.timing_warmup)
        newest = find_checkpoint(run_dir) if resumed else None
        self.guard = DivergenceGuard(cfg, model.dense_parameters(), newest.name if newest else None)
        self.profiler = StepProfiler(cfg.train.profile_start, cfg.train.profile_steps, run_dir,
                                     info.rank, info.device, cfg.train.profile_mode)
        self.last_eval: dict[str, Any] | None = None
        self._batches: Iterator[Batch] | None = None
        self._upcoming: Batch | None = None  # Hotline: the next step's first batch (``_peek_next``)
        self._staged: StagedBatches | None = None  # data.in_memory: batches read once
        self.graphs, self.step_mode = self._graphs()
        self.hotline_graph = self._hotline_graph(cfg.hotline.graph_step) if self.hotline is not None else None
        if self.hotline_graph is not None:
            self.step_mode = "hotline step static (hotline.graph_step)"
        elif self.hotline is not None:
            self.step_mode += self._graph_dense(cfg.hotline.graph_dense)
        if self.hotline is not None:
            self.step_mode += ", splits graphed (hotline.graph_split)" if self.hotline.split_graphs is not None else ""

    def _graphs(self) -> tuple[GraphedStep | None, str]:
        """The captured step where train.cuda_graphs allows it (dlrm/train/graphs.py)."""
        mode = self.cfg.train.cuda_graphs
        if mode == "off":
            return None, "eager (train.cuda_graphs=off)"
        why = graphs_why_not(self.cfg, self.info.device, self.info.world_size)
        if why is not None:
            if mode == "on":
                raise ConfigError(f"train.cuda_graphs=on: the step cannot be captured here: {why}")
            return None, f"eager ({why})"
        return GraphedStep(self._captured_body, self.dense_opt, self.say, required=mode == "on",
                           batch_size=self.cfg.data.batch_size), ""

    def _hotline_graph(self, mode: str) -> HotlineGraph | None:
        """hotline.graph_step (dlrm/train/hotline_graph.py): auto = captured where it can
        be, else eager without a word; on = where it cannot, a warning line and eager
        (without CUDA but on the Triton kernels, interpreted: uncaptured, said)."""
        if mode == "off":
            return None
        model: Any = self.model
        cuda = self.info.device.type == "cuda"
        why = hotline_graph_why_not(self.cfg, model.embeddings, self.info.world_size)
        if why is None and (cuda or mode == "on"):
            if not cuda:
                self.say("hotline.graph_step=on: no CUDA device: the static step runs uncaptured")
            return HotlineGraph(self._captured_body, self.dense_opt, model.embeddings, self.say, capture=cuda,
                                batch_size=self.cfg.data.batch_size)
        if mode == "on":
            self.say(f"warning: hotline.graph_step=on: the step runs eager: {why or 'no CUDA device'}")
        return None

    def _graph_dense(self, mode: str) -> str:
        """hotline.graph_dense: the dense model's halves captured for this run's batch
        (dlrm/train/dense_graphs.py); what the step mode then says. auto: where they
        can be, else eager without a word; on: where they cannot, a warning line. A
        capture that fails leaves the dense model eager, said in one line."""
        if mode == "off":
            return ""
        why = dense_graphs_why_not(self.cfg, self.info.device, self.info.world_size)
        if why is not None and mode == "auto":
            return ""
        if why is None:
            model: Any = self.model
            arch, emb = unwrap(model.dense_arch), model.embeddings
            try:
                autocast = torch.bfloat16 if self.cfg.train.precision == "bf16" else None
                arch.graphs = DenseGraphs(arch, self.cfg.data.batch_size, arch.bottom[0].in_features,
                                          len(emb.features) * emb.dim, self.info.device, autocast=autocast)
                return ", dense model graphed (hotline.graph_dense)"
            except Exception as e:  # noqa: BLE001 - any capture error: the eager arch still works
                arch.graphs = None
                why = f"the capture failed: {type(e).__name__}: {e}"
        self.say(f"warning: hotline.graph_dense={mode}: the dense model runs eager: {why}")
        return ""

    def _resume(self) -> bool:
        """Load the newest checkpoint of the run directory that verifies, if any."""
        self.progress = Progress()
        if (self.cfg.embeddings.backend == "torchrec" and self.cfg.optim.sparse != "sgd"
                and will_resume(self.run_dir, self.info)):
            raise CheckpointError(
                f"checkpoint {find_checkpoint(self.run_dir)}: resuming embeddings.backend=torchrec needs "
                "optim.sparse=sgd (its fused optimizer state is not saved); use a new --out"
            )
        found = resume_checkpoint(self.run_dir, self.model, self.dense_opt, to_dict(self.cfg), self.schema,
                                  self.info, self.say)
        source = self.cfg.train.init_from
        if found is None:
            if source:  # a warm start: a fresh run from another run's weights
                self.say(init_from(source, self.model, self.dense_opt, to_dict(self.cfg), self.schema,
                                   self.preprocess, self.info))
            return False
        existing, self.progress = found
        self.resumed_from = existing
        self.say(f"resumed from {existing} at step {self.progress.global_step}")
        if source:
            self.say(f"train.init_from={source} is used only by a fresh run: this one resumes its own checkpoint")
        return True

    def _carry_old_order(self, meta: dict[str, Any], data: RunData) -> None:
        """A resume mid-epoch in another reading order reads that epoch to its end in the
        checkpoint's order (dlrm/train/carry_order.py); one that ended its epoch starts
        the next."""
        then, k = order_then(meta), self.progress.step_in_epoch
        if then is None or k == 0 or all(then[key] == self.order[key] for key in ORDER_KEYS):
            return
        if self.cfg.data.in_memory:  # staged batches replay epoch 0's: no order to keep
            return
        make = functools.partial(order_reader, self.cfg, data.train_files, self.schema, data.preprocess)
        carry = carried_epoch(make, then, self.progress.epoch, self.info.rank, self.info.world_size)
        batches = carry.steps_per_epoch()
        if k >= batches:  # it ended there: the next epoch, in this run's order
            self.progress.epoch, self.progress.step_in_epoch = self.progress.epoch + 1, 0
            return
        self._carry = carry
        self.train_data = {**self.train_data, "batches_per_epoch": batches, "order": then}
        self.say(f"note: resumed at batch {k} of {batches} of epoch {self.progress.epoch}, read in another "
                 f"order ({differences(then, self.order)}): the epoch's last {batches - k} batches are "
                 "read in its order, so each of its rows is trained once; the next epoch in this run's")

    def _epoch_steps(self, steps_per_epoch: int) -> int:
        """The optimizer step train.epochs ends at: ``steps_per_epoch`` an epoch, but for
        an old order's epoch being read to its end (its own batches)."""
        if self._carry is None:
            return self.cfg.train.epochs * steps_per_epoch
        acc, epoch = self.cfg.train.accumulate, self.progress.epoch
        left = -(-(self._carry.steps_per_epoch() - self.progress.step_in_epoch) // acc)
        return self.progress.global_step + left + max(0, self.cfg.train.epochs - epoch - 1) * steps_per_epoch

    def _carrying(self) -> bool:
        """Whether this epoch is an old order's, read to its end."""
        return self._carry is not None and self._carry.epoch_number == self.progress.epoch

    def _stream(self) -> Any:
        """The reader of this epoch's batches: an old order's being read to its end, or the run's."""
        return self._carry if self._carrying() else self._staged or self.reader

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, Any]:
        """Train to ``total_steps``, then save, evaluate and return the summary; or,
        signalled, save after the step every rank agreed on and return the summary
        with ``preempted`` (the signal's name)."""
        bar = tqdm(total=self.total_steps, initial=self.progress.global_step, unit="step",
                   file=sys.stderr, dynamic_ncols=True,
                   disable=not (self.cfg.train.progress and self.info.is_main))
        self.model.train()
        if self._eval_missed():
            self.last_eval = self.run_eval()
            self._count_eval(self.last_eval)
        with Preemption() as preemption:
            try:
                stop = self._train_steps(bar, preemption)
            finally:
                bar.close()  # an error's line goes below the bar, not onto it
            self.profiler.close()
            if stop or self.cfg.train.final_checkpoint:
                self.save()
            elif self.bad_data is not None:
                self.bad_data.write()  # what a save writes beside the checkpoint
        if stop:
            return self._summary(preempted=stop)
        if self.best.stopped:  # this step's eval ran (or, resumed, is in metrics.jsonl)
            self.last_eval = self.last_eval or self._logged_eval()
            return self._summary()
        # a rerun of a finished run: its final eval is in metrics.jsonl, not run again
        logged = self._logged_eval() if self.progress.global_step == self.first_step else None
        fresh = None if logged else self.run_eval()
        self.last_eval = logged or fresh or self.last_eval
        self._count_eval(fresh, final=True)
        return self._summary()

    def _train_steps(self, bar: tqdm, preemption: Preemption) -> int:
        """Steps to ``total_steps``; the signal that stopped them early, else 0."""
        while self.progress.global_step < self.total_steps:
            t_fetch = time.perf_counter()
            first = self.progress.step_in_epoch
            batches = self._next_batches()
            if not batches:
                continue  # the epoch ended: the next one starts
            wait = time.perf_counter() - t_fetch
            idle = self.meter.device_idle()  # was the device waiting too (CUDA: an event query)
            done = self.step(batches)
            self.meter.step_queued()
            self.progress.step_in_epoch = first + len(batches)
            if self.trace:
                self.trace.write(self.progress, first, batches)
            # counted from this invocation's first step: a resumed run's first steps (the
            # reader's first window, caches) are its warm-up too, not timed steps (with the
            # global step they were, and a 31-step resume said 61% data wait: the reader named)
            self.meter.add_step(self.progress.global_step - self.first_step, done.rows, t_fetch,
                                wait, done.inside_s, done.dense_update_s, idle)
            bar.update(1)
            stop = self._on_schedule(bar, preemption.signum)
            if stop:
                return stop
        return 0

    def _next_batches(self) -> list[Batch]:
        """This rank's next k = train.accumulate batches; [] at the end of an epoch."""
        if self._batches is None:
            if self.cfg.data.in_memory and self._staged is None:  # read once, then replayed
                self._staged = StagedBatches(
                    self.reader, self.info.device if self.hotline is None else torch.device("cpu"),
                    self.cfg.train.max_steps * self.cfg.train.accumulate)
            source = self._stream()
            self._batches = iter(source.epoch(self.progress.epoch,
                                              start_step=self.progress.step_in_epoch))
            if (self.info.device.type == "cuda" and self.hotline is None  # Hotline copies its own
                    and self._staged is None):
                self._batches = DevicePrefetcher(self._batches, self.info.device)
            if self.hotline is not None:  # it splits the next batch during this step
                self._batches = Lookahead(self._batches)
        batches = list(itertools.islice(self._batches, self.cfg.train.accumulate))
        if not batches:
            self.progress.epoch += 1
            self.progress.step_in_epoch = 0
            self._batches = None
            if self._carry is not None:  # its epoch is over: this run's order from here
                self._carry = None
                self.train_data = {**self.train_data, "batches_per_epoch": self.reader.steps_per_epoch(),
                                   "order": self.order}
        self._upcoming = self._peek_next()
        return batches

    def _peek_next(self) -> Batch | None:
        """Hotline: the batch after this step's (the next step's first), still to be
        handed out by ``_next_batches``; None at an epoch's end and at the run's last
        step (no split made for a batch no step trains)."""
        if (not isinstance(self._batches, Lookahead)
                or self.progress.global_step + 1 >= self.total_steps):
            return None
        return self._batches.peek()

    def step(self, batches: list[Batch]) -> StepDone:
        """One optimizer step over ``batches`` (see the module docstring), inside
        ``train.profile_steps``' window when it is one of them: whichever way it runs
        (eager, a graph replayed, Hotline's static step), as python mode promises."""
        step = self.progress.global_step
        self.profiler.before(step)
        done = self._step(batches)
        self.profiler.after(step)
        return done

    def _step(self, batches: list[Batch]) -> StepDone:
        t0 = time.perf_counter()
        step = self.progress.global_step
        rows = self._global_rows(batches)
        factor = lr_factor(self.cfg, step)
        set_lrs(self.dense_opt, self.cfg.optim.dense_lr * factor)  # graphed: tensors a replay reads
        if self.graphs is not None and step >= GRAPH_WARMUP and len(batches) == 1:
            done = self._graph_step(batches[0], rows, factor, t0)
            if done is not None:
                return done
        elif self.hotline_graph is not None and step - self.first_step >= GRAPH_WARMUP and len(batches) == 1:
            if self.hotline_graph.fits(batches[0]):
                return self._hotline_static_step(batches[0], rows, factor, t0)
            self.hotline_graph.eager += 1
        self.model.begin_step(self.cfg.optim.sparse_lr * factor)
        self.dense_opt.zero_grad(set_to_none=True)
        embedding_before = sum(TIMER.totals[s] for s in EMBEDDING_SECTIONS)
        after, self._upcoming = self._upcoming, None  # used once: by this step only
        for i, batch in enumerate(batches):
            upcoming = batches[i + 1] if i + 1 < len(batches) else after
            for part, sparse, last in self._micro_batches(batch, upcoming):
                # Named spans in a profile's trace (CPU and GPU): Hotline's pass can be
                # told apart from the rest of the step on the device timeline.
                with torch.profiler.record_function(micro_batch_name(sparse)):
                    self._forward_backward(part, sparse, rows, sync=last and i == len(batches) - 1)
        t_dense = time.perf_counter()
        self.dense_opt.step()
        dense_update = time.perf_counter() - t_dense
        self.model.end_step()
        if self.hotline:
            self.hotline.after_step(step + 1)
        self.progress.global_step += 1
        # forward + backward outside the embedding sections timed inside them
        inside = (t_dense - t0) - (sum(TIMER.totals[s] for s in EMBEDDING_SECTIONS) - embedding_before)
        return StepDone(rows, inside, dense_update)

    def _graph_step(self, batch: Batch, rows: int, factor: float, t0: float) -> StepDone | None:
        """The step as one graph replay (the capture at its first eligible step); None
        where this batch must run eager (another shape, or the capture failed)."""
        graphs = self.graphs
        assert graphs is not None
        self.model.begin_step(self.cfg.optim.sparse_lr * factor)  # fills the device lr
        part = batch.to(self.info.device, non_blocking=True)
        if graphs.can_capture(part):
            loss = graphs.try_capture(part, self.progress.global_step)
        elif graphs.graph is not None and graphs.fits(part):
            loss = graphs.replay(part)
        else:
            loss = None
        if loss is None:
            graphs.eager_after_capture += graphs.graph is not None
            return None
        self.meter.add_loss(loss, part.size)
        self.progress.global_step += 1
        return StepDone(rows, time.perf_counter() - t0, 0.0)

    def _hotline_static_step(self, batch: Batch, rows: int, factor: float, t0: float) -> StepDone:
        """The Hotline step as one static step (dlrm/train/hotline_graph.py): the pass's
        split and cold rows loaded, the graph replayed; eager where its capture failed."""
        hotline, graph = self.hotline, self.hotline_graph
        assert hotline is not None and graph is not None
        step = self.progress.global_step
        self.model.begin_step(self.cfg.optim.sparse_lr * factor)
        after, self._upcoming = self._upcoming, None
        for part, cold, _ in hotline.micro_batches(batch, after):  # one pass
            loss = graph.run(part, hotline.current_split, cold, step)
            if loss is None:  # the capture failed: this step eager, as every later one
                self.dense_opt.zero_grad(set_to_none=True)
                self._forward_backward(part, Prefetched(part.sparse, cold), rows, sync=True)
                self.dense_opt.step()
            else:
                self.meter.add_loss(loss, part.size)
        hotline.announce_next_reads()  # its host update writes the next gather's rows first
        self.model.end_step()
        hotline.after_step(step + 1)
        self.progress.global_step += 1
        return StepDone(rows, time.perf_counter() - t0, 0.0)

    def _captured_body(self, part: Batch) -> torch.Tensor:
        """What the graph holds: forward, loss, backward (the fused sparse update runs
        in it), dense update; the summed BCE for the meter."""
        with self.autocast:
            logits = self.model(part.dense, part.sparse)
        bce = self.loss_fn(logits.float(), part.labels)
        (bce * loss_scale(self.info, part.size, self.cfg)).backward()
        self.dense_opt.step()
        return bce.detach()

    def _micro_batches(self, batch: Batch, upcoming: Batch | None) -> Iterator[tuple[Batch, Any, bool]]:
        """(part on the device, its sparse input, last micro-batch of the batch?);
        ``upcoming``: the batch after it (Hotline splits it meanwhile), or None."""
        if self.hotline is None:
            part = batch.to(self.info.device, non_blocking=True)
            yield part, part.sparse, True
            return
        for part, cold, last in self.hotline.micro_batches(batch, upcoming):  # already on the device
            yield part, Prefetched(part.sparse, cold), last

    def _forward_backward(self, part: Batch, sparse: Any, rows: int, sync: bool) -> None:
        """Loss of one micro-batch (its share of the mean over the step's ``rows``, all
        ranks), backward; DDP all-reduces only when ``sync``."""
        with contextlib.nullcontext() if sync else self.model.no_sync():
            with self.autocast:
                logits = self.model(part.dense, sparse)
            bce = self.loss_fn(logits.float(), part.labels)
            (bce * loss_scale(self.info, rows, self.cfg)).backward()
        self.meter.add_loss(bce, part.size)

    def _global_rows(self, batches: list[Batch]) -> int:
        """Rows of this step over all ranks: the loss is their mean."""
        if self.bad_data is None:
            first = self.progress.step_in_epoch
            shape = self._carry if self._carrying() else self.reader  # (staged batches are the reader's)
            return sum(shape.global_batch_size(first + i) for i in range(len(batches)))
        # Dropped rows shorten batches: count what this step trains on all ranks.
        rows = int(all_reduce_sum([sum(b.size for b in batches)], self.info)[0])
        self.bad_data.rows_trained += rows
        return rows

    # ------------------------------------------------------------------ around the steps
    def _on_schedule(self, bar: tqdm, signum: int) -> int:
        """Log, evaluate and checkpoint after a step when they are due; the signal
        that stops the run after this step (``signum`` of any rank), else 0. A
        stopping run skips the eval (fit saves): the agent's grace period is short; the
        resumed run runs it first (``_eval_missed``)."""
        step, every = self.progress.global_step, self.cfg.train
        # the last step logs its window too (a run shorter than log_every draws a curve)
        if every.log_every and (step % every.log_every == 0 or step == self.total_steps):
            window = self.meter.take_window()  # reads the loss: the host waits here anyway
            warn_fp16_overflow(self.model)  # the Triton update's counts, read in that wait
            self.guard.check(window["loss"], step)  # a NaN loss is not logged, saved or evaluated
            self.log.write({"event": "train", "step": step, **window})
            if self.hotline:
                self.log.write({"event": "hotline", "step": step, **self.hotline.stats()})
            bar.set_postfix(loss=f"{window['loss']:.4f}", sps=f"{self.meter.rate:,.0f}")
        verdict = self.schedule.after_step(step, signum)
        if verdict.stop:
            return verdict.stop
        if every.eval_every and step % every.eval_every == 0 and step < self.total_steps:
            self.meter.close_span()  # the eval's time is not the steps'
            self.last_eval = self.run_eval()
            self._count_eval(self.last_eval)  # early stop: total_steps is now this step
        if verdict.save:
            self.save()
        return 0

    def _count_eval(self, metrics: dict[str, Any] | None, final: bool = False) -> None:
        """The best-eval tracker's turn after an eval (dlrm/train/best.py): keep_best saves
        an improving step's checkpoint and names it; early_stop ends the run at this step
        (a collective decision: every rank has the same metrics)."""
        if metrics is None or not self.best.active:
            return
        step = self.progress.global_step
        if self.best.after_eval(step, metrics) and self.best.keep:
            self.save()
            mark(self.best, self.run_dir, self.cfg.train.keep_checkpoints, self.info)
        if self.best.stopped and not final:
            self.say(self.best.stop_line(step, self.run_dir))
            self.log.write({"event": "early_stop", "step": step, "best": self.best.record()})
            self.total_steps = step

    def _stopped_early(self) -> bool:
        """Whether early_stop ended the run before its planned steps: the run's final eval
        may be the one that runs out of patience, but the run trained all its steps."""
        return self.best.stopped and self.progress.global_step < self.planned_steps

    def _eval_missed(self) -> bool:
        """A resumed run whose step had an eval due that never ran: a run stopped by a
        signal saves and leaves without it (its grace period is short), so the resumed
        run evaluates first, at that step, as the run never stopped would have. Rank 0
        reads RUN/metrics.jsonl; every rank learns its answer (eval is collective)."""
        step, every = self.progress.global_step, self.cfg.train.eval_every
        if not (self.resumed and self.eval_reader is not None and every
                and step % every == 0 and 0 < step < self.total_steps):
            return False
        return self._logged_eval() is None

    def _logged_eval(self) -> dict[str, Any] | None:
        """The metrics of the eval RUN/metrics.jsonl holds for this step, if any (rank 0
        reads; every rank gets the answer: whether to evaluate is collective)."""
        step, found = self.progress.global_step, None
        if self.info.is_main and self.eval_reader is not None:
            found = logged_evals(self.run_dir / "metrics.jsonl", step).get(step)
        return broadcast_object(found, self.info)  # type: ignore[return-value]

    def save(self) -> None:
        warn_fp16_overflow(self.model)  # a checkpoint waits for the device; the run's end saves too
        if self.schedule.saved_step == self.progress.global_step:
            return  # saved at this step already
        self.meter.close_span()  # the checkpoint's time is not the steps'
        self._stop_if_diverged()
        if self.hotline is not None:
            self.hotline.before_save()  # its refresh inputs, saved with the hot set
        final = save_checkpoint(self.run_dir, self.model, self.dense_opt, self.progress, to_dict(self.cfg),
                                self.schema, self.info, keep=self.cfg.train.keep_checkpoints,
                                train_data=self.train_data)
        self.guard.saved(final.name)
        self.schedule.saved(self.progress.global_step)
        if self.bad_data is not None:
            self.bad_data.write()  # the records so far, kept through a crash

    def _stop_if_diverged(self) -> None:
        """The guard's check of the steps since its last one (collective); none where it
        checked this step already (the log line of the run's last step, before its save
        and eval): nothing trained since."""
        step = self.progress.global_step
        if self.guard.finite_step != step:
            self.guard.check(self.meter.window_loss(), step)

    def run_eval(self) -> dict[str, Any] | None:
        if self.eval_reader is None:
            return None
        step = self.progress.global_step
        self._stop_if_diverged()
        try:
            metrics = evaluate(self.model, self.eval_reader, self.info)[0]
        except NotFinite as e:  # the loss and dense weights were finite: a table row is not
            raise Diverged(f"the eval at step {step}: {e}: a table holds NaN or infinite "
                           "values; lower optim.sparse_lr and train again") from None
        except ValueError as e:  # an eval set of one class: no AUC, and the run goes on
            self.say(f"warning: the eval at step {step} has no metrics: {e} (data.eval={self.cfg.data.eval})")
            self.log.write({"event": "eval_skipped", "step": step, "reason": str(e)})
            return None
        self.log.write({"event": "eval", "step": step, **metrics})
        return metrics

    def _tables_trained(self) -> dict[str, Any]:
        """The tables this run built (after the data's encodings): count, rows, bytes."""
        tables = run_tables(self.cfg, self.schema)
        rows = sum(t.rows for t in tables)
        dtypes = sorted({t.dtype for t in tables})
        return {"count": len(tables), "rows": rows, "bytes": sum(t.bytes for t in tables),
                "dtype": dtypes[0] if len(dtypes) == 1 else "mixed",
                **({"dtypes": {t.name: t.dtype for t in tables}} if len(dtypes) > 1 else {})}

    def _result_line(self, summary: dict[str, Any]) -> str:
        """What this invocation did: the steps it trained and their rate. A run resumed
        at its last step trains none (no rate to give), nor do warm-up steps alone."""
        step, trained = self.progress.global_step, summary["trained_steps"]
        if not trained and self._stopped_early():
            return f"nothing trained: the run stopped early at step {step} (train.early_stop)"
        if not trained and step >= self.total_steps:
            return f"nothing trained: the run was already complete at step {step} of {self.total_steps}"
        if not trained:  # stopped by a signal before its first step
            return f"nothing trained: stopped at step {step} of {self.total_steps}"
        steps = f"trained {step} steps" + (f" ({trained} in this run)" if trained < step else "")
        if not self.meter.timed_steps:
            return f"{steps}, all within the train.timing_warmup={self.meter.warmup} untimed ones: no samples/s"
        return f"{steps} at {summary['samples_per_s']:,.0f} samples/s"

    def _summary(self, preempted: int = 0) -> dict[str, Any]:
        self.step_mode = self.graphs.summary() if self.graphs is not None else self.step_mode
        if self.hotline_graph is not None and self.hotline is not None:
            split = ", splits graphed (hotline.graph_split)" if self.hotline.split_graphs is not None else ""
            self.step_mode = self.hotline_graph.summary() + split
        summary: dict[str, Any] = {"event": "summary", "steps": self.progress.global_step,
                                   "trained_steps": self.progress.global_step - self.first_step,
                                   "step_mode": self.step_mode,
                                   **self.meter.summary(), "tables": self._tables_trained()}
        if preempted:
            summary["preempted"] = signal_name(preempted)
        if self.hotline:  # over this invocation's steps: none in a rerun (it read a 0% hit rate)
            if summary["trained_steps"]:
                summary["hotline"] = self.hotline.stats(whole_run=True)
            self.hotline.close()
        if self.last_eval is not None:
            summary.update({f"eval_{k}": v for k, v in self.last_eval.items()})
        if self.best.active and self.best.step is not None:
            summary["best"] = self.best.record()
            if self._stopped_early():
                summary["early_stopped"] = self.progress.global_step
        if self.bad_data is not None:
            summary["bad_data"] = self.bad_data.write()
        self.log.write(summary)
        self.log.close()
        self.say(json.dumps(summary))
        warning = self.meter.reader_warning(reader_remedy(self.cfg))
        if warning:
            self.say(warning)
        line = self._result_line(summary)
        if self.hotline and summary["trained_steps"]:  # it was in the JSON above only
            h = summary["hotline"]
            line += f"; hotline hit rate {h['hot_hit_rate']:.1%}, " + (
                "cold rows read in place by the device" if h.get("cold_in_place")
                else f"cold gather {h['gather_hidden']:.0%} hidden")
        if self.last_eval is not None:
            line += f"; eval AUC {self.last_eval['auc']:.4f}, logloss {self.last_eval['logloss']:.4f}"
        if "best" in summary:
            b = summary["best"]
            line += f"; best {b['metric']} {b['value']:.4f} at step {b['step']}"
            if b["checkpoint"]:
                line += f" ({self.run_dir / CHECKPOINTS / b['checkpoint']})"
        self.say(line)
        if self.bad_data is not None:
            self.say(self.bad_data.line(summary["bad_data"]))
        if preempted:
            self.say(f"stopped by {signal_name(preempted)} after step {self.progress.global_step} "
                     f"of {self.total_steps}, checkpoint saved: the same command resumes "
                     f"(exit code {PREEMPTED})")
        return summary
