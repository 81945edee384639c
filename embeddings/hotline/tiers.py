"""Two-tier embeddings: hot rows on the device, every row in host memory.

    host memory (authoritative for COLD rows)     device (authoritative for HOT rows)
    ┌──────────────────────────────────────┐      ┌────────────────────────────┐
    │ stacked weight [sum(rows), D]        │      │ hot_weight [H, D]          │
    │ + optimizer state, per row           │ ───► │ + optimizer state [H, ..]  │
    │ (hot rows here are stale until       │ load │ hot_ids [H] stacked ids,   │
    │  sync_to_host / export / refresh)    │ ◄─── │ sorted: slot = searchsorted│
    └──────────────────────────────────────┘ sync └────────────────────────────┘

    forward(ids):  stacked id ──searchsorted(hot_ids)──► hot?  ─yes─► slot ─► hot_weight
                                                            └─no──► unique cold ids
                   gather cold rows on host ──copy──► ColdRows [U, D] on device
                   pooled bag = Σ hot part + Σ cold part  (mean: ÷ FULL bag length)
    backward:      hot KVGradient (slots)  ──► device optimizer
                   cold KVGradient (stacked ids, moved to host) ──► host optimizer
                   (applied at once when fused, else kept until step())

Every row has one authoritative copy and one optimizer state. Scalar optimizer
state (Adam's step) exists in both tiers; both tiers apply exactly once per step
(an empty gradient still counts), so both counters equal the single-process one.

The hot tier (``hot_tier.py``) is one class; the host tier is one interface
(``host_tier.py``) with two implementations: one process (``host_local.py``, the
picture above) and several ranks (``host_sharded.py``: cold rows sharded over the
ranks' host memory by a ``plan``, reached by all-to-all; hot tier replicated).

Popular/non-popular micro-batches: with ``fused=False``, forward + backward on
each micro-batch then one ``step()`` equals one step on the whole mini-batch
(kept gradients are summed per row before the optimizer sees them).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from embeddings.collection import EmbeddingCollection, naming_oom
from embeddings.hotline.host_local import LocalHostTier
from embeddings.hotline.host_sharded import ShardedHostTier
from embeddings.hotline.host_tier import HostTier
from embeddings.hotline.hot_tier import HotTier
from embeddings.hotline.lookups import HOT_ONLY, ColdInFlight, ColdPooled, ColdRows, Lookups
from embeddings.hotline.profile import HotProfile
from embeddings.hotline.refresh import RefreshPlan, plan_refresh, prefetch_entering, swap
from embeddings.hotline.split import (
    DeviceSplit,
    MicroLookups,
    Sizes,
    all_hot,
    micro_lookups,
    split_on_device,
)
from embeddings.hotline.static_step import StaticLookups, static_pooled
from embeddings.interface import Prefetched, TableState
from embeddings.jagged import in_feature_order
from embeddings.kernels import KernelChoice
from embeddings.kv import KVGradient
from embeddings.optim import SparseOptimizer
from embeddings.sharded import scale_grad
from embeddings.table import Pooling, TableSpec

if TYPE_CHECKING:
    import torch.distributed as dist

    from data.jagged import KeyedJagged
    from embeddings.interface import TableState
    from embeddings.plan.types import ShardingPlan

__all__ = ["HOT_ONLY", "ColdPooled", "ColdRows", "HotlineEmbeddingCollection"]


@dataclass
class HotStarted:
    """A lookup begun by ``start``: its lookups, the cold rows that came with them (or
    are on their way), and the hot part already launched [F*B, D]."""

    micro: MicroLookups
    cold: Any
    hot: torch.Tensor


class HotlineEmbeddingCollection(EmbeddingCollection):
    """``LocalEmbeddingCollection`` semantics, with the profile's hot rows on ``device``.

    The host tier is a ``LocalEmbeddingCollection`` (one process) or, given a
    ``plan``, a ``ShardedEmbeddingCollection`` over ``group`` (``host``); it is kept
    out of the module tree, so ``.to(device)`` moves the hot tier only. The hot tier's
    replicas all-gather their gradients over ``hot_group`` (default ``group``): the
    run's own backend, so on GPUs they stay on the device while the cold rows'
    collectives run on the host's gloo ``group``.
    """

    def __init__(
        self,
        tables: list[TableSpec],
        profile: HotProfile,
        optimizer: SparseOptimizer,
        fused: bool = True,
        seed: int | None = 0,
        device: torch.device | str = "cpu",
        host: torch.device | str = "cpu",
        plan: ShardingPlan | None = None,
        group: dist.ProcessGroup | None = None,
        gather_threads: int = 1,
        rounding_seed: int | None = None,
        kernels: str | KernelChoice = KernelChoice.AUTO,
        hot_group: dist.ProcessGroup | None = None,
        stage_cold: bool = True,
    ) -> None:
        """``rounding_seed`` (default ``seed``): of fp16/bf16 tables' stochastic rounding,
        in both tiers (embeddings/rounding.py). ``kernels``: the hot tier's lookups
        (embeddings/kernels; ``auto``: Triton on CUDA, one process, any table type).
        ``stage_cold``: a static step updates its cold rows on the device where it can
        (cold_stage.py; off: their gradient goes home, ``hotline.cold_update=host``)."""
        super().__init__()
        device = torch.device(device)
        rounding_seed = (seed or 0) if rounding_seed is None else rounding_seed
        if any(t.dtype != "fp32" for t in tables):
            optimizer.rounding = True  # both tiers count their updates: the rounding step
        tier: HostTier
        if plan is not None:
            if fused:
                raise ValueError("Hotline on several ranks keeps gradients: hot ones are all-gathered")
            tier = ShardedHostTier(tables, plan, optimizer, seed, group, host, rounding_seed)
        else:
            tier = LocalHostTier(tables, optimizer, fused, seed, host, device, gather_threads, rounding_seed)
        self.tier = tier  # a plain object: the host tables stay out of the module tree
        self.tables = list(tables)
        self.dim = tables[0].dim
        self.features = [f for t in tables for f in t.features]
        self.row_offsets: dict[str, int] = {}
        total = 0
        for t in tables:
            self.row_offsets[t.name] = total
            total += t.rows
        self.optimizer = optimizer
        self.fused = fused
        self.grad_scale = 1.0  # several ranks: 1/W (see dlrm/parallel/)
        table_of = {f: t.name for t in tables for f in t.features}
        offsets = torch.tensor([self.row_offsets[table_of[f]] for f in self.features], dtype=torch.int64)
        self.register_buffer("feature_offsets", offsets.to(device), persistent=False)
        self._offsets_cache: dict[torch.device, torch.Tensor] = {}  # feature_offsets per device
        self._bag_offsets_cache: dict[tuple[torch.device, int], torch.Tensor] = {}
        self.hot = HotTier(optimizer, fused, self.tables, rounding_seed, kernels, one_process=plan is None,
                           group=group if hot_group is None else hot_group)
        self._last: tuple[int, int, int, int, int] | None = None
        # a static step's cold gradient was sent: its hot rows are updated already
        self._static_done = False
        self.stage_cold = stage_cold
        self.profile = profile
        # Bumped whenever the hot tier is (re)loaded: a split made before classified
        # against other hot ids (the trainer's split made a step ahead checks it).
        self.hot_version = 0
        self.refresh_state: dict[str, Any] | None = None  # see embeddings/interface.py HotSetHolder
        self._load_hot(self._stacked_hot_ids(profile), device)

    # ------------------------------------------------------------------ tiers
    @property
    def host(self) -> EmbeddingCollection:
        """The host tier's tables: a ``LocalEmbeddingCollection`` (one process) or a
        ``ShardedEmbeddingCollection`` (several ranks); checkpoints save it."""
        return self.tier.collection

    def host_tiers(self) -> list[EmbeddingCollection]:
        """The host tiers' tables (one here; a MixedHotlineCollection has one a dtype group)."""
        return [self.host]

    @property
    def plan(self) -> ShardingPlan | None:
        """The host tier's sharding plan (several ranks), else None."""
        return self.tier.plan

    @property
    def sharded(self) -> bool:
        """Several ranks: cold lookups (``gather_cold``) are collectives."""
        return self.tier.collective

    @property
    def hot_device(self) -> torch.device:
        return self.hot.device

    def update_cpu_s(self) -> float:
        """The host-update thread's CPU seconds so far (one process's tier; 0 for a
        sharded one, whose updates run in the step)."""
        return getattr(self.tier, "update_cpu_s", 0.0)

    @property
    def gather_threads(self) -> int:
        """Host threads of one cold gather (several ranks: 1, the owners' lookups)."""
        return self.tier.gather_threads

    def read_in_place(self, on: bool = True) -> None:
        """hotline.cold_path=mapped (mapped.py): the device reads the cold rows from the
        host tier's tables in place (RuntimeError saying why not); ``on`` False: the
        host gathers them again, the tables' registration undone (the run's end)."""
        if self.sharded:
            raise RuntimeError("the host tier is sharded over several processes (its cold lookups are collectives)")
        assert isinstance(self.tier, LocalHostTier)
        if on:
            self.tier.read_in_place(self.hot.device)
        else:
            self.tier.read_on_host()

    @property
    def reads_in_place(self) -> bool:
        """Whether the device reads the cold rows in place (``read_in_place``)."""
        return isinstance(self.tier, LocalHostTier) and self.tier.reads_in_place

    def on_triton(self) -> bool:
        """Whether the hot tier's lookups take the Triton kernels."""
        return self.hot.on_triton()

    @property
    def hot_ids(self) -> torch.Tensor:
        return self.hot.ids

    @property
    def hot_weight(self) -> torch.nn.Parameter:
        return self.hot.weight

    @property
    def hot_state(self) -> dict[str, torch.Tensor]:
        return self.hot.state

    def _stacked_hot_ids(self, profile: HotProfile) -> torch.Tensor:
        parts = []
        for t in self.tables:
            ids = profile.hot.get(t.name, torch.zeros(0, dtype=torch.int64)).to(torch.int64).cpu()
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= t.rows):
                raise ValueError(f"hot profile: table {t.name!r} has row ids outside [0, {t.rows})")
            if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):  # a chosen set is: no sort
                ids = torch.unique(ids)
            parts.append(ids + self.row_offsets[t.name])
        return torch.cat(parts)

    def _load_hot(self, stacked: torch.Tensor, device: torch.device) -> None:
        """Copy rows ``stacked`` (sorted) and their state from host to the device
        (several ranks: a collective, every rank reads the same rows); out of memory
        is one line naming the hot tier."""
        with naming_oom(*self._hot_bytes(stacked.numel(), device)):
            weight, state = self.tier.read_rows(stacked, device)
            self.hot.load(stacked.to(device), weight, state)
        self._hot_ids_host = stacked.cpu()
        self.hot_version += 1

    def hot_rows(self) -> dict[str, torch.Tensor]:
        """The hot set now, per table: its sorted row ids (of the table, not stacked). The
        stacked ids are sorted and the tables stacked in order: each table's are a slice
        (26 masks over bench_gpu's 500k hot ids took 48 ms of each refresh's plan)."""
        ids = self._hot_ids_host
        starts = [self.row_offsets[t.name] for t in self.tables]
        last = self.tables[-1]
        bounds = torch.tensor([*starts[1:], self.row_offsets[last.name] + last.rows], dtype=ids.dtype)
        ends = torch.searchsorted(ids, bounds).tolist()
        out, lo = {}, 0
        for t, start, hi in zip(self.tables, starts, ends, strict=True):
            out[t.name] = ids[lo:hi] - start
            lo = hi
        return out

    def hot_ids_by_group(self) -> list[torch.Tensor]:
        """The hot set: its stacked ids, sorted (one group)."""
        return [self._hot_ids_host.clone()]

    def load_hot_ids(self, ids: list[torch.Tensor]) -> None:
        """Make ``ids`` (``hot_ids_by_group``'s) the hot set, reading their rows from the
        host tier, which must hold every row (after a load: ``tables_loaded``).
        Several ranks: a collective, called by all with the same ids."""
        (stacked,) = ids
        if not torch.equal(stacked, self._hot_ids_host):
            self._load_hot(stacked.to(torch.int64), self.hot.device)

    def _hot_bytes(self, rows: int, device: torch.device) -> tuple[str, int, torch.device]:
        itemsize = max(t.itemsize for t in self.tables)
        nbytes = rows * (self.dim * itemsize + self.optimizer.state_bytes_per_row(self.dim))
        what = (f"the Hotline hot tier ({rows:,} rows x {self.dim} with "
                f"{type(self.optimizer).__name__} state; see hotline.budget)")
        return what, nbytes, device

    @torch.no_grad()
    def sync_to_host(self) -> None:
        """Write the hot rows and their optimizer state into the host tier (several
        ranks: each into the shards it owns; no communication)."""
        self.tier.write_rows(self.hot.ids, self.hot.weight.data, self.hot.state)

    def plan_refresh(self, profile: HotProfile) -> RefreshPlan:
        """The rows that stay, leave and enter to reach ``profile``'s hot set: searches of
        ids only (on the hot tier's device, on the caller's stream: the planner's), so
        another thread may build it while steps go on."""
        return plan_refresh(self._hot_ids_host, self._stacked_hot_ids(profile), profile, self.hot.device)

    def prefetch_entering(self, plan: RefreshPlan) -> None:
        """One process: read ``plan``'s entering rows on the host now (any thread);
        several ranks: nothing (their read is a collective, at the swap)."""
        if not self.sharded:
            prefetch_entering(self.tier, plan, self.hot.device)

    def refresh(self, profile: HotProfile | RefreshPlan, touched: torch.Tensor | None = None) -> None:
        """Move to a new hot set (a profile, or a plan made from the current hot set):
        only the rows that leave or enter cross between host and device; parameters
        and optimizer state are unchanged. ``touched``: stacked ids the host tier
        updated since the plan's ``prefetch_entering``."""
        if self.hot.has_kept() or self.tier.has_kept():
            raise RuntimeError("refresh between steps only: kept gradients are pending")
        plan = profile if isinstance(profile, RefreshPlan) else self.plan_refresh(profile)
        if not torch.equal(plan.old_ids, self._hot_ids_host):
            raise RuntimeError("a refresh plan made from another hot set")
        with naming_oom(*self._hot_bytes(plan.ids.numel(), self.hot.device)):
            swap(self.tier, self.hot, plan, self.optimizer.per_row_state(), touched)
        self.profile = plan.profile
        self._hot_ids_host = plan.ids
        self.hot_version += 1

    # ------------------------------------------------------------------ lookups
    def _lookups(self, sparse: KeyedJagged) -> Lookups:
        """``sparse``'s lookups in the collection's feature order, split hot/cold."""
        values, lengths, batch = in_feature_order(sparse, self.features)
        # Each lookup's bag, one op; the stacked ids are then one gather of each bag's
        # table offset (``stacked_ids`` sums lengths and expands the offsets: 4 ops).
        bag = torch.repeat_interleave(lengths, output_size=values.numel())
        ids = values + self._bag_offsets(values.device, batch).index_select(0, bag)
        is_hot, slot = self.hot.locate(ids)
        return Lookups(ids, values, lengths, batch, len(self.features), is_hot, slot, bag)

    def _bag_offsets(self, device: torch.device, batch: int) -> torch.Tensor:
        """[F*B] each bag's table offset (its feature's), made once per (device, batch):
        a mini-batch's shape repeats every step."""
        key = (device, batch)
        cached = self._bag_offsets_cache.get(key)
        if cached is None:
            cached = self._bag_offsets_cache[key] = torch.repeat_interleave(self._offsets_on(device), batch)
        return cached

    def _offsets_on(self, device: torch.device) -> torch.Tensor:
        """``feature_offsets`` on ``device``, copied once per device (ids classified on
        the host used to copy them device → host on every call: a sync)."""
        if self.feature_offsets.device == device:
            return self.feature_offsets
        cached = self._offsets_cache.get(device)
        if cached is None:
            cached = self._offsets_cache[device] = self.feature_offsets.to(device)
        return cached

    def split_on_device(self, sparse: KeyedJagged, by_popularity: bool = True,
                        host: KeyedJagged | None = None) -> DeviceSplit:
        """``sparse`` classified once where its ids are (the device, in training) and
        cut into static-size parts (split.py); nothing here waits for the device.
        ``host`` (the batch's host copy) is for collections that route by value counts
        (mixed.py); one stack needs none."""
        return split_on_device(self._lookups(sparse), self.mean, by_popularity)

    def micro_batch(self, split: DeviceSplit, sizes: Sizes, group: int) -> MicroLookups:
        """Group ``group``'s lookups (0: popular, 1: the rest) of a split whose header
        the host has read: static slices, no wait."""
        return micro_lookups(split, sizes, group)

    def _whole(self, sparse: KeyedJagged) -> MicroLookups:
        """All of ``sparse`` as one micro-batch (hot and cold lookups apart): the host
        reads the split's header here (outside the trainer's pipeline)."""
        split = self.split_on_device(sparse, by_popularity=False)
        return micro_lookups(split, Sizes.read(split.header), 0)

    def split(self, sparse: KeyedJagged) -> torch.Tensor:
        """Popular mask [B] (bool): samples whose every lookup hits a hot row."""
        return self.classify(sparse)[0]

    def classify(self, sparse: KeyedJagged) -> tuple[torch.Tensor, float]:
        """(popular mask [B], share of the lookups that hit a hot row)."""
        split = self.split_on_device(sparse)
        is_hot = split.lookups.is_hot
        return split.group == 0, float(is_hot.sum()) / max(is_hot.numel(), 1)

    def gather_cold(self, sparse: KeyedJagged | MicroLookups) -> ColdRows | ColdPooled:
        """What ``forward(sparse)`` needs from the host tier, on the device; a pipeline
        calls this ahead of ``forward``, after the previous step's update.

        One process: the unique cold rows (``ColdRows``). Several ranks: the cold
        part of every bag looked up by the sharded host tier (``ColdPooled``), a
        collective: every rank calls it once per micro-batch, an empty one too."""
        micro = sparse if isinstance(sparse, MicroLookups) else self._whole(sparse)
        return self.tier.gather_cold(micro, self.hot.device)

    # ------------------------------------------------------------------ forward
    def start(self, sparse: KeyedJagged | Prefetched | StaticLookups) -> HotStarted | torch.Tensor:
        """The hot side of a lookup, launched: it needs no host row, so the model's
        bottom MLP runs after it while the cold rows (``ColdInFlight``: still being
        gathered by the trainer's thread) arrive; ``finish`` adds them. A captured
        step's ``StaticLookups`` (cold rows staged already): the whole lookup, one launch."""
        if isinstance(sparse, StaticLookups):
            return self.static_lookup(sparse)
        micro, cold = self._micro_and_cold(sparse)
        return HotStarted(micro, cold, self.tier.hot_part(micro, self.hot))

    def finish(self, started: HotStarted | torch.Tensor) -> torch.Tensor:
        """[B, F*D] of a started lookup: its cold rows taken (waited for if in flight,
        gathered here if none came), the cold part added to the hot one."""
        if isinstance(started, torch.Tensor):  # a StaticLookups' lookup: done in ``start``
            return started
        micro, cold = started.micro, started.cold
        if isinstance(cold, ColdInFlight):
            cold = cold.result()
        elif cold is None:
            cold = self.tier.gather_cold(micro, self.hot.device)
        pooled, cold_rows = self.tier.pool(micro, self.hot, None if cold is HOT_ONLY else cold, started.hot)
        self._last = (micro.hot_slots.numel(), micro.lookups, micro.popular, micro.batch, cold_rows)
        return scale_grad(pooled, self.grad_scale)

    def static_buffers(self, split: DeviceSplit) -> StaticLookups:
        """A captured step's buffers for batches of ``split``'s shapes, the cold rows in
        the hot tier's type (that of the host rows)."""
        weight = self.hot.weight
        staged = self.stage_cold and isinstance(self.tier, LocalHostTier)
        if staged:
            self.tier.stage_state = True  # gathers bring the rows' optimizer state from now on
        return StaticLookups.like(split, weight.shape[1], weight.dtype,
                                  partial(self.hot.cold_stage, dim=weight.shape[1]) if staged else None)

    def staged_cold(self, static: StaticLookups, cold: ColdRows | None) -> ColdRows | None:
        """``cold`` ready for ``static``'s load: where its stage's last rows no longer
        stand (host rows written since its write-back: an eager step, a refresh), the
        stage forgets them and the stale rows are read again on the host, with every
        row's state if the gather did not bring it (cold_stage.py). Otherwise as it
        is: the replay's patch replaces the rows the last write-back wrote."""
        stage = static.stage
        if stage is None or cold is None:
            return cold
        assert isinstance(self.tier, LocalHostTier)
        if stage.serial != self.tier.writes:
            stage.invalidate()
            return self.tier.resolve(cold, with_state=True)
        return cold

    @property
    def static_version(self) -> object:
        """Which hot-tier tensors a captured step reads (a new one after a refresh that
        made new tensors: the step is captured again)."""
        return self.hot.storage_version

    def static_lookup(self, static: StaticLookups) -> torch.Tensor:
        """[B, F*D] of a captured step's lookups (static_step.py): its backward updates
        the hot rows and writes the cold rows' gradient; the step's end then sends
        that home (``send_static_cold``) and ``step`` leaves the hot tier alone."""
        return scale_grad(static_pooled(self.hot, static, self.mean), self.grad_scale)

    def send_static_cold(self, static: StaticLookups, cold: ColdRows | None) -> None:
        """After a static step's backward was queued: ``cold``'s U rows' gradient goes
        home (D2H, applied by the host tier's ``step``), or where they were staged
        their updated rows and state (``write_back``). Called outside any capture."""
        self._static_done = True
        stage = static.stage
        if stage is not None:  # the rows and their state as the device updated them
            assert isinstance(self.tier, LocalHostTier)
            unique = 0 if cold is None else cold.rows.shape[0]
            if unique:
                self.tier.write_back(cold.host_ids, static.cold_rows[:unique],
                                     {name: t[:unique] for name, t in stage.state.items()}, cold.ids)
                stage.serial = self.tier.writes  # its rows stand until another write
            else:  # kept no rows: an earlier write-back, maybe still running, is not covered
                stage.serial = -1
            return
        if cold is not None and cold.rows.shape[0]:
            unique = cold.rows.shape[0]
            self.tier.receive_rows(cold.host_ids, static.cold_grad[:unique])

    def forward(self, sparse: KeyedJagged | Prefetched) -> torch.Tensor:
        """[B, F*D]. A ``Prefetched`` input carries its cold rows, from
        ``gather_cold(sparse)`` (a ``ColdInFlight`` while the trainer's thread gathers
        them, or ``HOT_ONLY`` for a popular micro-batch: no host tier, no
        collective); its ``sparse`` may be a ``MicroLookups`` (the trainer's step,
        classified once per mini-batch). Otherwise the cold rows are looked up here."""
        return self.finish(self.start(sparse))

    def _micro_and_cold(self, sparse: KeyedJagged | Prefetched) -> tuple[MicroLookups, Any]:
        """``sparse``'s lookups (classified here unless they come classified) and the
        cold rows that came with them (None: none came)."""
        cold: Any = None
        if isinstance(sparse, Prefetched):
            sparse, cold = sparse.sparse, sparse.rows
        if isinstance(sparse, MicroLookups):
            return sparse, cold
        if cold is HOT_ONLY:
            return all_hot(self._lookups(sparse), self.mean), cold
        micro = self._whole(sparse)
        if isinstance(cold, ColdRows) and not torch.equal(cold.ids, micro.cold_ids):
            raise ValueError("ColdRows were gathered for another batch")
        return micro, cold

    @property
    def mean(self) -> bool:
        return self.tables[0].pooling is Pooling.MEAN

    @property
    def last_stats(self) -> dict[str, float]:
        """Hit rate, popular share and cold rows of the last forward."""
        if self._last is None:
            return {}
        hits, lookups, popular, batch, cold_rows = self._last
        return {
            "hot_hit_rate": hits / max(lookups, 1),
            "popular_share": popular / max(batch, 1),
            "cold_rows": float(cold_rows),
        }

    # ------------------------------------------------------------------ updates
    def set_lr(self, lr: float) -> None:
        self.hot.set_lr(lr)
        self.tier.set_lr(lr)

    def step(self) -> None:
        """Apply kept gradients: once per tier, even when empty (Adam counts steps).
        Several ranks: hot gradients are all-gathered first, so replicas stay equal."""
        if self.fused:
            return
        if self._static_done:  # a static step: its backward updated the hot rows already
            self._static_done = False
            self.tier.step()
            return
        if self.hot.on_triton():  # one sort, one fused backward + update for both micro-batches
            self.hot.update_held()
        else:
            self.hot.apply(self.hot.shared(self.hot.take()))
        self.tier.step()

    def kv_gradients(self) -> dict[str, KVGradient]:
        return self.tier.kv_gradients(self.hot.kept_by_stacked_id())

    # ------------------------------------------------------------------ state
    def export_tables(self) -> dict[str, torch.Tensor]:
        """The host tier's ``export_tables`` (per table, or per shard on several
        ranks), hot rows merged in."""
        self.sync_to_host()
        return self.host.export_tables()

    def import_tables(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load the host tier, then the hot rows from it (several ranks: collective)."""
        self.host.import_tables(tensors)
        self.tables_loaded()

    def table_state(self) -> TableState:
        """The host tier's tables (complete: hot rows written back first)."""
        self.sync_to_host()
        return self.host.table_state()

    def tables_loaded(self) -> None:
        """The host tier's tables were loaded in place: read the hot rows again."""
        self._load_hot(self.hot.ids.cpu(), self.hot.device)
