"""The one place that turns a config into this rank's model: a plain DLRM, given the
embedding collection of its placement, with its MLPs under DDP when there are ranks.

    build_model(cfg, schema, device, info)
      ├─ embeddings.backend=torchrec ─► TorchRecDLRM (DistributedModelParallel does it all)
      └─ native:
         embeddings    one process ............ LocalEmbeddingCollection (tables of several
                                                dtypes: DtypeStacks, one stack per dtype)
                       several ranks .......... ShardedEmbeddingCollection, by the plan
                       placement=hotline ...... HotlineEmbeddingCollection: hot rows here,
                                                cold rows on the host (sharded by the plan
                                                over the ranks' host memory)
         DLRM(num_dense, embeddings)            plain PyTorch: knows no ranks
         apply_ddp     several ranks .......... DDP around the dense arch (dlrm/parallel/ddp.py)

Each collection is built from the same tables (``planning.tables_from_schema``) and
initial values (``cfg.seed``), so every placement starts from the same model.
"""

from __future__ import annotations

from types import ModuleType

import torch

from data.errors import one_line
from data.schema import Schema
from dlrm.config import Config, ConfigError
from dlrm.models.dlrm import DLRM
from dlrm.models.interface import RecModel
from dlrm.parallel.ddp import apply_ddp, averaging
from dlrm.parallel.distributed import DistInfo, new_group
from dlrm.parallel.planning import plan_from_config, run_tables
from embeddings.collection import LocalEmbeddingCollection
from embeddings.dtype_stacks import DtypeStacks
from embeddings.hotline.profile import HotProfile
from embeddings.interface import PooledEmbeddings
from embeddings.optim import SparseOptimizer, make_sparse_optimizer
from embeddings.sharded import ShardedEmbeddingCollection


def build_model(
    cfg: Config,
    schema: Schema,
    device: torch.device | str = "cpu",
    info: DistInfo | None = None,
    hot_profile: HotProfile | None = None,
    resume: bool = False,
) -> RecModel:
    """The model of ``cfg`` for ``schema`` on this rank, initialised from ``cfg.seed``
    (``hot_profile``: Hotline's hot rows, from ``dlrm.train.hotline.make_profile``).

    ``resume``: a checkpoint will be loaded into it, so our embedding tables are left
    uninitialised (``torch.empty``: the random init of a 6.6 GB model takes about 25 s
    on this project's machine). The MLPs still start from ``cfg.seed``, so the global
    RNG is where it would be; the checkpoint then restores it."""
    device = torch.device(device)
    seed = None if resume else cfg.seed
    if cfg.embeddings.backend == "torchrec":
        torchrec_dlrm = torchrec_backend()
        pins = {name: p.sharding for name, p in cfg.embeddings.plan.items()}
        return torchrec_dlrm.build_torchrec_dlrm(
            schema, cfg.model, cfg.optim, cfg.embeddings.pooling, device, cfg.seed,
            constraints=torchrec_dlrm.constraints_from_pins(pins, device), resume=resume,
        )
    world = info.world_size if info is not None else 1
    if cfg.embeddings.backend == "torch_baseline":
        return torch_baseline_model(cfg, schema, device, world)
    embeddings: PooledEmbeddings
    if cfg.embeddings.placement == "hotline":
        embeddings = hotline_embeddings(cfg, schema, device, info, hot_profile, seed)
    elif world == 1 and len({t.dtype for t in run_tables(cfg, schema)}) == 1:
        embeddings = local_embeddings(cfg, schema, device, seed)
    elif world == 1:
        embeddings = mixed_local_embeddings(cfg, schema, device, seed)
    else:
        assert info is not None
        embeddings = sharded_embeddings(cfg, schema, device, info, seed)
    torch.manual_seed(cfg.seed)
    model = DLRM(len(schema.dense), embeddings, cfg.model).to(device)
    if info is not None and world > 1:
        apply_ddp(model, info, cfg)
    return model


def torch_baseline_model(cfg: Config, schema: Schema, device: torch.device, world: int) -> RecModel:
    """Stock PyTorch: nn.EmbeddingBag tables and torch.optim (one process, HBM or host)."""
    from dlrm.models.torch_baseline import TorchBaselineDLRM

    if world > 1 or cfg.embeddings.placement == "hotline":
        raise ConfigError("embeddings.backend=torch_baseline runs on one rank with "
                          "embeddings.placement=sharded (it is plain PyTorch, not a sharded engine)")
    return TorchBaselineDLRM(len(schema.dense), run_tables(cfg, schema), cfg.model, cfg.optim,
                             cfg.seed, device)


def torchrec_backend() -> ModuleType:
    """``dlrm.models.torchrec_dlrm``, the one module that imports torchrec (and through
    it fbgemm_gpu); a ``ConfigError`` (one line) where they do not import. Nothing else
    needs them: the native engine runs on plain torch."""
    try:
        from dlrm.models import torchrec_dlrm
    except (ImportError, OSError) as e:  # OSError: an fbgemm library built for another torch
        ours = ("data", "dlrm", "embeddings")
        if isinstance(e, ImportError) and (e.name or "").split(".")[0] in ours:
            raise  # a bug of ours, not a missing package
        raise ConfigError(
            f"embeddings.backend=torchrec needs torchrec and fbgemm_gpu, which do not import "
            f"here ({one_line(e)}): install them (scripts/setup.sh) or use "
            f"embeddings.backend=native"
        ) from None
    return torchrec_dlrm


def sparse_optimizer(cfg: Config) -> SparseOptimizer:
    return make_sparse_optimizer(cfg.optim.sparse, cfg.optim.eps, cfg.embeddings.state_dtype)


def fused(cfg: Config) -> bool:
    """Sparse updates inside backward; gradient accumulation keeps KV gradients
    until the k-th micro-batch instead."""
    return cfg.embeddings.fused and cfg.train.accumulate == 1


def pooled_grad_scale(cfg: Config, info: DistInfo) -> float:
    """1/W where DDP averages the dense side, so the embedding side averages too
    (see dlrm/parallel/ddp.py); 1 where both sum."""
    return 1.0 / info.world_size if averaging(cfg) else 1.0


def local_embeddings(cfg: Config, schema: Schema, device: torch.device, seed: int | None) -> LocalEmbeddingCollection:
    """Every table in this process, stacked in one weight (``seed=None``: left empty)."""
    return LocalEmbeddingCollection(
        run_tables(cfg, schema), sparse_optimizer(cfg), fused=fused(cfg), seed=seed, device=device,
        rounding_seed=cfg.seed, kernels=cfg.embeddings.kernels,
    )


def mixed_local_embeddings(cfg: Config, schema: Schema, device: torch.device, seed: int | None) -> DtypeStacks:
    """One process, tables of several ``embeddings.dtypes``: one stack per dtype, the
    batch routed on the device (embeddings/dtype_stacks.py), each table saved in its type."""
    return DtypeStacks(run_tables(cfg, schema), lambda: sparse_optimizer(cfg), fused=fused(cfg), seed=seed,
                       device=device, rounding_seed=cfg.seed, kernels=cfg.embeddings.kernels)


def sharded_embeddings(
    cfg: Config, schema: Schema, device: torch.device, info: DistInfo, seed: int | None
) -> ShardedEmbeddingCollection:
    """The tables sharded over the ranks by the plan of the config."""
    plan, _ = plan_from_config(cfg, schema, info.world_size)
    # The embedding all-to-alls get their own process group: DDP (and its comm
    # hooks, which issue collectives from callback threads) use the default one,
    # and two threads on one gloo group can order collectives differently per rank.
    collection = ShardedEmbeddingCollection(
        run_tables(cfg, schema), plan, lambda: sparse_optimizer(cfg), fused=fused(cfg),
        seed=seed, group=new_group(info), device=device, rounding_seed=cfg.seed, kernels=cfg.embeddings.kernels,
    )
    collection.grad_scale = pooled_grad_scale(cfg, info)
    return collection


def hotline_embeddings(
    cfg: Config,
    schema: Schema,
    device: torch.device,
    info: DistInfo | None,
    hot_profile: HotProfile | None,
    seed: int | None,
) -> PooledEmbeddings:
    """Hot rows on ``device``, the rest in host memory (several ranks: the cold rows
    sharded over the ranks' host memory by the plan, reached on a gloo group of their
    own, since their all-to-alls run on the host; the hot rows' replicas all-gather
    their gradients on a group of the run's backend: NCCL on GPUs, no host trip)."""
    from embeddings.hotline.mixed import hotline_collection

    if hot_profile is None:
        raise ValueError("hotline placement needs a hot profile (dlrm.train.hotline.make_profile)")
    plan = group = hot_group = None
    if info is not None and info.world_size > 1:
        plan, _ = plan_from_config(cfg, schema, info.world_size)
        group = new_group(info, backend="gloo")
        hot_group = new_group(info)
    # Kept (not fused) gradients: the popular and the non-popular micro-batch of a
    # mini-batch add up to one optimizer step.
    collection = hotline_collection(
        run_tables(cfg, schema), hot_profile, sparse_optimizer(cfg), fused=False, seed=seed,
        device=device, plan=plan, group=group, gather_threads=cfg.hotline.gather_threads, rounding_seed=cfg.seed,
        kernels=cfg.embeddings.kernels, hot_group=hot_group, stage_cold=cfg.hotline.cold_update == "device",
    )
    if info is not None and info.world_size > 1:
        collection.grad_scale = pooled_grad_scale(cfg, info)
    return collection
