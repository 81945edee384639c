"""From a schema and a config to the objects a run needs: tables, model, optimizers.

This is the one place that decides how the embedding collection is built;
parallel and tiered placements plug in here.
"""

from __future__ import annotations

import torch

from data.schema import Schema
from dlrm.config import Config
from dlrm.parallel.distributed import DistInfo, new_group
from dlrm.models.dlrm import DLRM
from embeddings.collection import EmbeddingCollection, LocalEmbeddingCollection
from embeddings.optim import make_sparse_optimizer
from embeddings.table import Pooling, TableSpec


def tables_from_schema(schema: Schema, dim: int, pooling: str = "sum") -> list[TableSpec]:
    """One table per distinct table name; a shared table has the largest row count."""
    features: dict[str, list[str]] = {}
    rows: dict[str, int] = {}
    for f in schema.sparse:
        features.setdefault(f.table_name, []).append(f.name)
        rows[f.table_name] = max(rows.get(f.table_name, 0), f.rows)
    return [
        TableSpec(name, rows=rows[name], dim=dim, features=tuple(feats), pooling=Pooling(pooling))
        for name, feats in features.items()
    ]


def build_model(
    cfg: Config,
    schema: Schema,
    device: torch.device | str = "cpu",
    info: DistInfo | None = None,
    hot_profile: object | None = None,
) -> torch.nn.Module:
    """The DLRM of ``cfg`` for ``schema``, initialised from ``cfg.seed``.

    Either backend has the trainer's interface: forward(dense, sparse) -> logits,
    dense_parameters(), begin_step(sparse_lr), end_step(), export/import_state().
    """
    if cfg.embeddings.backend == "torchrec":
        from dlrm.models.torchrec_dlrm import build_torchrec_dlrm, constraints_from_pins

        pins = {name: p.sharding for name, p in cfg.embeddings.plan.items()}
        return build_torchrec_dlrm(
            schema, cfg.model, cfg.optim, cfg.embeddings.pooling, torch.device(device), cfg.seed,
            constraints=constraints_from_pins(pins, torch.device(device)),
        )
    tables = tables_from_schema(schema, cfg.model.embedding_dim, cfg.embeddings.pooling)
    # Gradient accumulation keeps KV gradients until the k-th micro-batch.
    fused = cfg.embeddings.fused and cfg.train.accumulate == 1
    collection: EmbeddingCollection
    if cfg.embeddings.placement == "hotline":
        from embeddings.hotline.profile import HotProfile
        from embeddings.hotline.tiers import HotlineEmbeddingCollection

        if not isinstance(hot_profile, HotProfile):
            raise ValueError("hotline placement needs a hot profile (dlrm.train.hotline.make_profile)")
        plan = group = None
        if info is not None and info.world_size > 1:
            # Cold rows sharded over the ranks' host memory by the plan; their
            # all-to-alls run on the host, so on a gloo group of their own.
            from dlrm.parallel.planning import plan_from_config

            plan, _ = plan_from_config(cfg, schema, info.world_size)
            group = new_group(info, backend="gloo")
        # Kept (not fused) gradients: the popular and the non-popular micro-batch
        # of a mini-batch add up to one optimizer step.
        collection = HotlineEmbeddingCollection(
            tables, hot_profile, make_sparse_optimizer(cfg.optim.sparse, cfg.optim.eps),
            fused=False, seed=cfg.seed, device=device, plan=plan, group=group,
        )
    elif info is None or info.world_size == 1:
        collection = LocalEmbeddingCollection(
            tables,
            make_sparse_optimizer(cfg.optim.sparse, cfg.optim.eps),
            fused=fused,
            seed=cfg.seed,
            device=device,
        )
    else:
        from dlrm.parallel.planning import plan_from_config
        from embeddings.sharded import ShardedEmbeddingCollection

        plan, _ = plan_from_config(cfg, schema, info.world_size)
        # The embedding all-to-alls get their own process group: DDP (and its comm
        # hooks, which issue collectives from callback threads) use the default one,
        # and two threads on one gloo group can order collectives differently per rank.
        group = new_group(info)
        collection = ShardedEmbeddingCollection(
            tables,
            plan,
            lambda: make_sparse_optimizer(cfg.optim.sparse, cfg.optim.eps),
            fused=fused,
            seed=cfg.seed,
            group=group,
            device=device,
        )
    torch.manual_seed(cfg.seed)
    model = DLRM(len(schema.dense), collection, cfg.model).to(device)
    if info is not None:
        from dlrm.parallel.ddp import parallelize

        parallelize(model, info, cfg)
    return model


def build_dense_optimizer(cfg: Config, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    lr = cfg.optim.dense_lr
    if cfg.optim.dense == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if cfg.optim.dense == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, eps=cfg.optim.eps)
    return torch.optim.Adam(params, lr=lr, eps=cfg.optim.eps)


def lr_factor(cfg: Config, step: int) -> float:
    """Linear warm-up over ``warmup_steps``, then linear decay to 0 over ``decay_steps``."""
    o = cfg.optim
    factor = 1.0
    if o.warmup_steps > 0 and step < o.warmup_steps:
        factor = (step + 1) / o.warmup_steps
    if o.decay_steps > 0 and step >= o.decay_start:
        factor *= max(0.0, 1.0 - (step - o.decay_start) / o.decay_steps)
    return factor
