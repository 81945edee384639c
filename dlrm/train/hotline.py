"""Hotline mode in the trainer: profile the hot rows, split and pipeline each step.

    mini-batch ──to the device once, classified there (split stream; embeddings/hotline/split.py)
        │ the host reads the 56-byte header: the micro-batches' sizes
        ├──► popular (every lookup hot) ──► forward/backward on the device
        └──► non-popular ──host thread: its U cold ids D2H, their rows gathered, H2D──┐
                                                   forward/backward ◄─────────────────┘
    one optimizer step for both (kept KV gradients), so the math is ordinary training

The host applies cold updates at the step's end, before the next step's gather
reads them (read-after-write is ordered by the step boundary).

Several ranks: every rank splits its own share of the global batch; the host
thread's "gather" is then the sharded host tier's lookup (ids all-to-all, the
owners' host lookups, pooled all-to-all), which runs while the popular
micro-batch computes. The non-popular micro-batch runs on every rank, empty or
not (its lookup is a collective, and it is the micro-batch DDP syncs on); the
profile's counts are summed over the ranks, so every rank has the same hot rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from data.batch import Batch
from dlrm.config import Config
from dlrm.parallel.distributed import DistInfo, all_reduce_sum
from embeddings.hotline.profile import HotProfile, count_accesses, default_max_batches
from embeddings.hotline.refresh import RefreshPlan
from embeddings.hotline.split import (
    DeviceSplit,
    JointSplit,
    Sizes,
    samples_of,
    split_tensors,
)
from embeddings.hotline.tiers import HOT_ONLY
from embeddings.optim import make_sparse_optimizer
from embeddings.plan.sizes import parse_size
from embeddings.table import TableSpec

PROFILE_FILE = "hot_profile.pt"


def make_profile(
    cfg: Config,
    tables: list[TableSpec],
    reader: Any,
    run_dir: Path,
    say: Callable[[str], None],
    info: DistInfo | None = None,
) -> HotProfile:
    """The run's hot set: reused from RUN/hot_profile.pt, else profiled on a sample
    (several ranks: each counts its share, the counts are summed, rank 0 saves)."""
    info = info or DistInfo()
    path = run_dir / PROFILE_FILE
    # Every rank looks before anyone can write it: rank 0 saves only after the
    # counts' all-reduce, which every rank joins after looking.
    if all_reduce_sum([float(path.is_file())], info)[0] == info.world_size:
        say(f"hotline: reusing the hot profile {path}")
        return HotProfile.load(path)
    budget = parse_size(cfg.hotline.budget) or 0
    sample = default_max_batches(reader.steps_per_epoch(), cfg.hotline.profile_fraction)
    counts = count_accesses(
        (b.sparse for b in reader.epoch(0)), tables, sample, cfg.hotline.profile_seconds
    )
    counts = sum_counts(counts, tables, info)
    optimizer = make_sparse_optimizer(cfg.optim.sparse, cfg.optim.eps, cfg.embeddings.state_dtype)
    profile = HotProfile.build(counts, tables, optimizer, budget)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        profile.save(path)
    hot = sum(int(ids.numel()) for ids in profile.hot.values())
    say(f"hotline: {hot:,} hot rows within {cfg.hotline.budget} from {sample} profiled batches")
    return profile


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


class HotlineSteps:
    """Micro-batches of each mini-batch, cold rows gathered ahead; stats as JSON."""

    def __init__(self, model: torch.nn.Module, cfg: Config, info: DistInfo | None = None) -> None:
        self.embeddings = model.embeddings
        self.cfg = cfg
        self.info = info or DistInfo()
        self.tables: list[TableSpec] = self.embeddings.tables
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotline-gather")
        self.device = self.embeddings.hot_device
        # CUDA: the side stream that copies each mini-batch in and classifies it
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._hot_changed = True
        # hotline.refresh_every: the next hot set, chosen in the background (see after_step)
        self._planner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotline-refresh")
        self._next_hot: Future[RefreshPlan] | None = None
        self._touched: list[torch.Tensor] = []  # host rows cold updates wrote since the plan began
        self.counts: dict[str, torch.Tensor] | None = None
        self._window: dict[str, float] = {}
        self._total: dict[str, float] = {}
        self.reset_window()

    def reset_window(self) -> None:
        """Close the current window: add it to the run's totals, keep it as the last."""
        self._last = dict(self._window)
        for key in ("steps", "hit", "popular", "gather", "transfer", "wait", "refreshes", "refresh"):
            self._total[key] = self._total.get(key, 0.0) + self._window.get(key, 0.0)
            self._window[key] = 0.0

    def micro_batches(self, batch: Batch) -> Iterator[tuple[Batch, Any, bool]]:
        """(popular, HOT_ONLY, False), then (non-popular, its cold rows, True): the
        part on the device (its ``sparse`` a ``MicroLookups``), its ``cold`` argument,
        and whether it is the step's last micro-batch. An empty part is skipped, but
        on several ranks the non-popular one never is."""
        emb = self.embeddings
        dev, split, sizes, ready = self._split(batch)
        self._observe(batch, sizes)
        rest_runs = batch.size > sizes.group0 or emb.sharded  # several ranks: a collective
        future = rest = None
        if rest_runs:
            rest = self._part(dev, split, sizes, 1)
            rest.sparse.ready = ready  # the gather's copy waits for the split stream
            if self.cfg.hotline.pipeline:
                future = self.pool.submit(self._gather, rest.sparse)
        if sizes.group0:
            yield self._part(dev, split, sizes, 0), HOT_ONLY, not rest_runs
        if rest is not None:
            t0 = time.perf_counter()  # waiting for the gather (all of it without the pipeline)
            cold = future.result() if future is not None else self._gather(rest.sparse)
            self._window["wait"] += time.perf_counter() - t0
            host_ids = getattr(cold, "host_ids", None)  # one process: ColdRows (or per-dtype GroupCold)
            if self._next_hot is not None and host_ids is not None:
                self._touched.append(host_ids)  # this step's cold update writes them
            yield rest, cold, True

    def _split(self, batch: Batch) -> tuple[Batch, DeviceSplit | JointSplit, Sizes, torch.cuda.Event | None]:
        """The mini-batch on the device (copied once), classified there, and the
        split's header read by the host: the step's one wait for the device, and on
        CUDA a wait for the split stream only (classification of this batch), not for
        the compute stream's queue of earlier work."""
        emb, stream = self.embeddings, self._stream
        if stream is None:
            dev = batch.to(self.device)
            split = emb.split_on_device(dev.sparse, host=batch.sparse)
            return dev, split, split.read_sizes(split.header), None
        current = torch.cuda.current_stream(self.device)
        if self._hot_changed:  # new hot ids (built, or refreshed) were written on this stream
            stream.wait_stream(current)
            self._hot_changed = False
        with torch.cuda.stream(stream):
            # page-locked first (a host copy of a few hundred KB): the H2D copy is then
            # queued DMA, not a staged copy the host waits for
            dev = batch.pin_memory().to(self.device, non_blocking=True)
            split = emb.split_on_device(dev.sparse, host=batch.sparse)
            header = torch.empty(split.header.numel(), dtype=torch.int64, pin_memory=True)
            header.copy_(split.header, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        ready.synchronize()
        current.wait_event(ready)  # the compute stream reads the split after it, the host does not wait
        dev.record_stream(current)  # made on the split stream, freed after the compute stream's use
        for t in split_tensors(split):
            t.record_stream(current)
        return dev, split, split.read_sizes(header), ready

    def _part(self, dev: Batch, split: DeviceSplit | JointSplit, sizes: Sizes, group: int) -> Batch:
        samples = samples_of(split, sizes, group)
        micro = self.embeddings.micro_batch(split, sizes, group)
        return Batch(dev.dense.index_select(0, samples), micro, dev.labels.index_select(0, samples))

    def _gather(self, micro: Any) -> Any:  # MicroLookups (or mixed.py's MixedMicro)
        cold = self.embeddings.gather_cold(micro)
        self._window["gather"] += cold.gather_s
        self._window["transfer"] += cold.transfer_s
        return cold

    def _observe(self, batch: Batch, sizes: Sizes) -> None:
        w = self._window
        w["steps"] += 1
        lookups = sizes.hot0 + sizes.cold0 + sizes.hot1 + sizes.cold1
        w["hit"] += (sizes.hot0 + sizes.hot1) / max(lookups, 1)
        w["popular"] += sizes.popular / max(batch.size, 1)
        if self.cfg.hotline.refresh_every:
            counts = count_accesses([batch.sparse], self.tables)  # the host's copy of the ids
            self.counts = counts if self.counts is None else {
                k: self.counts[k] + v for k, v in counts.items()
            }

    def after_step(self, step: int) -> None:
        """Every ``refresh_every`` steps (after the update): the counts are summed (all
        ranks) and the next hot set is chosen and planned on a background thread
        while the next step runs; at the boundary after it, the plan is swapped in
        (embeddings/hotline/refresh.py: only the rows that change move). The pause is
        the launch plus the swap, with the wait for the plan if it is late."""
        every = self.cfg.hotline.refresh_every
        if not every:
            return
        t0 = time.perf_counter()
        if self._next_hot is not None:  # planned during this step: swap it in now
            touched = torch.cat(self._touched) if self._touched else torch.zeros(0, dtype=torch.int64)
            self.embeddings.refresh(self._next_hot.result(), touched)
            self._next_hot = None
            self._hot_changed = True
            self._window["refreshes"] += 1
        if step % every == 0 and self.counts is not None:
            counts = sum_counts(self.counts, self.tables, self.info)  # a collective: here, on every rank
            self.counts = None
            self._touched = []
            self._next_hot = self._planner.submit(self._plan, counts)
        self._window["refresh"] += time.perf_counter() - t0

    def _plan(self, counts: dict[str, torch.Tensor]) -> RefreshPlan:
        """On the planner thread: the hot set the counts choose, and how to get there."""
        optimizer = make_sparse_optimizer(self.cfg.optim.sparse, self.cfg.optim.eps,
                                          self.cfg.embeddings.state_dtype)
        budget = parse_size(self.cfg.hotline.budget) or 0
        plan = self.embeddings.plan_refresh(HotProfile.build(counts, self.tables, optimizer, budget))
        self.embeddings.prefetch_entering(plan)  # after this step's queued host update
        return plan

    def stats(self, whole_run: bool = False) -> dict[str, float]:
        """Hit rate, popular share, host gather, transfer to the device and wait ms
        per step, and the share of gather + transfer hidden behind the popular
        micro-batch, over the window since the last call (then a new window starts)
        or over the whole run. Several ranks: this rank's view."""
        self.reset_window()
        w = self._total if whole_run else self._last
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
            "gather_threads": float(self.embeddings.gather_threads),
            # embeddings.kernels: 1 where the hot tier runs on the Triton kernels
            "hot_tier_triton": float(self.embeddings.on_triton()),
            # hotline.refresh_every: re-profiles and the mean pause each cost the step loop
            "refreshes": w["refreshes"],
            "refresh_pause_ms": 1000 * w["refresh"] / w["refreshes"] if w["refreshes"] else 0.0,
        }
        return out

    def close(self) -> None:
        """A plan still pending (made at the last step) is dropped: no step needs it."""
        self.pool.shutdown(wait=True)
        self._planner.shutdown(wait=True)
