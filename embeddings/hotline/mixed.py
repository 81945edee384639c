"""Hotline with tables of several dtypes (``embeddings.dtypes``): one Hotline
collection per dtype, each with its own hot tier and host tier in that type.

A stack holds one type (a tensor has one dtype), and both tiers are stacks: the hot
rows [H, D] and the host tier's stacked weight (or, on several ranks, its stores).
So the tables are grouped by dtype and each group is an ordinary
``HotlineEmbeddingCollection``; this collection routes each feature's bags to its
table's group and puts the pooled vectors back in feature order:

    sparse ─features of fp32 tables──► Hotline(fp32 tables) ──► [B, F32, D] ─┐
           ─features of bf16 tables──► Hotline(bf16 tables) ──► [B, Fbf, D] ─┼─ columns in
           ─features of fp16 tables──► Hotline(fp16 tables) ──► [B, Ffp, D] ─┘  feature order
                                                                             ► [B, F*D]

The trainer's step (dlrm/train/hotline.py) splits the mini-batch once on the device
into a popular and a non-popular micro-batch. Here the split is joint
(``split_jointly``): a sample is popular only if every lookup of it, in every group,
is hot; each group's lookups are then cut by that one mask, and the groups' headers
travel as one (the host's one read per step). Each group's lookups are a static slice
of the batch's values: their counts come from the batch's host copy (``host``), so
routing waits for nothing on the device.

Why this equals ordinary training with the same dtypes: a bag's rows are those of one
table, so a bag is pooled (and its gradient sent back) by one group alone; each group
steps once per step, both of its tiers count the same update steps, and the
stochastic rounding is keyed by (seed, step, full table, row, column), not by stack.
Every group keeps the rounding step, its fp32 group too (as the sharded collection's
fp32 stores do beside half ones): a checkpoint holds the same state for every table.
Each group's hot tier takes the Triton kernels where one fp32 collection's would (one
process, ``kernels``): the fused update counts the rounding step on the device.

One hot set (``HotProfile``) and one budget serve all groups: a row costs its weight in
its own table's type (``profile.row_bytes``). Several ranks: each group's host tier is
sharded by the plan's entries for its tables; the groups' collectives (cold lookups,
hot gradients' all-gather, refresh reads) run one group after the other, in the same
order on every rank.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from embeddings.collection import EmbeddingCollection
from embeddings.dtype_stacks import PerDtype
from embeddings.hotline.lookups import HOT_ONLY, ColdInFlight, ColdRows
from embeddings.hotline.refresh import RefreshPlan
from embeddings.hotline.split import JointSizes, JointSplit, MicroLookups, split_jointly
from embeddings.hotline.static_step import MixedStatic
from embeddings.hotline.tiers import HotlineEmbeddingCollection, HotStarted
from embeddings.interface import Prefetched, TableState
from embeddings.optim import SparseOptimizer
from embeddings.plan.types import ShardingPlan
from embeddings.table import TableSpec

if TYPE_CHECKING:
    import torch.distributed as dist

    from data.jagged import KeyedJagged
    from embeddings.hotline.lookups import ColdPooled
    from embeddings.hotline.profile import HotProfile


@dataclass
class GroupCold:
    """What ``gather_cold`` gathered for each dtype group, in group order."""

    parts: list[ColdRows | ColdPooled]
    bases: list[int]  # each group's first row in the collection's numbering (``host_ids``)
    gather_s: float = 0.0
    transfer_s: float = 0.0

    @property
    def late_rows(self) -> int:
        """Rows read after the previous step's host update (every group's)."""
        return sum(getattr(p, "late_rows", 0) for p in self.parts)

    @property
    def ids_wait_s(self) -> float:
        return sum(getattr(p, "ids_wait_s", 0.0) for p in self.parts)

    @property
    def update_wait_s(self) -> float:
        return sum(getattr(p, "update_wait_s", 0.0) for p in self.parts)

    @property
    def host_ids(self) -> torch.Tensor | None:
        """One process: the gathered rows' ids, each group's stacked ids shifted by its
        base (the rows this step's cold update writes); several ranks: None."""
        if not all(isinstance(p, ColdRows) for p in self.parts):
            return None
        return torch.cat([p.host_ids + base for p, base in zip(self.parts, self.bases, strict=True)])


class MixedMicro:
    """One micro-batch of every group (``MicroLookups`` each, in group order)."""

    def __init__(self, parts: list[MicroLookups]) -> None:
        self.parts = parts

    @property
    def ready(self) -> torch.cuda.Event | None:
        return self.parts[0].ready

    @ready.setter
    def ready(self, event: torch.cuda.Event | None) -> None:
        for part in self.parts:
            part.ready = event

    @property
    def whole(self) -> bool:
        """Every sample of the mini-batch, in its own order (one pass)."""
        return self.parts[0].whole


@dataclass
class MixedRefreshPlan:
    """Each group's ``RefreshPlan`` to one new hot set (``profile``)."""

    profile: HotProfile
    parts: list[RefreshPlan]

    @property
    def moved_rows(self) -> int:
        return sum(p.moved_rows for p in self.parts)


def hotline_collection(tables: list[TableSpec], profile: HotProfile, optimizer: SparseOptimizer,
                       **kwargs: object) -> HotlineEmbeddingCollection | MixedHotlineCollection:
    """A Hotline collection of ``tables``: one stack per tier where they share a dtype,
    else one group per dtype (``MixedHotlineCollection``); ``kwargs`` as
    ``HotlineEmbeddingCollection`` takes them."""
    if len({t.dtype for t in tables}) > 1:
        return MixedHotlineCollection(tables, profile, optimizer, **kwargs)  # type: ignore[arg-type]
    return HotlineEmbeddingCollection(tables, profile, optimizer, **kwargs)  # type: ignore[arg-type]


class MixedHotlineCollection(PerDtype):
    """``HotlineEmbeddingCollection``'s interface over tables of several dtypes: a
    Hotline collection per dtype (``groups``, in the order the dtypes first appear)."""

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
        gather_threads: int = 0,
        rounding_seed: int | None = None,
        kernels: str = "auto",
        hot_group: dist.ProcessGroup | None = None,
        stage_cold: bool = True,
    ) -> None:
        super().__init__()
        self.tables = list(tables)
        self.dim = tables[0].dim
        self.features = [f for t in tables for f in t.features]
        self.fused = fused
        self._plan = plan
        self._group = group
        self.groups = nn.ModuleList()
        self.bases: list[int] = []  # each group's first row, groups' rows one after the other
        rows = 0
        for dtype in dict.fromkeys(t.dtype for t in tables):
            mine = [t for t in tables if t.dtype == dtype]
            own = copy.deepcopy(optimizer)
            own.rounding = True  # several dtypes: one is half, so every group counts its updates
            part = None if plan is None else ShardingPlan(plan.world_size, {t.name: plan.tables[t.name] for t in mine})
            self.groups.append(HotlineEmbeddingCollection(
                mine, profile, own, fused=fused, seed=seed, device=device, host=host, plan=part, group=group,
                gather_threads=gather_threads, rounding_seed=rounding_seed, kernels=kernels,
                hot_group=hot_group, stage_cold=stage_cold))
            self.bases.append(rows)
            rows += sum(t.rows for t in mine)
        self.optimizer = self.groups[0].optimizer
        self._order_columns(device)
        self.refresh_state: dict[str, Any] | None = None  # see embeddings/interface.py HotSetHolder

    def parts(self) -> list[EmbeddingCollection]:
        return list(self.groups)

    def host_tiers(self) -> list[EmbeddingCollection]:
        return [host for g in self.groups for host in g.host_tiers()]

    def hot_rows(self) -> dict[str, torch.Tensor]:
        """The hot set now, per table: its sorted row ids (every group's tables)."""
        return {name: rows for g in self.groups for name, rows in g.hot_rows().items()}

    def hot_ids_by_group(self) -> list[torch.Tensor]:
        """Each group's hot set (stacked ids in the group's own stacking, sorted)."""
        return [ids for g in self.groups for ids in g.hot_ids_by_group()]

    def load_hot_ids(self, ids: list[torch.Tensor]) -> None:
        """Each group's hot set from ``hot_ids_by_group``'s list."""
        for g, own in zip(self.groups, ids, strict=True):
            g.load_hot_ids([own])

    # ------------------------------------------------------------------ what the trainer asks
    @property
    def plan(self) -> ShardingPlan | None:  # type: ignore[override]
        """The host tiers' plan, every table (several ranks), else None."""
        return self._plan

    @property
    def sharded(self) -> bool:
        return self.groups[0].sharded

    @property
    def hot_device(self) -> torch.device:
        return self.groups[0].hot_device

    def update_cpu_s(self) -> float:
        return sum(g.update_cpu_s() for g in self.groups)

    @property
    def gather_threads(self) -> int:
        return self.groups[0].gather_threads

    def read_in_place(self, on: bool = True) -> None:
        """Each group's ``read_in_place`` (tiers.py); where one group's fails, those
        before it read on the host again (registration undone), so every group gathers
        the one way the run says, and the error is raised."""
        try:
            for g in self.groups:
                g.read_in_place(on)
        except Exception:
            if on:
                for g in self.groups:
                    g.read_in_place(False)
            raise

    @property
    def reads_in_place(self) -> bool:
        return all(g.reads_in_place for g in self.groups)

    def on_triton(self) -> bool:
        return all(g.on_triton() for g in self.groups)

    @property
    def hot_version(self) -> tuple[int, ...]:
        """Every group's hot-tier version: a joint split is stale if any changed."""
        return tuple(g.hot_version for g in self.groups)

    @property
    def grad_scale(self) -> float:
        return self.groups[0].grad_scale

    @grad_scale.setter
    def grad_scale(self, scale: float) -> None:
        for g in self.groups:
            g.grad_scale = scale

    @property
    def mean(self) -> bool:
        return self.groups[0].mean

    # ------------------------------------------------------------------ routing
    def _parts(self, sparse: KeyedJagged, host: KeyedJagged | None = None) -> list[KeyedJagged]:
        """Each group's bags: static slices of ``sparse``'s values and lengths on its
        device (a feature's ids are one run of the values), put together per group.
        The runs' lengths come from ``host``, the same batch in host memory (the
        trainer's copy: no device sync); without it from ``sparse`` (on CUDA a sync:
        for callers outside the trainer's step)."""
        from data.jagged import JaggedFeatures

        host = sparse if host is None else host
        keys, batch = host.keys(), host.stride()
        per_feature = host.lengths().cpu().numpy().reshape(len(keys), batch).sum(axis=1).tolist()
        starts = [0]
        for n in per_feature:
            starts.append(starts[-1] + n)
        place = {f: i for i, f in enumerate(keys)}
        values, lengths = sparse.values(), sparse.lengths()
        parts = []
        for g in self.groups:
            at = [place[f] for f in g.features]
            ids = torch.cat([values[starts[i]:starts[i + 1]] for i in at])
            bags = torch.cat([lengths[i * batch:(i + 1) * batch] for i in at])
            parts.append(JaggedFeatures(list(g.features), ids, bags, batch))
        return parts

    def split_on_device(self, sparse: KeyedJagged, by_popularity: bool = True,
                        host: KeyedJagged | None = None) -> JointSplit:
        """``sparse`` classified once, jointly: popular only where every lookup of every
        group is hot (split.py ``split_jointly``); ``host`` as ``_parts`` takes it."""
        parts = [g._lookups(p) for g, p in zip(self.groups, self._parts(sparse, host), strict=True)]
        return split_jointly(parts, self.mean, by_popularity)

    def micro_batch(self, split: JointSplit, sizes: JointSizes, group: int) -> MixedMicro:
        """Micro-batch ``group`` (0: popular, 1: the rest) of every dtype group."""
        return MixedMicro([g.micro_batch(s, z, group) for g, s, z in
                           zip(self.groups, split.parts, sizes.parts, strict=True)])

    def _whole(self, sparse: KeyedJagged) -> MixedMicro:
        split = self.split_on_device(sparse, by_popularity=False)
        return self.micro_batch(split, split.read_sizes(split.header), 0)

    def classify(self, sparse: KeyedJagged) -> tuple[torch.Tensor, float]:
        """(popular mask [B]: every lookup of every group hot, share of lookups hot)."""
        split = self.split_on_device(sparse)
        hits = sum(float(p.lookups.is_hot.sum()) for p in split.parts)
        lookups = sum(p.lookups.is_hot.numel() for p in split.parts)
        return split.parts[0].group == 0, hits / max(lookups, 1)

    def split(self, sparse: KeyedJagged) -> torch.Tensor:
        return self.classify(sparse)[0]

    def gather_cold(self, sparse: KeyedJagged | MixedMicro) -> GroupCold:
        """Each group's cold rows (several ranks: each group's collective, in order)."""
        micro = sparse if isinstance(sparse, MixedMicro) else self._whole(sparse)
        parts = [g.gather_cold(p) for g, p in zip(self.groups, micro.parts, strict=True)]
        return GroupCold(parts, self.bases, sum(p.gather_s for p in parts), sum(p.transfer_s for p in parts))

    def start(self, sparse: KeyedJagged | MixedMicro | Prefetched | MixedStatic
              ) -> list[HotStarted] | list[torch.Tensor]:
        """Each group's lookup begun (its hot side launched; tiers.py ``start``), in
        group order; a ``Prefetched`` input carries ``GroupCold`` (or a ``ColdInFlight``
        of one, still being gathered) or ``HOT_ONLY``, its ``sparse`` a ``MixedMicro``
        (the trainer's) or a batch. A captured step's ``MixedStatic``: each group's
        whole lookup, one launch each."""
        if isinstance(sparse, MixedStatic):
            return [g.static_lookup(p) for g, p in zip(self.groups, sparse.parts, strict=True)]
        cold = None
        if isinstance(sparse, Prefetched):
            sparse, cold = sparse.sparse, sparse.rows
        parts = sparse.parts if isinstance(sparse, MixedMicro) else self._parts(sparse)
        if isinstance(sparse, MixedMicro) and cold is None:
            cold = self.gather_cold(sparse)
        started = []
        for i, (g, part) in enumerate(zip(self.groups, parts, strict=True)):
            arg: KeyedJagged | MicroLookups | Prefetched = part
            if cold is HOT_ONLY:
                arg = Prefetched(part, HOT_ONLY)
            elif isinstance(cold, ColdInFlight):
                arg = Prefetched(part, cold.part(i))
            elif cold is not None:
                assert isinstance(cold, GroupCold)
                arg = Prefetched(part, cold.parts[i])
            started.append(g.start(arg))
        return started

    def finish(self, started: list[HotStarted] | list[torch.Tensor]) -> torch.Tensor:
        """[B, F*D]: each group's lookup finished, the columns in feature order."""
        return self.columns_in_feature_order([g.finish(s) for g, s in zip(self.groups, started, strict=True)])

    def forward(self, sparse: KeyedJagged | MixedMicro | Prefetched | MixedStatic) -> torch.Tensor:
        """[B, F*D] (``start`` then ``finish``)."""
        return self.finish(self.start(sparse))

    # ------------------------------------------------------------------ static step
    def static_buffers(self, split: JointSplit) -> MixedStatic:
        """A captured step's buffers (hotline_graph.py): each group's, for its part of
        ``split``, its cold rows in its type."""
        return MixedStatic([g.static_buffers(s) for g, s in zip(self.groups, split.parts, strict=True)],
                           [list(g.features) for g in self.groups])

    @property
    def static_version(self) -> object:
        """Every group's hot-tier tensors (tiers.py ``static_version``)."""
        return tuple(g.static_version for g in self.groups)

    def staged_cold(self, static: MixedStatic, cold: GroupCold | None) -> GroupCold | None:
        """Each group's cold rows ready for its buffers' load (tiers.py ``staged_cold``)."""
        if cold is not None:
            cold.parts = [g.staged_cold(part, rows)  # type: ignore[arg-type]  # one process: ColdRows
                          for g, part, rows in zip(self.groups, static.parts, cold.parts, strict=True)]
        return cold

    def send_static_cold(self, static: MixedStatic, cold: GroupCold | None) -> None:
        """Each group's cold rows' gradient home (tiers.py ``send_static_cold``)."""
        for i, (g, part) in enumerate(zip(self.groups, static.parts, strict=True)):
            rows = None if cold is None else cold.parts[i]
            assert rows is None or isinstance(rows, ColdRows)  # one process
            g.send_static_cold(part, rows)

    # ------------------------------------------------------------------ refresh
    def plan_refresh(self, profile: HotProfile) -> MixedRefreshPlan:
        """Each group's plan to ``profile``'s hot set (host arithmetic: any thread)."""
        return MixedRefreshPlan(profile, [g.plan_refresh(profile) for g in self.groups])

    def prefetch_entering(self, plan: MixedRefreshPlan) -> None:
        for g, part in zip(self.groups, plan.parts, strict=True):
            g.prefetch_entering(part)

    def refresh(self, profile: HotProfile | MixedRefreshPlan, touched: torch.Tensor | None = None) -> None:
        """Every group to the new hot set; ``touched`` in this collection's numbering
        (``GroupCold.host_ids``), each group given its own rows of it."""
        plans = profile.parts if isinstance(profile, MixedRefreshPlan) else [profile] * len(self.groups)
        ends = [*self.bases[1:], None]
        for g, plan, base, end in zip(self.groups, plans, self.bases, ends, strict=True):
            mine = None
            if touched is not None:
                inside = (touched >= base) if end is None else (touched >= base) & (touched < end)
                mine = touched[inside] - base
            g.refresh(plan, mine)

    def sync_to_host(self) -> None:
        for g in self.groups:
            g.sync_to_host()

    # ------------------------------------------------------------------ state
    def table_state(self) -> TableState:
        """The groups' host tiers as one ``TableState`` (tables in their run order)."""
        return TableState(self.tables, *self._held(), self.optimizer, plan=self._plan, group=self._group)

    def tables_loaded(self) -> None:
        for g in self.groups:
            g.tables_loaded()
