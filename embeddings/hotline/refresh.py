"""A new hot set swapped in at a step boundary, moving only the rows that change.

    old hot ids [H]   ──┐ plan (searches of sorted ids, on the hot tier's device: any
    new hot ids [H']  ──┘ thread, in the background while steps go on)
        stay   rows hot before and after: new slot ◄── old slot   (device to device)
        leave  rows no longer hot: written home (weight + per-row state)
        enter  rows newly hot: read from the host tier, ahead on the planner's thread
               (one process), the ones a cold update wrote since read again
        │ swap (at a step boundary, no kept gradient pending)
        ▼
    new hot tier [H'] (a second buffer; the old one is dropped once built)

Exact: every row keeps one authoritative copy and one optimizer state. A row that
stays hot never leaves the device; one that leaves is written home before anyone
reads it there; one that enters is read from the host at the swap, after every
update queued for it. The hot tier's scalar state (Adam's step) is its own and stays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embeddings.hotline.host_tier import HostTier
from embeddings.hotline.hot_tier import HotTier
from embeddings.hotline.profile import HotProfile, in_sorted


@dataclass
class RefreshPlan:
    """Which rows stay, leave and enter (host tensors; slots index the hot tiers)."""

    profile: HotProfile
    old_ids: torch.Tensor  # [H] the hot set this plan starts from
    ids: torch.Tensor  # [H'] the new hot set, sorted stacked ids
    stay_old: torch.Tensor  # [K] old slots of the rows that stay hot
    stay_new: torch.Tensor  # [K] their new slots
    leave_old: torch.Tensor  # [L] old slots of the rows that stop being hot
    enter_new: torch.Tensor  # [E] new slots of the rows that become hot
    # host copies of the entering rows and their state, read ahead (``prefetch_entering``)
    entering: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None
    # ``ids`` and the four index tensors where the plan's searches ran (the hot tier's
    # device; by field name): the swap uses them there, no copy back to the device
    on_device: dict[str, torch.Tensor] | None = None

    @property
    def enter_ids(self) -> torch.Tensor:
        return self.ids.index_select(0, self.enter_new)

    @property
    def moved_rows(self) -> int:
        """Rows that cross between host and device at the swap."""
        return self.leave_old.numel() + self.enter_new.numel()


def plan_refresh(old_ids: torch.Tensor, new_ids: torch.Tensor, profile: HotProfile,
                 device: torch.device | None = None) -> RefreshPlan:
    """The plan from hot set ``old_ids`` to ``new_ids`` (both sorted, on the host), its
    searches run on ``device`` (the hot tier's: 500k ids against 500k took 36 ms on one
    core here), the plan's tensors on the host, and kept where they were made
    (``on_device``: five copies to the device fewer in the swap, 500k ids each)."""
    old, new = (old_ids, new_ids) if device is None else (old_ids.to(device), new_ids.to(device))
    stays_in_new = in_sorted(new, old)
    stays_in_old = in_sorted(old, new)
    stay_new = stays_in_new.nonzero().flatten()
    stay_old = torch.searchsorted(old, new.index_select(0, stay_new))
    moves = (stay_old, stay_new, (~stays_in_old).nonzero().flatten(), (~stays_in_new).nonzero().flatten())
    # the copies to the host wait for the searches: the device tensors are made by then
    plan = RefreshPlan(profile, old_ids, new_ids, *(t.cpu() for t in moves))
    if device is not None:
        plan.on_device = dict(zip(("stay_old", "stay_new", "leave_old", "enter_new", "ids"), (*moves, new)))
    return plan


def prefetch_entering(tier: HostTier, plan: RefreshPlan, device: torch.device | None = None) -> None:
    """Read the entering rows (and state) on the host ahead of the swap, on the
    planner's thread, after the updates queued so far. One process only (several
    ranks read them by a collective, at the swap). Rows a later cold update writes
    (perhaps while they are read here) are read again at the swap (``touched``).
    For a CUDA ``device`` they are read into page-locked memory here, so the swap's
    copy is queued DMA from them, not a pinned copy first on the step loop's thread
    (the 2026-11-28 H200's refresh row: 0.6 ms of ``pin_memory`` a step)."""
    weight, state = tier.read_rows(plan.enter_ids, torch.device("cpu"))
    if device is not None and device.type == "cuda":
        weight, state = weight.pin_memory(), {name: t.pin_memory() for name, t in state.items()}
    plan.entering = weight, state


def _entering(tier: HostTier, plan: RefreshPlan, device: torch.device, per_row: list[str],
              touched: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The entering rows on ``device``: prefetched, with the rows ``touched`` since
    (stacked ids the host updated) read again; or read now."""
    ids = plan.enter_ids
    if plan.entering is None or touched is None:
        return tier.read_rows(ids, device)
    weight, state = plan.entering
    # a sorted search in the touched ids made unique (the cold updates of a window of
    # steps: ~135k ids, repeats among them, on bench_gpu), where isin sorts both: 2.8 ms
    # against 7.2 here for 20k entering rows, in the refresh's pause
    stale = in_sorted(ids, torch.unique(touched)).nonzero().flatten()
    if stale.numel():
        fresh_weight, fresh_state = tier.read_rows(ids.index_select(0, stale), torch.device("cpu"))
        weight.index_copy_(0, stale, fresh_weight)
        for name in per_row:
            state[name].index_copy_(0, stale, fresh_state[name])
    return _to(weight, device), {name: _to(t, device) for name, t in state.items()}


def _planned(plan: RefreshPlan, name: str, device: torch.device) -> torch.Tensor:
    """The plan's tensor ``name`` on ``device``: the one its searches made there, else a
    copy of the host one. Made on the planner's stream: on CUDA it is marked as read by
    the swap's (current) stream, so its memory is not handed out again, once the plan is
    dropped, before the swap's queued reads are done."""
    made = (plan.on_device or {}).get(name)
    if made is None or made.device != device:
        return _to(getattr(plan, name), device)
    if made.device.type == "cuda":
        made.record_stream(torch.cuda.current_stream(made.device))
    return made


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; host to CUDA through page-locked memory, queued (a pageable
    copy makes the host wait until the stream reaches it: the whole step queued)."""
    if device.type == "cuda" and t.device.type == "cpu":
        pinned = t if t.is_pinned() else t.pin_memory()  # prefetched rows are already
        return pinned.to(device, non_blocking=True)
    return t.to(device)


@torch.no_grad()
def swap(tier: HostTier, hot: HotTier, plan: RefreshPlan, per_row: list[str],
         touched: torch.Tensor | None = None) -> None:
    """Move ``hot`` to ``plan``'s hot set (see the module docstring); several ranks:
    a collective (every rank reads the same entering rows). ``touched``: stacked ids
    the host tier updated since ``prefetch_entering`` (None: read them all now).

    The entering rows are read first (after the host updates queued: the reads of
    the stale ones wait for them), then the leaving rows are written home behind
    them (one process: queued on the host-update thread, their D2H queued on the
    stream, so the step loop waits for neither; the two sets of rows are disjoint)."""
    device = hot.device
    weight, state = hot.weight.data, hot.state
    enter_weight, enter_state = _entering(tier, plan, device, per_row, touched)
    leave = _planned(plan, "leave_old", device)
    tier.write_rows_later(plan.old_ids.index_select(0, plan.leave_old), weight.index_select(0, leave),
                          {n: t.index_select(0, leave) if n in per_row else t for n, t in state.items()})
    stay_old, stay_new, enter = (_planned(plan, name, device) for name in ("stay_old", "stay_new", "enter_new"))

    def built(old: torch.Tensor, entering: torch.Tensor) -> torch.Tensor:
        new = old.new_empty((plan.ids.numel(), *old.shape[1:]))
        new.index_copy_(0, stay_new, old.index_select(0, stay_old))
        return new.index_copy_(0, enter, entering.to(old.dtype))

    new_state = {n: built(t, enter_state[n]) if n in per_row else t.clone() for n, t in state.items()}
    hot.load(_planned(plan, "ids", device), built(weight, enter_weight), new_state)
