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

Why this equals ordinary training with the same dtypes: a bag's rows are those of one
table, so a bag is pooled (and its gradient sent back) by one group alone; each group
steps once per step, both of its tiers count the same update steps, and the
stochastic rounding is keyed by (seed, step, full table, row, column), not by stack.
Every group keeps the rounding step, its fp32 group too (as the sharded collection's
fp32 stores do beside half ones): a checkpoint holds the same state for every table.

One hot set (``HotProfile``) and one budget serve all groups: a row costs its weight in
its own table's type (``profile.row_bytes``). Several ranks: each group's host tier is
sharded by the plan's entries for its tables; the groups' collectives (cold lookups,
hot gradients' all-gather) run one group after the other, in the same order on every rank.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from embeddings.collection import EmbeddingCollection
from embeddings.hotline.lookups import HOT_ONLY, ColdPooled, ColdRows
from embeddings.hotline.tiers import HotlineEmbeddingCollection
from embeddings.interface import Prefetched, TableState
from embeddings.jagged import columns_in_order, split_features
from embeddings.optim import SparseOptimizer
from embeddings.plan.types import ShardingPlan
from embeddings.table import TableSpec

if TYPE_CHECKING:
    import torch.distributed as dist

    from data.jagged import KeyedJagged
    from embeddings.hotline.profile import HotProfile
    from embeddings.kv import KVGradient


@dataclass
class GroupCold:
    """What ``gather_cold`` gathered for each dtype group, in group order."""

    parts: list[ColdRows | ColdPooled]
    gather_s: float = 0.0
    transfer_s: float = 0.0


def hotline_collection(tables: list[TableSpec], profile: HotProfile, optimizer: SparseOptimizer,
                       **kwargs: object) -> HotlineEmbeddingCollection | MixedHotlineCollection:
    """A Hotline collection of ``tables``: one stack per tier where they share a dtype,
    else one group per dtype (``MixedHotlineCollection``); ``kwargs`` as
    ``HotlineEmbeddingCollection`` takes them."""
    if len({t.dtype for t in tables}) > 1:
        return MixedHotlineCollection(tables, profile, optimizer, **kwargs)  # type: ignore[arg-type]
    return HotlineEmbeddingCollection(tables, profile, optimizer, **kwargs)  # type: ignore[arg-type]


class MixedHotlineCollection(EmbeddingCollection):
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
    ) -> None:
        super().__init__()
        self.tables = list(tables)
        self.dim = tables[0].dim
        self.features = [f for t in tables for f in t.features]
        self.fused = fused
        self._plan = plan
        self._group = group
        self.groups = nn.ModuleList()
        for dtype in dict.fromkeys(t.dtype for t in tables):
            mine = [t for t in tables if t.dtype == dtype]
            own = copy.deepcopy(optimizer)
            own.rounding = True  # several dtypes: one is half, so every group counts its updates
            part = None if plan is None else ShardingPlan(plan.world_size, {t.name: plan.tables[t.name] for t in mine})
            self.groups.append(HotlineEmbeddingCollection(
                mine, profile, own, fused=fused, seed=seed, device=device, host=host, plan=part, group=group,
                gather_threads=gather_threads, rounding_seed=rounding_seed))
        self.optimizer = self.groups[0].optimizer

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

    @property
    def gather_threads(self) -> int:
        return self.groups[0].gather_threads

    @property
    def grad_scale(self) -> float:
        return self.groups[0].grad_scale

    @grad_scale.setter
    def grad_scale(self, scale: float) -> None:
        for g in self.groups:
            g.grad_scale = scale

    def _parts(self, sparse: KeyedJagged) -> list[KeyedJagged]:
        """Each group's bags (value counts read on the host, where Hotline classifies)."""
        return split_features(sparse, [g.features for g in self.groups])

    def classify(self, sparse: KeyedJagged) -> tuple[torch.Tensor, float]:
        """(popular mask [B]: every lookup of every group hot, share of lookups hot)."""
        popular, hits, lookups = None, 0, 0
        for g, part in zip(self.groups, self._parts(sparse), strict=True):
            found = g.lookups(part)
            popular = found.popular if popular is None else popular & found.popular
            hits += int(found.is_hot.sum())
            lookups += found.ids.numel()
        assert popular is not None
        return popular, hits / max(lookups, 1)

    def split(self, sparse: KeyedJagged) -> torch.Tensor:
        return self.classify(sparse)[0]

    def gather_cold(self, sparse: KeyedJagged) -> GroupCold:
        """Each group's cold rows (several ranks: each group's collective, in order)."""
        parts = [g.gather_cold(part) for g, part in zip(self.groups, self._parts(sparse), strict=True)]
        return GroupCold(parts, sum(p.gather_s for p in parts), sum(p.transfer_s for p in parts))

    def forward(self, sparse: KeyedJagged | Prefetched) -> torch.Tensor:
        """[B, F*D]; a ``Prefetched`` input carries ``GroupCold`` or ``HOT_ONLY``."""
        cold = None
        if isinstance(sparse, Prefetched):
            sparse, cold = sparse.sparse, sparse.rows
        pooled = []
        for i, (g, part) in enumerate(zip(self.groups, self._parts(sparse), strict=True)):
            arg: KeyedJagged | Prefetched = part
            if cold is HOT_ONLY:
                arg = Prefetched(part, HOT_ONLY)
            elif cold is not None:
                assert isinstance(cold, GroupCold)
                arg = Prefetched(part, cold.parts[i])
            pooled.append(g(arg))
        return columns_in_order(pooled, [g.features for g in self.groups], self.features, self.dim)

    # ------------------------------------------------------------------ updates
    def set_lr(self, lr: float) -> None:
        for g in self.groups:
            g.set_lr(lr)

    def step(self) -> None:
        for g in self.groups:
            g.step()

    def kv_gradients(self) -> dict[str, KVGradient]:
        return {name: grad for g in self.groups for name, grad in g.kv_gradients().items()}

    def refresh(self, profile: HotProfile) -> None:
        for g in self.groups:
            g.refresh(profile)

    def sync_to_host(self) -> None:
        for g in self.groups:
            g.sync_to_host()

    # ------------------------------------------------------------------ state
    def export_tables(self) -> dict[str, torch.Tensor]:
        return {key: t for g in self.groups for key, t in g.export_tables().items()}

    def import_tables(self, tensors: dict[str, torch.Tensor]) -> None:
        for g in self.groups:  # each takes its own tables' keys
            g.import_tables(tensors)

    def table_state(self) -> TableState:
        """The groups' host tiers as one ``TableState`` (tables in their run order)."""
        held, sharding = [], {}
        for g in self.groups:
            state = g.table_state()
            held += state.held
            sharding.update(state.sharding)
        return TableState(self.tables, held, sharding, self.optimizer, plan=self._plan, group=self._group)

    def tables_loaded(self) -> None:
        for g in self.groups:
            g.tables_loaded()
