"""Hybrid parallelism applied from outside the model (the model file knows no ranks).

    embeddings ── sharded by the plan (dlrm/parallel/parallelize.py), all-to-all inside
    dense_arch ── apply_ddp: DistributedDataParallel, optional comm hook
    loss scale ── without a compression hook, each rank's loss is
                  sum(local BCE) / global batch, and DDP SUMS the dense gradients
                  (a hook replacing its default average) → the exact global-mean
                  gradient on both sides, with nothing to rescale.
                  With ddp_hook=fp16|bf16|powersgd (those hooks average), the loss
                  is W * sum(local BCE) / global batch and the pooled vectors'
                  gradient is scaled by 1/W (the collection's ``grad_scale``, set
                  where it is built) before it reaches the (summing) embedding
                  side. That costs a pass over [B, F*D] per step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dlrm.config import Config
from dlrm.models.dlrm import DLRM
from dlrm.parallel.distributed import DistInfo


def apply_ddp(model: DLRM, info: DistInfo, cfg: Config) -> None:
    """Wrap the dense arch in DDP (and its communication hook, if configured)."""
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    model.dense_arch = DistributedDataParallel(model.dense_arch, device_ids=device_ids)
    register_comm_hook(model.dense_arch, cfg.train.ddp_hook, cfg.train.powersgd_warmup)


def register_comm_hook(ddp: DistributedDataParallel, hook: str, powersgd_warmup: int) -> None:
    """fp16/bf16 compression or PowerSGD (uncompressed for ``powersgd_warmup`` steps);
    "none": a plain sum (see the module docstring)."""
    if hook == "none":
        ddp.register_comm_hook(None, allreduce_sum_hook)
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp.register_comm_hook(None, bf16_average_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=max(2, powersgd_warmup)
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        raise ValueError(hook)


def bf16_average_hook(group, bucket):  # type: ignore[no-untyped-def]
    """torch's ``default_hooks.bf16_compress_hook`` arithmetic (the bucket in bf16,
    divided by the world size, all-reduced, written back in fp32) on every backend.
    DDP refuses a hook of that name in a build without NCCL, yet gloo sums bf16 (a CPU
    run with ddp_hook=bf16 stopped with torch's traceback): hence our own, named apart."""
    group = group or dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())
    work = dist.all_reduce(compressed, group=group, async_op=True)
    return work.get_future().then(lambda fut: buffer.copy_(fut.value()[0]))


def allreduce_sum_hook(group, bucket):  # type: ignore[no-untyped-def]
    """DDP's all-reduce without its division by the world size. (No annotations:
    DDP checks them against the real classes, and this module's are strings.)

    At 3 or more ranks the ranks' buckets are gathered and added in rank order, each
    element alike. An all-reduce adds an element's terms in an order that depends on
    where it lies in its bucket, and DDP lays its buckets out anew after a process's
    first step (all parameters in one, then by the order the gradients were ready): a
    resumed process's first step then summed otherwise than the same step of a run never
    stopped, and the resumed run drifted by rounding (~3e-8, found 2026-12-07). A 2-term
    sum is the same in either order. The gather moves W times a bucket where a ring
    all-reduce moves about twice (the dense arch's few MB a step; not yet timed on GPUs)."""
    group = group or dist.group.WORLD
    buffer = bucket.buffer()
    world = dist.get_world_size(group)
    if world < 3:
        work = dist.all_reduce(buffer, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    gathered = buffer.new_empty(world * buffer.numel())  # flat: gloo takes no [W, n] output
    work = dist.all_gather_into_tensor(gathered, buffer.reshape(-1), group=group, async_op=True)
    ranks = gathered.view(world, -1)

    def in_rank_order(fut):  # type: ignore[no-untyped-def]
        fut.wait()
        total = buffer.reshape(-1)
        total.copy_(ranks[0])
        for r in range(1, world):
            total.add_(ranks[r])
        return buffer

    return work.get_future().then(in_rank_order)


def averaging(cfg: Config) -> bool:
    """True when DDP averages dense gradients over ranks: the compression hooks, and
    the TorchRec backend (its own DDP; it divides pooled gradients by W itself)."""
    return cfg.train.ddp_hook != "none" or cfg.embeddings.backend == "torchrec"




def loss_scale(info: DistInfo, global_rows: int, cfg: Config) -> float:
    """Multiplier of sum(local BCE) that makes the synchronised gradient exact."""
    return (info.world_size if averaging(cfg) else 1.0) / max(global_rows, 1)



