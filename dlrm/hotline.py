"""Hotline mode in the trainer: profile the hot rows, split and pipeline each step.

    mini-batch ──split──► popular (every lookup hot) ──► forward/backward on the device
                    └──► non-popular ──host thread: gather its cold rows──┐ (meanwhile)
                                                   forward/backward ◄─────┘
    one optimizer step for both (kept KV gradients), so the math is ordinary training

The host applies cold updates at the step's end, before the next step's gather
reads them (read-after-write is ordered by the step boundary).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from data.batch import Batch
from dlrm.config import Config
from embeddings.hotline.profile import HotProfile, count_accesses, default_max_batches
from embeddings.optim import make_sparse_optimizer
from embeddings.plan import parse_size
from embeddings.table import TableSpec

PROFILE_FILE = "hot_profile.pt"


def make_profile(
    cfg: Config, tables: list[TableSpec], reader: Any, run_dir: Path, say: Callable[[str], None]
) -> HotProfile:
    """The run's hot set: reused from RUN/hot_profile.pt, else profiled on a sample."""
    path = run_dir / PROFILE_FILE
    if path.is_file():
        say(f"hotline: reusing the hot profile {path}")
        return HotProfile.load(path)
    budget = parse_size(cfg.hotline.budget) or 0
    sample = default_max_batches(reader.steps_per_epoch(), cfg.hotline.profile_fraction)
    counts = count_accesses(
        (b.sparse for b in reader.epoch(0)), tables, sample, cfg.hotline.profile_seconds
    )
    optimizer = make_sparse_optimizer(cfg.optim.sparse, cfg.optim.eps)
    profile = HotProfile.build(counts, tables, optimizer, budget)
    run_dir.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    hot = sum(int(ids.numel()) for ids in profile.hot.values())
    say(f"hotline: {hot:,} hot rows within {cfg.hotline.budget} from {sample} profiled batches")
    return profile


class HotlineSteps:
    """Micro-batches of each mini-batch, cold rows gathered ahead; stats as JSON."""

    def __init__(self, model: torch.nn.Module, cfg: Config) -> None:
        self.embeddings = model.embeddings
        self.cfg = cfg
        self.tables: list[TableSpec] = self.embeddings.tables
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotline-gather")
        self.counts: dict[str, torch.Tensor] | None = None
        self._window: dict[str, float] = {}
        self._total: dict[str, float] = {}
        self.reset_window()

    def reset_window(self) -> None:
        """Close the current window: add it to the run's totals, keep it as the last."""
        self._last = dict(self._window)
        for key in ("steps", "hit", "popular", "gather", "wait"):
            self._total[key] = self._total.get(key, 0.0) + self._window.get(key, 0.0)
            self._window[key] = 0.0

    def micro_batches(self, batch: Batch) -> Iterator[tuple[Batch, Any]]:
        """(popular, None), then (non-popular, its cold rows); empty parts skipped."""
        emb = self.embeddings
        popular_mask = emb.split(batch.sparse)
        popular = batch.select(popular_mask.nonzero().flatten())
        rest = batch.select((~popular_mask).nonzero().flatten())
        self._observe(batch, popular_mask)
        future = None
        if rest.size and self.cfg.hotline.pipeline:
            future = self.pool.submit(self._gather, rest)
        if popular.size:
            yield popular, None
        if rest.size:
            cold = None
            if future is not None:
                t0 = time.perf_counter()
                cold = future.result()
                self._window["wait"] += time.perf_counter() - t0
            yield rest, cold

    def _gather(self, rest: Batch) -> Any:
        t0 = time.perf_counter()
        cold = self.embeddings.gather_cold(rest.sparse)
        self._window["gather"] += time.perf_counter() - t0
        return cold

    def _observe(self, batch: Batch, popular_mask: torch.Tensor) -> None:
        w = self._window
        w["steps"] += 1
        w["hit"] += self.embeddings.profile.hit_rate(batch.sparse)
        w["popular"] += float(popular_mask.float().mean()) if popular_mask.numel() else 0.0
        if self.cfg.hotline.refresh_every:
            counts = count_accesses([batch.sparse], self.tables)
            self.counts = counts if self.counts is None else {
                k: self.counts[k] + v for k, v in counts.items()
            }

    def after_step(self, step: int) -> None:
        """Re-choose the hot rows every ``refresh_every`` steps (after the update)."""
        every = self.cfg.hotline.refresh_every
        if every and step % every == 0 and self.counts is not None:
            optimizer = make_sparse_optimizer(self.cfg.optim.sparse, self.cfg.optim.eps)
            budget = parse_size(self.cfg.hotline.budget) or 0
            self.embeddings.refresh(HotProfile.build(self.counts, self.tables, optimizer, budget))
            self.counts = None

    def stats(self, whole_run: bool = False) -> dict[str, float]:
        """Hit rate, popular share, host gather and wait ms per step, and the share of
        the gather hidden behind the popular micro-batch, over the window since the
        last call (then a new window starts) or over the whole run."""
        self.reset_window()
        w = self._total if whole_run else self._last
        steps = max(w["steps"], 1)
        gather, wait = w["gather"], w["wait"]
        out = {
            "hot_hit_rate": w["hit"] / steps,
            "popular_share": w["popular"] / steps,
            "gather_ms": 1000 * gather / steps,
            "gather_wait_ms": 1000 * wait / steps,
            "gather_hidden": (1 - wait / gather) if gather > 0 else 1.0,
        }
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=True)
