"""Hotline mode in the trainer: profile the hot rows, split and pipeline each step.

One pass per mini-batch:

    mini-batch ──to the device once, classified there (split stream; embeddings/hotline/split.py):
        │      its lookups hot first, then cold, each in batch order; the host reads
        │      the 56-byte header (the parts' sizes)
        ├──► hot lookups (one launch), bottom MLP ─┐ forward (collection start / finish):
        │                                          ├─► + cold part ─► interaction, top MLP,
        └──► host thread: U cold ids D2H, rows ───┘    loss, ONE backward on every sample
             gathered, H2D (a ``ColdInFlight``)
    one optimizer step (kept KV gradients), so the math is ordinary training

The Hotline paper's step, a popular micro-batch (every lookup hot: no host row)
trained while the host gathers the rest's cold rows, then the rest, ran here as
``hotline.dense_pass=per_micro_batch`` until one H200 measured this one pass 1.41x
faster (the dense model's ops dispatched once a step instead of twice; README).

A step ahead: mini-batch t+1 is split while mini-batch t trains, so step t+1 starts
with its header on the host and submits its gather at once (the trainer passes the
next batch, ``upcoming``):

    step t   | take split t | issue split t+1 (queued) | pass of t | read header t+1 |
    step t+1 | take split t+1 (made, read) | issue split t+2 | pass of t+1 | ...

What classifying ahead reads is the batch and the hot ids, never a host row. A
split made against a hot set that a refresh (``after_step``) has since replaced is
made again at its step (``hot_version``), as is one made for another batch than
the one that comes (the split remembers its batch); the last step, an epoch's
end and a stop have no next batch, and a split left over is dropped, never used.

The host applies cold updates at the step's end, before the next step's gather
reads them: the gather is still submitted at its own step, after the previous
step's ``step()`` queued that update, and reads the host rows only after it
(host_local.py ``collection``): read-after-write is ordered by the step boundary.

Several ranks: every rank splits its own share of the global batch; the host
thread's "gather" is then the sharded host tier's lookup (ids all-to-all, the
owners' host lookups, pooled all-to-all), which runs while the hot side computes.
The pass runs on every rank with its cold lookups, empty or not (its lookup is a
collective, and it is the pass DDP syncs on); the
profile's counts are summed over the ranks, so every rank has the same hot rows.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from data.batch import Batch
from data.pinned import record_once
from dlrm.config import Config, ConfigError
from dlrm.parallel.distributed import DistInfo, all_gather_rows, all_reduce_sum
from dlrm.train.split_graphs import GraphedSplits
from dlrm.train.split_graphs import why_not as split_graphs_why_not
from embeddings import huge_pages
from embeddings.hotline.access_window import (
    AccessWindow,
    Counts,
    from_checkpoint,
    merge_counts,
    to_checkpoint,
)
from embeddings.hotline.lookups import ColdInFlight
from embeddings.hotline.mixed import MixedMicro
from embeddings.hotline.profile import HotProfile, count_accesses, default_max_batches, row_bytes
from embeddings.hotline.refresh import RefreshPlan
from embeddings.hotline.split import (
    DeviceSplit,
    JointSplit,
    MicroLookups,
    Sizes,
    split_tensors,
    unique_cold_ids,
)
from embeddings.hotline.tiers import HOT_ONLY, HotlineEmbeddingCollection
from embeddings.optim import make_sparse_optimizer
from embeddings.plan.sizes import format_bytes, parse_size
from embeddings.table import TableSpec

PROFILE_FILE = "hot_profile.pt"
WindowCounts = Counts | Future[Counts]  # a window's counts, or the planner's future of them


def make_profile(
    cfg: Config,
    tables: list[TableSpec],
    reader: Any,
    run_dir: Path,
    say: Callable[[str], None],
    info: DistInfo | None = None,
    resume: bool = False,
) -> HotProfile:
    """The run's hot set: reused from RUN/hot_profile.pt, else profiled on a sample
    (several ranks: each counts its share, the counts are summed, rank 0 saves).

    A saved profile chosen within another ``hotline.budget`` is profiled again when
    nothing was trained from it (``resume`` false); a resume keeps the checkpoint's hot
    set, so there the new budget is refused, or said to wait for the next refresh."""
    info = info or DistInfo()
    path = run_dir / PROFILE_FILE
    budget = parse_size(cfg.hotline.budget) or 0
    # Every rank looks before anyone can write it: rank 0 saves only after the
    # counts' all-reduce, which every rank joins after looking.
    if all_reduce_sum([float(path.is_file())], info)[0] == info.world_size:
        saved = HotProfile.load(path)
        if saved.budget_bytes == budget:
            say(f"hotline: reusing the hot profile {path}")
            return saved
        if resume:
            say(budget_kept_on_resume(cfg, saved.budget_bytes, run_dir))
            return saved
        say(f"hotline: {path} was chosen within {format_bytes(saved.budget_bytes)}, "
            f"hotline.budget is {cfg.hotline.budget}: profiling again")
    sample = default_max_batches(reader.steps_per_epoch(), cfg.hotline.profile_fraction)
    counts = count_accesses(
        (b.sparse for b in reader.epoch(0)), tables, sample, cfg.hotline.profile_seconds
    )
    counts = sum_counts(counts, tables, info)
    optimizer = make_sparse_optimizer(cfg.optim.sparse, cfg.optim.eps, cfg.embeddings.state_dtype)
    profile = HotProfile.build(counts, tables, optimizer, budget, fill=cfg.hotline.fill_unseen)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        profile.save(path)
    for line in profile_lines(cfg, profile, counts, tables, optimizer):
        say(line)
    return profile


def profile_lines(cfg: Config, profile: HotProfile, counts: dict[str, torch.Tensor],
                  tables: list[TableSpec], optimizer: Any) -> list[str]:
    """What the profile chose, for the run's start: the hot rows, the budget they use and
    the share of the profiled lookups they hit; a budget that holds no row, or more than
    every row the profile saw, said as such (both read as a working choice before)."""
    cost = {t.name: row_bytes(t, optimizer) for t in tables}
    hot = sum(int(ids.numel()) for ids in profile.hot.values())
    used = sum(int(profile.hot[name].numel()) * cost[name] for name in cost)
    lookups = sum(v["lookups"] for v in profile.summary.values())
    hits = sum(v["hot_lookups"] for v in profile.summary.values())
    share = f"{hits / lookups:.1%}" if lookups else "none"
    lines = [(f"hotline: {hot:,} hot rows ({format_bytes(used)} of hotline.budget={cfg.hotline.budget}) "
              f"hit {share} of the {lookups:,} lookups profiled")]
    if hot == 0:
        lines.append(f"warning: hotline.budget={cfg.hotline.budget} holds no hot row (the smallest takes "
                     f"{min(cost.values())} B: weights and optimizer state): every lookup goes to the host")
        return lines
    if hits < lookups or not lookups:
        return lines
    seen, rows = sum(int((c > 0).sum()) for c in counts.values()), sum(t.rows for t in tables)
    if hot == rows:
        lines[0] += "; the budget holds every row of every table"
    elif hot > seen:  # the room left filled with rows the profile did not see (fill_unseen)
        lines[0] += (f"; the budget holds every row the profile saw and {hot - seen:,} it did not see "
                     f"(the smallest tables' first), {rows - hot:,} stay on the host")
    else:
        lines[0] += (f"; the budget holds every row the profile saw, the {rows - seen:,} it did not see "
                     f"stay on the host" + ("" if cfg.hotline.refresh_every else
                                            " (hotline.refresh_every=N re-chooses from later batches)"))
    return lines


def budget_kept_on_resume(cfg: Config, saved_bytes: int, run_dir: Path) -> str:
    """The line that says a resumed run's changed ``hotline.budget`` waits for its next
    refresh; without refreshes the change would be ignored, so it is refused."""
    was = format_bytes(saved_bytes)
    if cfg.hotline.refresh_every:
        return (f"hotline: hotline.budget={cfg.hotline.budget}, the run's hot set was chosen within "
                f"{was}: the resume keeps it, the next refresh (hotline.refresh_every="
                f"{cfg.hotline.refresh_every}) chooses within {cfg.hotline.budget}")
    raise ConfigError(
        f"hotline.budget={cfg.hotline.budget}: this run's hot set was chosen within {was} and a "
        f"resume keeps it (hotline.refresh_every=0 never chooses again); resume with "
        f"hotline.budget={saved_bytes}, add hotline.refresh_every=N to choose within {cfg.hotline.budget} "
        f"at the next refresh, or start a new run from this one: --out NEW train.init_from={run_dir}")


def sum_counts(
    counts: dict[str, torch.Tensor], tables: list[TableSpec], info: DistInfo
) -> dict[str, torch.Tensor]:
    """Access counts summed over the ranks (one all-reduce of all tables' counts)."""
    if info.world_size == 1:
        return counts
    import torch.distributed as dist

    flat = torch.cat([counts[t.name] for t in tables]).to(info.device)
    dist.all_reduce(flat)
    return dict(zip([t.name for t in tables], flat.cpu().split([t.rows for t in tables])))


# The interpreter's GIL switch interval on a GPU (seconds; Python's default is 5 ms).
# The step loop shares the GIL with the gather, host-update, split and batch-taking
# threads; a thread that wants it from one running Python waits up to the interval.
# One H200 (2026-11-28, 6db8c5d, configs/bench_gpu.yaml, the step captured): 1,695,430
# samples/s at 0.5 ms against 1,367,569-1,480,759 in five rows at 5 ms the same call.
# DLRM_GIL_SWITCH_MS (a developer's A/B, not a setting: scripts/gpu_session.sh runs
# Python's 5 beside it) replaces it.
GPU_SWITCH_INTERVAL_S = 0.0005


def switch_interval(device: torch.device) -> float | None:
    """The GIL switch interval a Hotline run on ``device`` sets (None: Python's own,
    on the CPU, where the threads' work is torch's and numba's, the GIL released)."""
    if device.type != "cuda":
        return None
    ms = os.environ.get("DLRM_GIL_SWITCH_MS")
    return float(ms) / 1000 if ms else GPU_SWITCH_INTERVAL_S


@dataclass
class AheadSplit:
    """One mini-batch copied to the device and classified (``split``), its header on its
    way to the host (CUDA: a pinned copy, complete after ``ready``); made for ``batch``
    against hot set ``version`` (``hot_version`` of the collection)."""

    batch: Batch  # the host batch it was made from: only that batch may use it
    version: object
    dev: Batch
    split: DeviceSplit | JointSplit
    header: torch.Tensor  # the host's copy of ``split.header`` (CPU: the header itself)
    ready: torch.cuda.Event | None = None  # CUDA: recorded on the split stream after the copy
    sizes: Sizes | None = None
    # each part's U unique cold ids on the host, and the event after their copy (CUDA)
    cold_ids: list[tuple[torch.Tensor, torch.cuda.Event | None]] | None = None
    # one pass: the whole mini-batch's lookups and their cold gather, submitted at the
    # end of the step before (``HotlineSteps.gather_ahead``)
    whole: MicroLookups | MixedMicro | None = None
    gather: ColdInFlight | None = None
    slot: Any = None  # hotline.graph_split: the graph whose buffers hold ``split``
    waited: float = 0.0  # seconds the host waited for the header (``read``)

    def read(self) -> Sizes:
        """The header read by the host (once): on CUDA a wait for the split stream up
        to this split's event, not for the compute stream's queue (``waited``: seconds)."""
        if self.sizes is None:
            t0 = time.perf_counter()
            if self.ready is not None:
                self.ready.synchronize()
            self.sizes = self.split.read_sizes(self.header)
            self.waited = time.perf_counter() - t0
        return self.sizes

    def copy_cold_ids(self, stream: torch.cuda.Stream | None) -> None:
        """Each part's U unique cold ids to the host (U read from the header): on CUDA
        one pinned D2H copy queued on the split ``stream``, after the classification,
        that nothing here waits for; on CPU the ids are there already."""
        ids = unique_cold_ids(self.split, self.read())
        if stream is None:
            self.cold_ids = [(t, None) for t in ids]
            return
        with torch.cuda.stream(stream):
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                    for t in ids]
            copied = torch.cuda.Event()
            copied.record(stream)
        self.cold_ids = [(t, copied) for t in host]

    def give_cold_ids(self, micro: MicroLookups | MixedMicro) -> None:
        """Hand the copied cold ids to ``micro``'s gather (each dtype group its own)."""
        if self.cold_ids is None:
            return
        parts = micro.parts if isinstance(micro, MixedMicro) else [micro]
        for part, (ids, copied) in zip(parts, self.cold_ids, strict=True):
            part.cold_host_ids, part.cold_host_ready = ids, copied


class HotlineSteps:
    """Micro-batches of each mini-batch, cold rows gathered ahead; stats as JSON."""

    def __init__(self, model: torch.nn.Module, cfg: Config, info: DistInfo | None = None,
                 say: Callable[[str], None] | None = None) -> None:
        self.embeddings = model.embeddings
        self.say = say
        self.cfg = cfg
        self.info = info or DistInfo()
        self.tables: list[TableSpec] = self.embeddings.tables
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotline-gather")
        self.device = self.embeddings.hot_device
        interval = switch_interval(self.device)
        if interval is not None:
            sys.setswitchinterval(interval)
        # hotline.graph_split: splits replayed as CUDA graphs where they can be
        self.split_graphs: GraphedSplits | None = None
        self._graph_splits(cfg.hotline.graph_split, say)
        # hotline.cold_path=mapped: the device reads the cold rows in place, and a static
        # step writes them back in place, on the step loop's stream (no gather thread: a
        # launch a tensor each way)
        self.in_place = cfg.hotline.cold_path == "mapped" and self._read_in_place(say)
        self._current: AheadSplit | None = None  # the split this step's passes read
        # CUDA: the side stream that copies each mini-batch in and classifies it; at a
        # higher priority than the compute stream (-1: valid on every torch and GPU): its
        # few small kernels are queued during the step before and the host reads their
        # header at that step's end (``header_wait_ms``), so they should not queue behind
        # the replay's matmuls for free SMs (not yet measured on a GPU)
        self._stream = (torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda"
                        else None)
        self._stream_version: object = None  # the hot set the split stream last waited for
        self._ahead: AheadSplit | None = None  # the next mini-batch's split, made a step ahead
        # hotline.refresh_every: the next hot set, chosen in the background (see after_step)
        self._planner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotline-refresh")
        self._next_hot: Future[RefreshPlan] | None = None
        self._touched: list[torch.Tensor] = []  # host rows cold updates wrote since the plan began
        # the window's lookups, keyed on the device at each step and merged on the planner
        # thread (embeddings/hotline/access_window.py: no host pass over the ids, no
        # count per row of every table)
        self.window = (AccessWindow(self.tables, self.device, self._planner) if cfg.hotline.refresh_every
                       else None)
        # the planner thread's time (plans), the step loop's keying of a batch's lookups
        # (count): a refresh waits for a plan that outlasts its window
        self._planner_s = {"plan": 0.0, "plans": 0.0, "count": 0.0, "counted": 0.0}
        self._pending: WindowCounts | None = None  # the counts _next_hot is planned from
        self._window: dict[str, float] = {}
        self._total: dict[str, float] = {}
        # (thread CPU, wall, update thread CPU) at the last step's ``_observe``
        self._clocks: tuple[float, float, float] | None = None
        self.reset_window()

    def _graph_splits(self, mode: str, say: Callable[[str], None] | None) -> None:
        """hotline.graph_split: auto = graphed where they can be, else eager without a
        word; on = where they cannot, a warning line and eager; off = eager."""
        if mode == "off":
            return
        why = split_graphs_why_not(self.cfg, self.device, self.info.world_size)
        if why is None:
            self.split_graphs = GraphedSplits(self.embeddings, batch=self.cfg.data.batch_size)
        elif mode == "on" and say is not None:
            say(f"warning: hotline.graph_split=on: splits run eager: {why}")

    def _read_in_place(self, say: Callable[[str], None] | None) -> bool:
        """hotline.cold_path=mapped: the host tables registered for the device's reads
        (embeddings/hotline/mapped.py); where that fails, one warning line and False."""
        t0 = time.perf_counter()
        try:
            self.embeddings.read_in_place()
        except Exception as e:  # noqa: BLE001 - CUDA's refusal is a RuntimeError of any kind
            if say is not None:
                say(f"warning: hotline.cold_path=mapped: {str(e).splitlines()[0][:200]}; "
                    f"the cold rows are gathered on the host")
            return False
        if say is not None and self.device.type == "cuda":
            say(f"hotline: the host tables read in place by {self.device} (hotline.cold_path=mapped; "
                f"registered in {time.perf_counter() - t0:.1f} s)")
        return True

    @property
    def current_split(self) -> DeviceSplit | JointSplit:
        """The split the running step's pass reads (``micro_batches`` made it current)."""
        assert self._current is not None
        return self._current.split

    def reset_window(self) -> None:
        """Close the current window: add it to the run's totals, keep it as the last."""
        self._last = dict(self._window)
        for key in ("steps", "hit", "popular", "gather", "transfer", "wait", "refreshes", "refresh",
                    "ahead", "resplits", "graphed", "late", "update_wait", "header_wait", "refresh_wait", "ids_wait",
                    "loop_cpu", "loop_wall", "loop_steps", "gather_cpu", "update_cpu"):
            self._total[key] = self._total.get(key, 0.0) + self._window.get(key, 0.0)
            self._window[key] = 0.0

    def micro_batches(self, batch: Batch, upcoming: Batch | None = None) -> Iterator[tuple[Batch, Any, bool]]:
        """The mini-batch's passes through the model: (part on the device, its ``sparse``
        a ``MicroLookups``; its ``cold`` argument; whether it is the step's last).

        One pass: the whole mini-batch in its own order, its cold rows a
        ``ColdInFlight`` the gather thread is filling (or ``HOT_ONLY``: none), the
        step's last.

        ``upcoming``: the mini-batch that comes next (None: none, or not known). It is
        split here, before this batch's passes run (on CUDA on the split stream,
        queued: nothing waits for it), and its header is read after them, so the next
        call finds its sizes on the host and starts its gather at once."""
        made = self._current = self._made_for(batch)
        sizes = self._read(made)  # made a step ahead: read at the end of the previous call
        if upcoming is not None:
            self._ahead = self._issue(upcoming)
        dev, split = self._use(made)
        self._observe(batch, made, sizes)
        yield from self._one_pass(made, dev, split, sizes)
        if self._ahead is not None:
            # The next batch's header, read after this batch's work is queued. On CUDA
            # also the end of the split stream's reads of the hot ids: a refresh after
            # this step may free them. Then its cold ids' copy to the host (one process:
            # several ranks' cold lookups send values, not these ids).
            self._read(self._ahead)
            if not self.embeddings.sharded:
                self._ahead.copy_cold_ids(self._stream)

    def _read(self, made: AheadSplit) -> Sizes:
        """``made``'s header, the host's wait for it counted (once: a later read is free)."""
        before = made.sizes
        sizes = made.read()
        if before is None:
            self._window["header_wait"] += made.waited
        return sizes

    def _one_pass(self, made: AheadSplit, dev: Batch, split: DeviceSplit | JointSplit,
                  sizes: Sizes) -> Iterator[tuple[Batch, Any, bool]]:
        """The whole mini-batch, once: its lookups in batch order (a split not by
        popularity, so hot ones first, then cold ones), the dense model over every
        sample once. The gather thread fills the cold rows while the hot lookups and
        the bottom MLP are dispatched (the collection's ``start``); ``finish`` waits."""
        emb = self.embeddings
        if made.gather is not None:  # submitted at the end of the step before (gather_ahead)
            whole, cold = made.whole, made.gather
        elif not (sizes.unique_cold or emb.sharded):  # every lookup hot: no gather at all
            yield Batch(dev.dense, emb.micro_batch(split, sizes, 0), dev.labels), HOT_ONLY, True
            return
        elif self.cfg.hotline.pipeline and not self.in_place:
            whole, cold = self._submit_gather(made, sizes)
        else:  # read in place: the device's gather, launched here; else the host's, waited for
            whole = self._whole(made, sizes)
            t0 = time.perf_counter()  # without the pipeline the step waits for all of it
            cold = self._gather(whole)
            self._window["wait"] += time.perf_counter() - t0
        yield Batch(dev.dense, whole, dev.labels), cold, True
        if isinstance(cold, ColdInFlight):
            self._window["wait"] += cold.waited
            cold = cold.result()  # taken by the forward already: no wait
        self._touch(cold)

    def _whole(self, made: AheadSplit, sizes: Sizes) -> MicroLookups | MixedMicro:
        """``made``'s whole mini-batch as one pass's lookups, ready for its gather: the
        gather's copy waits for the split stream, and cold ids copied ahead are used."""
        whole = self.embeddings.micro_batch(made.split, sizes, 0)
        whole.ready = made.ready
        made.give_cold_ids(whole)
        return whole

    def _submit_gather(self, made: AheadSplit, sizes: Sizes) -> tuple[MicroLookups | MixedMicro, ColdInFlight]:
        """The pass's lookups and their cold gather, submitted to the gather thread."""
        whole = self._whole(made, sizes)
        return whole, ColdInFlight(self.pool.submit(self._gather, whole))

    def _touch(self, cold: Any) -> None:
        """hotline.refresh_every with a plan in flight: the host rows this step's cold
        update writes (one process: ``ColdRows``' or ``GroupCold``'s ids)."""
        host_ids = getattr(cold, "host_ids", None)
        if self._next_hot is not None and host_ids is not None:
            self._touched.append(host_ids)
            if len(self._touched) >= 64:  # a window of steps: bounded by the rows, not the steps
                self._touched = [torch.unique(torch.cat(self._touched))]

    def _made_for(self, batch: Batch) -> AheadSplit:
        """``batch``'s split: the one made a step ahead if it is this batch's and the hot
        set is still the one it was classified against; else one made now (a refresh
        in between changes which lookups are hot, and their slots)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            if ahead.batch is batch and ahead.version == self.embeddings.hot_version:
                self._window["ahead"] += 1
                return ahead
            self._window["resplits"] += 1
        return self._issue(batch)

    def _issue(self, batch: Batch) -> AheadSplit:
        """The mini-batch on the device (copied once) and classified there, its header
        copied to the host; on CUDA all on the split stream, and nothing here waits
        for it (``AheadSplit.read`` does)."""
        emb, stream = self.embeddings, self._stream
        version = emb.hot_version
        if stream is None:
            dev = batch.to(self.device)
            split, slot = self._split(dev, batch)
            return AheadSplit(batch, version, dev, split, split.header, slot=slot)
        current = torch.cuda.current_stream(self.device)
        if version != self._stream_version:  # new hot ids (built, refreshed) were written on this stream
            stream.wait_stream(current)
            self._stream_version = version
        with torch.cuda.stream(stream):
            # one H2D copy of one page-locked block (data/pinned.py; the reader's batches
            # are one already): queued DMA, not a staged copy the host waits for
            dev = batch.to(self.device, non_blocking=True)
            split, slot = self._split(dev, batch)
            header = torch.empty(split.header.numel(), dtype=torch.int64, pin_memory=True)
            header.copy_(split.header, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        return AheadSplit(batch, version, dev, split, header, ready, slot=slot)

    def _split(self, dev: Batch, batch: Batch) -> tuple[DeviceSplit | JointSplit, Any]:
        """``dev``'s split on the current stream, and the graph slot holding it: by a
        replay (hotline.graph_split) where the batch fits the captured one, else eager
        (slot None); a failed capture is said once."""
        graphs = self.split_graphs
        graphed = graphs.split(dev.sparse, batch.sparse) if graphs is not None else None
        if graphed is not None:
            self._window["graphed"] += 1
            return graphed
        if graphs is not None and graphs.failed and self.say is not None:
            self.say(f"warning: hotline.graph_split: the capture failed, splits run eager: {graphs.failed}")
            self.say = None  # said once
        return self.embeddings.split_on_device(dev.sparse, by_popularity=False, host=batch.sparse), None

    def _use(self, made: AheadSplit) -> tuple[Batch, DeviceSplit | JointSplit]:
        """The split's tensors handed to the compute stream (CUDA: it waits for the
        split stream's event, the host does not; each tensor is ``record_stream``-ed, so
        its memory outlives the compute stream's reads)."""
        if made.ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(made.ready)
            made.dev.record_stream(current)  # one block: one call (data/pinned.py)
            if made.slot is not None:  # a graph's buffers: once per slot (split_graphs.py)
                GraphedSplits.record_reads(made.slot, current)
            else:
                record_once(split_tensors(made.split), current)
        return made.dev, made.split

    def _gather(self, micro: Any) -> Any:  # MicroLookups (or mixed.py's MixedMicro)
        t0 = time.thread_time()  # on the gather thread (without the pipeline: the step loop's)
        cold = self.embeddings.gather_cold(micro)
        self._window["gather_cpu"] += time.thread_time() - t0
        self._window["gather"] += cold.gather_s
        self._window["transfer"] += cold.transfer_s
        self._window["late"] += getattr(cold, "late_rows", 0)  # one process (ColdRows, GroupCold)
        self._window["update_wait"] += getattr(cold, "update_wait_s", 0.0)
        self._window["ids_wait"] += getattr(cold, "ids_wait_s", 0.0)
        return cold

    def _observe(self, batch: Batch, made: AheadSplit, sizes: Sizes) -> None:
        w = self._window
        w["steps"] += 1
        # the step loop's CPU and wall time from the last step's call to this one (its
        # thread's time, GIL waits excluded: the two apart say how much of a step it
        # computes and how much it waits), and the update thread's CPU meanwhile
        cpu, wall, update = time.thread_time(), time.perf_counter(), self.embeddings.update_cpu_s()
        if self._clocks is not None:
            w["loop_cpu"] += cpu - self._clocks[0]
            w["loop_wall"] += wall - self._clocks[1]
            w["update_cpu"] += update - self._clocks[2]
            w["loop_steps"] += 1
        self._clocks = (cpu, wall, update)
        lookups = sizes.hot0 + sizes.cold0 + sizes.hot1 + sizes.cold1
        w["hit"] += (sizes.hot0 + sizes.hot1) / max(lookups, 1)
        w["popular"] += sizes.popular / max(batch.size, 1)
        if self.window is not None:  # the device batch's lookups, keyed where they are
            t0 = time.perf_counter()
            if isinstance(made.split, DeviceSplit):
                # one collection, which stacks the window's tables in their order: its
                # split's stacked ids are the window's keys. One copy (a graph's buffers
                # are written again by a later split), not the keying's ops
                self.window.add_keys(made.split.lookups.ids, copy=made.slot is not None)
            else:  # tables of several dtypes: each group's ids are stacked in its own tables
                self.window.add(made.dev.sparse)
            self._planner_s["count"] += time.perf_counter() - t0
            self._planner_s["counted"] += 1

    def announce_next_reads(self) -> None:
        """Before the step's host update is queued (the trainer's static step calls this
        before ``model.end_step()``): the next mini-batch's cold ids, copied to the host a
        step ahead, go to the host tier, whose update then writes those rows first; the
        next gather waits for them only, not for the whole update (one process, one table
        dtype; a gather that reads other rows, after a refresh, waits for all of it). The
        eager step does not: its own dispatch outlasts the update it would shorten."""
        ahead, emb = self._ahead, self.embeddings
        if (ahead is None or ahead.cold_ids is None or len(ahead.cold_ids) != 1
                or not isinstance(emb, HotlineEmbeddingCollection) or emb.sharded):
            return
        ids, ready = ahead.cold_ids[0]
        emb.tier.expect_reads(ids, ready)

    def gather_ahead(self) -> None:
        """One process, the pipeline on: the next mini-batch's cold gather
        submitted now, after this step's update was queued (the trainer calls this
        after ``model.end_step()``, through ``after_step``), so it runs while the step
        loop logs, fetches the next batch and dispatches that step's hot side. Exact
        as at its step: the gather thread reads the host rows after the queued update
        (host_local.py ``collection``). Not where the next split is stale (a refresh
        swapped the hot set: ``after_step`` runs the swap first) or has no cold row;
        several ranks gather by collectives, which stay in the step."""
        ahead, emb = self._ahead, self.embeddings
        if (ahead is None or ahead.gather is not None or not self.cfg.hotline.pipeline or self.in_place
                or emb.sharded or ahead.version != emb.hot_version):
            return
        sizes = ahead.read()
        if sizes.unique_cold:
            ahead.whole, ahead.gather = self._submit_gather(ahead, sizes)

    def after_step(self, step: int) -> None:
        """Every ``refresh_every`` steps (after the update): the hot set planned at the
        last such step is swapped in (embeddings/hotline/refresh.py: only the rows that
        change move), then the counts since are summed (all ranks) and the next hot set
        is chosen and planned on a background thread, to be swapped in at the next such
        step. The plan has a whole window of steps to finish: swapped in at the next
        step, it made the step wait for it (the 2026-11-27 H200, 128MB of 8.6 GB of
        tables, 3.5 ms steps: 292 ms a refresh). The pause is the swap plus the launch,
        with the wait for the plan if it is later than a window. Then the next
        mini-batch's cold gather starts (``gather_ahead``)."""
        current, self._current = self._current, None
        if current is not None and current.slot is not None and self.device.type == "cuda":
            # the step's reads of its split's buffers are queued: the graph's next replay
            # into them waits for this point of the compute stream
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            GraphedSplits.handed(current.slot, done)
        every = self.cfg.hotline.refresh_every
        if every and step % every == 0:
            self._refresh()
        self.gather_ahead()

    def _refresh(self) -> None:
        """``after_step``'s refresh: swap in the planned hot set, plan the next. Both at
        fixed steps, whatever the planner's speed: a run's parameters do not depend on
        its timing (the host and device tiers sum a row's gradient in other orders)."""
        t0 = time.perf_counter()
        if self._next_hot is not None:  # planned a window ago: swap it in now
            touched = torch.cat(self._touched) if self._touched else torch.zeros(0, dtype=torch.int64)
            plan = self._next_hot.result()  # later than a window: the step waits for it
            self._window["refresh_wait"] += time.perf_counter() - t0
            self.embeddings.refresh(plan, touched)
            self._next_hot = self._pending = None
            self._window["refreshes"] += 1
        if self.window is not None:
            self._touched = []
            self._submit(self._take_window())
        self._window["refresh"] += time.perf_counter() - t0

    def _take_window(self) -> WindowCounts:
        """The window's counts (a new window begins): one process, as the planner will
        make them (it plans after); several ranks, summed (a collective: here, on every
        rank), on the host."""
        assert self.window is not None
        made = self.window.take()
        if self.info.world_size == 1:
            return made
        keys, seen = (t.cpu() for t in made.result())
        return merge_counts(all_gather_rows(keys, self.info), all_gather_rows(seen, self.info))

    def _submit(self, counts: WindowCounts) -> None:
        """Plan the hot set ``counts`` choose on the planner thread (swapped in by the
        next ``after_step``)."""
        self._pending = counts
        self._next_hot = self._planner.submit(self._plan, counts)

    def before_save(self) -> None:
        """hotline.refresh_every: hand the refresh's inputs to the collection, which a
        checkpoint saves with its hot set: the counts since the last refresh and those
        a planned refresh was made from. Several ranks (a collective; every rank
        saves): the counts are summed into rank 0's and the others' zeroed, which
        leaves the next refresh's sum the same. A resume (``resume``) takes them back."""
        if self.window is None:
            return
        counts = _on_host(self._take_window())
        if counts is not None and counts[0].numel() == 0:
            counts = None  # no lookup since the last refresh: saved as before the window (None)
        if self.info.is_main:  # the window goes on from them
            self.window.seed(counts)
        self.embeddings.refresh_state = {"counts": to_checkpoint(counts, self.tables),
                                         "pending": to_checkpoint(_on_host(self._pending), self.tables)}

    def resume(self) -> None:
        """After a checkpoint loaded: the refresh's inputs it saved (``before_save``),
        the counts on rank 0 (the sum of every rank's), a planned refresh planned again."""
        saved = self.embeddings.refresh_state
        if not saved or self.window is None:
            return
        if self.info.is_main:
            self.window.seed(from_checkpoint(saved["counts"], self.tables))
        if saved["pending"] is not None:
            self._submit(from_checkpoint(saved["pending"], self.tables))

    def _plan(self, counts: WindowCounts) -> RefreshPlan:
        """On the planner thread: the hot set the counts choose, and how to get there."""
        t0 = time.perf_counter()
        assert self.window is not None
        with self.window.planner_stream():
            plan = self._make_plan(*(counts.result() if isinstance(counts, Future) else counts))
        self._planner_s["plan"] += time.perf_counter() - t0
        self._planner_s["plans"] += 1
        return plan

    def _make_plan(self, keys: torch.Tensor, seen: torch.Tensor) -> RefreshPlan:
        """The plan from the window's counts (``AccessWindow``'s keys and counts), ranked
        on the hot tier's device."""
        optimizer = make_sparse_optimizer(self.cfg.optim.sparse, self.cfg.optim.eps,
                                          self.cfg.embeddings.state_dtype)
        budget = parse_size(self.cfg.hotline.budget) or 0
        # the rows hot now fill what room the window's rows leave (choose_hot_rows)
        profile = HotProfile.chosen(keys.to(self.device), seen.to(self.device), self.tables, optimizer, budget,
                                    keep=self.embeddings.hot_rows(), fill=self.cfg.hotline.fill_unseen)
        plan = self.embeddings.plan_refresh(profile)
        self.embeddings.prefetch_entering(plan)  # after this step's queued host update
        return plan

    def stats(self, whole_run: bool = False) -> dict[str, float]:
        """Hit rate, popular share, host gather, transfer to the device and wait ms
        per step, and the share of gather + transfer hidden behind the step's hot
        side (its hot lookups, the bottom MLP), over the window since the last call (then a new window starts)
        or over the whole run. Several ranks: this rank's view."""
        self.reset_window()
        w = self._total if whole_run else self._last
        p = dict(self._planner_s)
        merge_s = self.window.merge_s if self.window is not None else 0.0
        steps = max(w["steps"], 1)
        gather, transfer, wait = w["gather"], w["transfer"], w["wait"]
        busy = gather + transfer
        out = {
            "hot_hit_rate": w["hit"] / steps,
            "popular_share": w["popular"] / steps,
            "gather_ms": 1000 * gather / steps,
            "transfer_ms": 1000 * transfer / steps,
            "gather_wait_ms": 1000 * wait / steps,
            "gather_hidden": max(0.0, 1 - wait / busy) if busy > 0 else 1.0,
            # hotline.gather_threads (threads of ours); 0: one index_select over torch's intra-op threads
            "gather_threads": float(self.embeddings.gather_threads),
            "gather_torch_threads": float(torch.get_num_threads()),
            # hotline.cold_path=mapped: 1 where the device read the cold rows in place
            "cold_in_place": float(self.in_place),
            # embeddings.kernels: 1 where the hot tier runs on the Triton kernels
            "hot_tier_triton": float(self.embeddings.on_triton()),
            # hotline.refresh_every: re-profiles and the mean pause each cost the step loop
            "refreshes": w["refreshes"],
            "refresh_pause_ms": 1000 * w["refresh"] / w["refreshes"] if w["refreshes"] else 0.0,
            # of that pause, the wait for the plan (made on the planner thread from the
            # window's counts; a window shorter than the plan takes makes the step wait:
            # a larger refresh_every hides it)
            "refresh_wait_ms": 1000 * w["refresh_wait"] / w["refreshes"] if w["refreshes"] else 0.0,
            # the planner thread's time a plan (the whole run; its merges of the windows'
            # keys included): a window of refresh_every steps shorter makes the refresh
            # wait; and the step loop's time a step keying its lookups for the window
            "plan_ms": 1000 * (p["plan"] + merge_s) / p["plans"] if p["plans"] else 0.0,
            "count_ms": 1000 * p["count"] / p["counted"] if p["counted"] else 0.0,
            # mini-batches whose split was made a step ahead; those made again at their
            # step (the hot set changed in between, or another batch came)
            "split_ahead": w["ahead"] / steps,
            "resplits": w["resplits"],
            # hotline.graph_split: mini-batches split by a graph replay (per step)
            "split_graphed": w["graphed"] / steps,
            # one process: the gather thread's wait for host updates, and the cold rows it
            # read again after the previous step's update (the rows that update wrote)
            "update_wait_ms": 1000 * w["update_wait"] / steps,
            # of gather_ms, the gather thread's wait for the cold ids' D2H copy (CUDA)
            "ids_wait_ms": 1000 * w["ids_wait"] / steps,
            "late_rows": w["late"] / steps,
            # the step loop's wait for the next mini-batch's split header (its sizes): the
            # split stream's work, queued a step ahead, not yet done when the host reads it
            "header_wait_ms": 1000 * w["header_wait"] / steps,
            # the threads' CPU a step: the step loop's (from one step's start to the next,
            # beside that span's wall time: a loop that computes for less than its wall
            # waits, for the GIL or the device), the gather thread's and the update thread's
            "loop_cpu_ms": 1000 * w["loop_cpu"] / max(w["loop_steps"], 1),
            "loop_wall_ms": 1000 * w["loop_wall"] / max(w["loop_steps"], 1),
            "gather_cpu_ms": 1000 * w["gather_cpu"] / steps,
            "update_cpu_ms": 1000 * w["update_cpu"] / max(w["loop_steps"], 1),
        }
        if whole_run:  # the host tier's share on 2 MiB pages: the cold gather's TLB misses
            share = host_huge_share(self.embeddings.host_tiers())
            if share is not None:
                out["host_huge_pages"] = share
        return out

    def close(self) -> None:
        """A plan still pending (made at the last step) is dropped: no step needs it;
        so is a split made ahead for a batch that never came."""
        self._ahead = None
        self.pool.shutdown(wait=True)
        self._planner.shutdown(wait=True)
        if self.in_place:  # evals and checkpoints after the run read the tables on the host
            self.embeddings.read_in_place(False)
            self.in_place = False


def host_huge_share(hosts: list[torch.nn.Module]) -> float | None:
    """Of the host tiers' tensors big enough to be advised onto 2 MiB pages
    (embeddings/huge_pages.py), the share of their bytes the kernel backs with them
    now; None where there are none or /proc/self/smaps cannot be read."""
    big = [t for host in hosts for t in (*host.parameters(), *host.buffers())
           if t.device.type == "cpu" and t.untyped_storage().nbytes() >= huge_pages.MIN_BYTES]
    found = huge_pages.huge_page_bytes(big) if big else None
    if not found:
        return None
    return sum(found) / sum(t.untyped_storage().nbytes() for t in big)


def _on_host(counts: WindowCounts | None) -> Counts | None:
    """A window's counts (made or in the making) as host tensors."""
    if counts is None:
        return None
    keys, seen = counts.result() if isinstance(counts, Future) else counts
    return keys.cpu(), seen.cpu()
