"""TorchRec's own DLRM as a backend: a reference to compare ourselves with.

    dense [B, n_dense] ─► DenseArch (bottom MLP) ─┐
    KJT ─► sharded EmbeddingBagCollection ────────┴─► dot / DCN ─► OverArch ─► logit [B]
           (FBGEMM TBE, optimizer fused into backward)

Built from the same schema and config as our model: one ``EmbeddingBagConfig`` per
table, ``torchrec.models.dlrm.DLRM`` (dot) or ``DLRM_DCN`` (dcn), wrapped in
``DistributedModelParallel``. Embedding rows start from the same values as our
native collection for the same seed (``embeddings.init.init_rows``), written once
into the sharded tables: the collection is built on ``meta``, FBGEMM allocates the
shards (zeroed), and TorchRec's own two uniform draws over every table (the fused
kernel's ``init_parameters``, the config's ``init_fn``) are left out, as ours
overwrite them (tests/test_torchrec_init_once.py).

The sparse optimizer runs inside backward (FBGEMM's fused TBE update), so there
are no embedding gradients to see and ``sparse_step(lr)`` only sets the next lr.

TorchRec needs a process group: if none exists, a single-process gloo group is
created (world size 1, over an in-process store) and ``close()`` destroys it.
Importing this module imports torchrec and fbgemm (~2 s); nothing else in
``dlrm`` imports it at import time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbeddingBag
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import (
    KernelConfig,
    ParameterConstraints,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.types import ShardingType
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.optimizers import in_backward_optimizer_filter

from data.jagged import JaggedFeatures
from data.schema import Schema
from dlrm.checkpoint.mapped import release
from dlrm.config import ConfigError, ModelConfig, OptimConfig
from embeddings.init import init_rows

# Our sparse optimizer names → the optimizer class TorchRec maps to an FBGEMM
# EmbOptimType (torchrec/distributed/utils.py): EXACT_SGD, EXACT_ADAGRAD,
# EXACT_ROWWISE_ADAGRAD, ADAM.
_SPARSE_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "rowwise_adagrad": RowWiseAdagrad,
    "adam": torch.optim.Adam,
}

# Data-parallel tables use the "dense" kernel, which has no fused optimizer; keep
# the planner to model-parallel types with the fused kernel unless told otherwise.
_FUSED_SHARDING_TYPES = [
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
    ShardingType.ROW_WISE.value,  # planner drops it on CPU (the sharder offers it on CUDA only)
]


class TorchRecDLRM(nn.Module):
    """``DistributedModelParallel(DLRM)`` behind our model's interface.

    forward(dense [B, n_dense] float32, sparse JaggedFeatures or KJT) -> logits [B].
    """

    def __init__(
        self, dmp: DistributedModelParallel, features: list[str], tables: list[str], owns_pg: bool
    ) -> None:
        super().__init__()
        self.dmp = dmp
        self.features = features  # schema order: every KJT is put in this key order
        self.tables = tables
        self.owns_process_group = owns_pg
        self.table_shapes: dict[str, tuple[int, int]] = {}  # name → (rows, dim)

    def forward(
        self, dense: torch.Tensor, sparse: JaggedFeatures | KeyedJaggedTensor
    ) -> torch.Tensor:
        if isinstance(sparse, JaggedFeatures):  # our reader's batches: same tensors, no copy
            sparse = sparse.to_kjt()
        # The sharded collection caches the key order of the first batch it sees and
        # silently misreads a batch whose keys come in another order.
        if sparse.keys() != self.features:
            sparse = sparse.permute([sparse.keys().index(f) for f in self.features])
        return self.dmp(dense, sparse).squeeze(-1)

    def dense_parameters(self) -> list[nn.Parameter]:
        """MLP (and DCN) parameters: everything that is not a fused embedding table."""
        return [p for _, p in in_backward_optimizer_filter(self.dmp.named_parameters())]

    def sparse_step(self, lr: float) -> None:
        """Set the fused embedding optimizer's lr for the next backward.

        The update itself already happened inside backward. FBGEMM reads the lr
        when the fused optimizer's ``step()`` pushes ``param_groups[0]["lr"]`` into
        the TBE (torchrec EmbeddingFusedOptimizer.step); it updates nothing else.
        """
        opt = self.dmp.fused_optimizer
        for group in opt.param_groups:
            group["lr"] = lr  # type: ignore[index]
        opt.step()

    def begin_step(self, sparse_lr: float) -> None:
        """Trainer hook before forward: the fused update of this step uses ``sparse_lr``."""
        self.sparse_step(sparse_lr)

    def end_step(self) -> None:
        """Trainer hook after backward: nothing, the update ran inside backward."""

    @property
    def plan(self) -> None:
        """TorchRec's planner placed the tables (its own plan, not ours)."""
        return None

    def no_sync(self) -> AbstractContextManager:
        """Nothing held back: DistributedModelParallel owns its DDP, and a gradient
        all-reduced every micro-batch sums to the same result."""
        return contextlib.nullcontext()

    def state_for_checkpoint(self) -> tuple[dict[str, Any], None]:
        """Everything in state.pt: the MLPs and the whole tables (one process)."""
        return self.export_state(), None

    def restore(self, state: dict[str, Any], read_tables: Callable[[Any], None]) -> None:
        """state.pt holds the whole tables, mapped from the file (``load_state``):
        each is copied into this rank's shards and its pages given back before the
        next, so the resume holds one copy of the tables (the model's), not two."""
        self.import_state(state, mapped=True)

    def export_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """MLP tensors and full table weights (the fused optimizer state is not exported).
        A table this process holds whole on the CPU is given as a view of the live
        weights, not a copy: saving it (state.pt) then adds no second table-sized tensor
        (views of FBGEMM's one weight buffer share its storage, which torch.save writes
        once). Read it before the next step, as the checkpoint does.

        Several ranks (collective): the whole tables on rank 0 only, none elsewhere
        (rank 0 writes state.pt), a table at a time. A table one rank holds whole is
        sent by it to rank 0 (rank 0's own: a view); a table split over ranks is zero
        outside each rank's shards, and shards never overlap, so its sum-reduce to rank
        0 is the whole table. So a rank holds at most one table beside its shards (an
        all-gather of every table once put every rank's copies of all of them on every
        rank)."""
        dense = {
            k: v for k, v in self.dmp.state_dict().items() if ".embedding_bags." not in k
        }
        if dist.get_world_size() == 1:
            return {"dense": dense, "tables": {f"{name}.weight": w for name, w
                                               in self.embedding_weights(views=True).items()}}
        return {"dense": dense, "tables": tables_on_rank_0(_local_shards(self.dmp), self.table_shapes)}

    def import_state(self, state: dict[str, dict[str, torch.Tensor]], mapped: bool = False) -> None:
        """Load :meth:`export_state` output (weights only; fused optimizer state restarts).
        ``mapped``: the tables are mapped from a file nothing writes (their pages are
        given back once copied: :func:`dlrm.checkpoint.mapped.release`)."""
        missing, unexpected = self.dmp.load_state_dict(state["dense"], strict=False)
        missing = [k for k in missing if "embedding_bags." not in k]
        if missing or unexpected:
            raise KeyError(f"dense state: missing {missing[:1]}, unexpected {unexpected[:1]}")
        for name, shards in _local_shards(self.dmp).items():
            full = state["tables"][f"{name}.weight"]
            for (r, c), t in shards:
                with torch.no_grad():
                    t.copy_(full[r : r + t.shape[0], c : c + t.shape[1]])
            if mapped:  # a table at a time beside the model, not every one
                release(full)

    def embedding_weights(self, views: bool = False) -> dict[str, torch.Tensor]:
        """[rows, dim] of every table, this rank's shards filled in, zeros elsewhere
        (whole tables at world size 1): copies, or with ``views`` the live CPU weight
        itself where it is one whole shard."""
        out: dict[str, torch.Tensor] = {}
        for name, shards in _local_shards(self.dmp).items():
            whole = _whole_shard(shards, self.table_shapes[name])
            if views and whole is not None and whole.device.type == "cpu":
                out[name] = whole.detach()
                continue
            full = torch.zeros(self.table_shapes[name])
            for (r, c), t in shards:
                full[r : r + t.shape[0], c : c + t.shape[1]] = t.detach().cpu()
            out[name] = full
        return out

    def close(self) -> None:
        """Destroy the process group if :func:`build_torchrec_dlrm` created it."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_process_group = False


def build_torchrec_dlrm(
    schema: Schema,
    model_cfg: ModelConfig,
    optim_cfg: OptimConfig,
    pooling: str,
    device: torch.device,
    seed: int,
    constraints: dict[str, ParameterConstraints] | None = None,
    resume: bool = False,
) -> TorchRecDLRM:
    """TorchRec's DLRM for ``schema``, sharded by TorchRec's planner onto this process group.

    ``constraints`` (table name → ParameterConstraints) go to the planner; tables
    without one may use any model-parallel sharding with the fused kernel.
    ``resume``: a checkpoint will be loaded into it (:meth:`TorchRecDLRM.restore`
    writes every table), so the tables keep FBGEMM's zeros, not our initial values.
    The MLPs start from ``seed`` either way.
    """
    device = torch.device(device)
    if device.type == "cpu" and optim_cfg.sparse == "adam":
        raise ConfigError(
            "optim.sparse=adam: FBGEMM's CPU embedding kernel has no Adam; "
            "use sgd, adagrad or rowwise_adagrad with the torchrec backend on CPU"
        )
    owns_pg = _ensure_process_group(device)
    table_features: dict[str, list[str]] = {}
    table_rows: dict[str, int] = {}
    for f in schema.sparse:  # shared tables: the largest row count, as in dlrm.parallel.parallelize
        table_features.setdefault(f.table_name, []).append(f.name)
        table_rows[f.table_name] = max(table_rows.get(f.table_name, 0), f.rows)
    dim = model_cfg.embedding_dim
    configs = [
        EmbeddingBagConfig(
            name=name,
            embedding_dim=dim,
            num_embeddings=table_rows[name],
            feature_names=feats,
            pooling=PoolingType.SUM if pooling == "sum" else PoolingType.MEAN,
            init_fn=_values_from_init_tables,
        )
        for name, feats in table_features.items()
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _dlrm(ebc, len(schema.dense), model_cfg)
    for arch in (model.dense_arch, model.inter_arch, model.over_arch):
        arch.to(device)

    opt_cls = _SPARSE_OPTIMIZERS[optim_cfg.sparse]
    # No compensation for this backend's loss convention (each rank's loss is W x its
    # share of the global mean, for DDP's average: dlrm/parallel/ddp.py): TorchRec divides
    # pooled gradients by the world size in its all-to-all backward (comm_ops
    # gradient division), so its embeddings already see the exact gradient.
    opt_kwargs: dict[str, Any] = {"lr": optim_cfg.sparse_lr}
    if optim_cfg.sparse != "sgd":
        opt_kwargs["eps"] = optim_cfg.eps
    _apply_optimizer_in_backward(opt_cls, model.sparse_arch.parameters(), opt_kwargs)

    dmp = _shard(model, device, constraints or {}, list(table_features))
    if not resume:
        _init_tables_(dmp, configs, seed)
    model = TorchRecDLRM(dmp, schema.sparse_names, list(table_features), owns_pg)
    model.table_shapes = {c.name: (c.num_embeddings, c.embedding_dim) for c in configs}
    return model


def constraints_from_pins(pins: dict[str, str], device: torch.device) -> dict[str, ParameterConstraints]:
    """Our ``embeddings.plan`` pins (table → sharding type) as TorchRec planner constraints.

    TorchRec's fused kernels shard table-, column- and (with CUDA only) row-wise;
    its data-parallel tables use an unfused kernel, which this backend does not.
    """
    allowed = {"table_wise", "column_wise"} | ({"row_wise"} if device.type == "cuda" else set())
    out = {}
    for table, sharding in pins.items():
        if sharding not in allowed:
            raise ConfigError(
                f"embeddings.plan.{table}.sharding={sharding}: the torchrec backend shards "
                f"{', '.join(sorted(allowed))} here"
            )
        out[table] = ParameterConstraints(sharding_types=[sharding], compute_kernels=["fused"])
    return out


def _dlrm(ebc: EmbeddingBagCollection, n_dense: int, cfg: ModelConfig) -> DLRM:
    if cfg.interaction == "dcn":
        return DLRM_DCN(
            embedding_bag_collection=ebc,
            dense_in_features=n_dense,
            dense_arch_layer_sizes=list(cfg.bottom_mlp),
            over_arch_layer_sizes=list(cfg.top_mlp),
            dcn_num_layers=cfg.dcn_layers,
            # TorchRec's cross net is always low-rank; full rank = the input width.
            dcn_low_rank_dim=cfg.dcn_rank or cfg.embedding_dim,
        )
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=n_dense,
        dense_arch_layer_sizes=list(cfg.bottom_mlp),
        over_arch_layer_sizes=list(cfg.top_mlp),
    )


def _shard(
    model: nn.Module,
    device: torch.device,
    constraints: dict[str, ParameterConstraints],
    tables: list[str],
) -> DistributedModelParallel:
    """Plan with TorchRec's planner (fused kernels only) and wrap in DMP."""
    world = dist.get_world_size()
    topology = TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=world, local_world_size=_local_world(world)),
        kernel_config=KernelConfig(compute_device=device.type),
    )
    merged = {
        t: ParameterConstraints(sharding_types=_FUSED_SHARDING_TYPES, compute_kernels=["fused"])
        for t in tables
    }
    merged.update(constraints)
    planner = EmbeddingShardingPlanner(
        topology=topology,
        constraints=merged,
        storage_reservation=FixedPercentageStorageReservation(percentage=0.05),
    )
    sharders = [EmbeddingBagCollectionSharder()]
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)  # type: ignore[arg-type]
    with _without_kernel_init():
        return DistributedModelParallel(
            model,
            device=device,
            plan=plan,
            sharders=sharders,  # type: ignore[arg-type]
            init_data_parallel=world > 1,  # DDP over one rank only copies gradients
        )


def _values_from_init_tables(weight: torch.Tensor) -> None:
    """``EmbeddingBagConfig.init_fn``: writes nothing. TorchRec calls it on each table
    as the sharded collection is built (``reset_parameters``); its default drew
    uniform values over the whole table, which :func:`_init_tables_` then overwrote."""


@contextlib.contextmanager
def _without_kernel_init() -> Iterator[None]:
    """TorchRec's fused kernel (``BatchedFusedEmbeddingBag``, around FBGEMM's TBE)
    draws uniform values into every table FBGEMM allocates for it (``init_parameters``,
    called from its ``__init__`` with no switch to turn it off); :func:`_init_tables_`
    overwrites all of them. Held back while DMP builds the kernels, so each table is
    written once; restored after, also on an error."""
    kernel_init = BaseBatchedEmbeddingBag.__dict__["init_parameters"]
    BaseBatchedEmbeddingBag.init_parameters = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        BaseBatchedEmbeddingBag.init_parameters = kernel_init  # type: ignore[method-assign]


def _local_shards(dmp: nn.Module) -> dict[str, list[tuple[tuple[int, int], torch.Tensor]]]:
    """Table name → [((row, col) offset, local shard tensor)]; the tensors alias the TBE weights."""
    out: dict[str, list[tuple[tuple[int, int], torch.Tensor]]] = {}
    for key, value in dmp.state_dict().items():
        if ".embedding_bags." not in key or not key.endswith(".weight"):
            continue
        table = key.split(".")[-2]
        if hasattr(value, "local_shards"):
            shards = [
                ((s.metadata.shard_offsets[0], s.metadata.shard_offsets[1]), s.tensor)
                for s in value.local_shards()
            ]
        else:
            shards = [((0, 0), value)]
        out[table] = shards
    return out


def _init_tables_(dmp: nn.Module, configs: list[EmbeddingBagConfig], seed: int) -> None:
    """Overwrite FBGEMM's initial rows with our native collection's, shard by shard
    (``embeddings.init.init_rows``: the same values for the same seed and table)."""
    shards = _local_shards(dmp)
    for c in configs:
        for (r, col), t in shards.get(c.name, []):
            with torch.no_grad():
                init_rows(c.name, c.num_embeddings, c.embedding_dim, seed,
                          r, r + t.shape[0], col, col + t.shape[1], out=t)


def _whole_shard(held: list[tuple[tuple[int, int], torch.Tensor]], shape: tuple[int, int]) -> torch.Tensor | None:
    """The one shard ``held`` of a table when it is the whole table, else None."""
    if len(held) == 1 and held[0][0] == (0, 0) and tuple(held[0][1].shape) == tuple(shape):
        return held[0][1]
    return None


def tables_on_rank_0(shards: dict[str, list[tuple[tuple[int, int], torch.Tensor]]],
                     shapes: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Every whole table (fp32, CPU) on rank 0 from every rank's ``shards`` (table →
    [((row, col) offset, tensor)], :func:`_local_shards`), {} on the other ranks;
    collective, a table at a time (see :meth:`TorchRecDLRM.export_state`)."""
    rank = dist.get_rank()
    on = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
          else torch.device("cpu"))
    whole_here = [name for name, held in shards.items() if _whole_shard(held, shapes[name]) is not None]
    owners: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(owners, whole_here)
    owner = {name: r for r, names in enumerate(owners) for name in names}
    tables = {}
    for name, shape in shapes.items():  # the same order on every rank
        key = f"{name}.weight"
        if name in owner and owner[name] == 0:
            if rank == 0:
                tables[key] = shards[name][0][1].detach().cpu()  # a view on the CPU
        elif name in owner:
            if rank == owner[name]:
                dist.send(shards[name][0][1].detach().to(on, torch.float32).contiguous(), dst=0)
            elif rank == 0:
                got = torch.empty(shape, dtype=torch.float32, device=on)
                dist.recv(got, src=owner[name])
                tables[key] = got.cpu()
        else:
            full = torch.zeros(shape, device=on)
            for (r, c), t in shards.get(name, []):
                full[r : r + t.shape[0], c : c + t.shape[1]] = t.detach()
            dist.reduce(full, dst=0)
            if rank == 0:
                tables[key] = full.cpu()
    return tables


def _local_world(world: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def _ensure_process_group(device: torch.device) -> bool:
    """Create a world-size-1 process group if there is none; True if we created it.

    An in-process HashStore stands in for a rendezvous: no port to pick or collide on.
    """
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True
