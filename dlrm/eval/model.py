"""The model that scores a checkpoint, whatever placement trained it.

    trained as                     scored as (one process, or each rank under torchrun)
    native, sharded (any strategy, one process: LocalEmbeddingCollection; W ranks:
      any world size)                sharded by the config's plan for W
    native, hotline (1 or W ranks) the same, when its tables fit on the eval device;
                                     else every row in host memory: a Hotline
                                     collection with no hot rows (a CPU eval always
                                     takes the first way: the host is the device)
    torchrec                       TorchRec's DLRM again (its tables are whole in state.pt)

Every native checkpoint holds the same thing: each table as one logical tensor of
its full shape (dlrm/checkpoint/tables.py), which loads into any collection of any
world size. A Hotline checkpoint is its host tier's (hot rows written back first),
so Hotline's hot set is a training-time choice that does not change a score, and
evaluation needs no profile.

Kernels: a run of ``embeddings.kernels=triton`` is scored on the torch kernels where
Triton cannot run (no GPU, no triton package), with a note: the same scores, slower.

Memory: a Hotline run's host tier is exactly this plain collection (one process:
``LocalEmbeddingCollection``; W ranks: ``ShardedEmbeddingCollection`` by the same
plan), so scoring on the host takes what training's host tier took (weights and
optimizer state: the checkpoint's keys are all loaded, checked against the
collection's). On a GPU the whole tables would have to fit in device memory, which
is what Hotline avoids; where they do not (free memory, every rank agreeing), they
stay in host memory and only pooled vectors go to the device.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import torch

from data.schema import Schema
from dlrm.config import Config
from dlrm.models.interface import RecModel
from dlrm.parallel.distributed import DistInfo, all_reduce_sum
from dlrm.parallel.parallelize import build_model, sparse_optimizer
from dlrm.parallel.planning import plan_from_config, run_tables
from embeddings.hotline.profile import HotProfile
from embeddings.kernels import triton_available, why_not_triton
from embeddings.plan.estimate import plan_memory
from embeddings.plan.types import PlanError

DEVICE_SHARE = 0.8  # of the free device memory the tables may take (the rest: activations)


def eval_model(
    cfg: Config, schema: Schema, info: DistInfo, say: Callable[[str], None] | None = None
) -> RecModel:
    """This rank's model of ``cfg`` for scoring (see the module docstring), not yet
    loaded: ``load_checkpoint`` fills it, so its tables skip the random init
    (``resume=True``). ``say``: where the choice of host memory is
    told (default stderr: stdout holds the metrics' JSON)."""
    cfg = runnable_kernels(cfg, info, say or _stderr)
    cfg = pins_that_fit(cfg, schema, info, say or _stderr)
    if cfg.embeddings.backend == "torchrec" or cfg.embeddings.placement != "hotline":
        return build_model(cfg, schema, info.device, info, resume=True)
    plain = dataclasses.replace(cfg, embeddings=dataclasses.replace(cfg.embeddings, placement="sharded"))
    if tables_fit(plain, schema, info):
        return build_model(plain, schema, info.device, info, resume=True)
    if info.is_main:
        (say or _stderr)(f"eval: the tables do not fit on {info.device}; they stay in host memory")
    return build_model(cfg, schema, info.device, info, no_hot_rows(cfg, schema), resume=True)


def runnable_kernels(cfg: Config, info: DistInfo, say: Callable[[str], None]) -> Config:
    """``cfg``, on the torch kernels where its ``embeddings.kernels=triton`` cannot run on
    this device (a run trained on a GPU, scored on a machine without one): the kernel
    choice changes the speed, not the scores (tests/test_eval_kernels.py), so scoring
    goes on where training would refuse (dlrm/train/trainer.py)."""
    if why_not_triton(cfg.embeddings.kernels, info.device) is None:
        return cfg
    if info.is_main:
        why = "not a GPU" if triton_available() else "no triton package"
        say(f"note: the run's embeddings.kernels=triton cannot run here ({info.device}: {why}); "
            "evaluating with the torch kernels (the same scores)")
    return dataclasses.replace(cfg, embeddings=dataclasses.replace(cfg.embeddings, kernels="torch"))


def pins_that_fit(cfg: Config, schema: Schema, info: DistInfo, say: Callable[[str], None]) -> Config:
    """``cfg``, without its ``embeddings.plan`` pins where they do not fit this world size
    (a run trained at 3 ranks with a table pinned to rank 2, scored at 2): the checkpoint
    loads into any placement, so the planner places the tables instead. Before
    (2026-12-07), such an eval stopped with the plan's error and no way round it."""
    if not cfg.embeddings.plan or cfg.embeddings.backend == "torchrec" or info.world_size == 1:
        return cfg
    try:
        plan_from_config(cfg, schema, info.world_size)
    except PlanError as e:
        if info.is_main:
            say(f"note: the run's embeddings.plan does not fit {info.world_size} ranks ({e}); "
                "scoring with the planner's own placement (the checkpoint loads into any)")
        return dataclasses.replace(cfg, embeddings=dataclasses.replace(cfg.embeddings, plan={}))
    return cfg


def tables_fit(cfg: Config, schema: Schema, info: DistInfo) -> bool:
    """Whether this rank's share of the tables (weights and optimizer state, as the
    plan of ``cfg`` for this world size places them) fits in DEVICE_SHARE of the free
    memory of every rank's device; the host always answers yes."""
    if info.device.type != "cuda":
        return True
    need = table_bytes(cfg, schema, info.world_size)[info.rank]
    free, _ = torch.cuda.mem_get_info(info.device)
    fits = float(need <= DEVICE_SHARE * free)
    return all_reduce_sum([fits], info)[0] == info.world_size


def table_bytes(cfg: Config, schema: Schema, world_size: int) -> list[int]:
    """Bytes of weights and optimizer state on each rank of a plain collection."""
    tables, optimizer = run_tables(cfg, schema), sparse_optimizer(cfg)
    if world_size == 1:
        return [sum(t.bytes + t.rows * optimizer.state_bytes_per_row(t.dim) for t in tables)]
    plan, _ = plan_from_config(cfg, schema, world_size)
    return [m.tables + m.optimizer for m in plan_memory(plan, tables, optimizer, cfg.data.batch_size)]


def no_hot_rows(cfg: Config, schema: Schema) -> HotProfile:
    """A hot set with no rows: a Hotline collection of it keeps every row in host memory."""
    tables = run_tables(cfg, schema)
    return HotProfile(hot={}, features={f: t.name for t in tables for f in t.features}, budget_bytes=0)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)
