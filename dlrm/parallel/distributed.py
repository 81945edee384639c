"""Process group set-up under torchrun, and the few collectives the trainer needs.

``torchrun --nproc_per_node=N -m dlrm train ...`` sets RANK, WORLD_SIZE and
LOCAL_RANK; one process without them runs alone with no process group.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from data.errors import UserError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = ""
    timeout_s: int = 600  # collectives of every group (train.timeout_s)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(backend: str = "auto", device: str = "auto", timeout_s: int = 600) -> DistInfo:
    """Join the torchrun job (if any). backend auto: nccl with CUDA, gloo otherwise."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and device in ("auto", "cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("device cuda (train.device, or dlrm eval's --device) but this machine has no CUDA device")
    # More local ranks than GPUs share them round-robin (a test runs 2 ranks on one GPU
    # with gloo; NCCL refuses two ranks on one device).
    dev = torch.device(f"cuda:{local_rank % torch.cuda.device_count()}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(dev)
    if world_size == 1 and not dist.is_initialized():
        return DistInfo(device=dev)
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise UserError("train.backend=nccl needs CUDA devices; use gloo on CPU")
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        # torchrun keeps one store across restarts (--max-restarts): keys of a killed
        # incarnation (its ranks' addresses) would be read by the next one. Each
        # incarnation gets its own key prefix.
        store, rank, size = next(dist.rendezvous("env://", timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"dlrm/attempt{attempt}/", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend, timeout_s)


def new_group(info: DistInfo, backend: str | None = None) -> dist.ProcessGroup:
    """A process group of all ranks with the job's collective timeout (a plain
    ``dist.new_group`` waits torch's default of 30 minutes for a dead peer)."""
    return dist.new_group(backend=backend or info.backend, timeout=timedelta(seconds=info.timeout_s))


def all_reduce_sum(values: list[float], info: DistInfo) -> list[float]:
    if info.world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device(info))
    dist.all_reduce(t)
    return t.cpu().tolist()


def all_gather_rows(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Concatenate every rank's 1-D ``tensor`` (any lengths) in rank order."""
    if info.world_size == 1:
        return tensor
    device = _comm_device(info)
    size = torch.tensor([tensor.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(info.world_size)]
    dist.all_gather(sizes, size)
    longest = int(max(int(s) for s in sizes))
    padded = torch.zeros(longest, dtype=tensor.dtype, device=device)
    padded[: tensor.numel()] = tensor.to(device)
    parts = [torch.empty_like(padded) for _ in range(info.world_size)]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(n)] for p, n in zip(parts, sizes)]).cpu()


def barrier(info: DistInfo) -> None:
    if info.world_size > 1:
        dist.barrier()


def _comm_device(info: DistInfo) -> torch.device:
    return info.device if info.backend == "nccl" else torch.device("cpu")


def all_reduce_max(values: list[int], info: DistInfo) -> list[int]:
    """The largest of every rank's ``values``, element-wise, on every rank (decisions
    all ranks must take together: any rank's "yes" is everyone's)."""
    if info.world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.int64, device=_comm_device(info))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def broadcast_object(obj: object, info: DistInfo) -> object:
    """Rank 0's picklable ``obj`` on every rank."""
    if info.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=_comm_device(info))
    return box[0]


def all_gather_objects(obj: object, info: DistInfo) -> list[object]:
    """Every rank's picklable ``obj``, in rank order, on every rank."""
    if info.world_size == 1:
        return [obj]
    out: list[object] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


# What gloo and NCCL say when a collective's peer is gone or silent.
_TIMED_OUT = re.compile(r"Timed out waiting (\d+)ms|timed out|Timeout|watchdog", re.IGNORECASE)
_LOST_PEER = re.compile(r"Connection (reset|closed) by peer|Broken pipe|Connection refused|"
                        r"Read error|Write error|NCCL communicator was aborted", re.IGNORECASE)


def all_to_all_arrays(send: list[np.ndarray]) -> list[np.ndarray]:
    """int64 arrays over the default group: ``send[k]`` to rank k; what every rank sent
    here, in rank order (the vocabulary pass's exchange, data/fit_exchange.py). Sizes
    first, then one all-to-all of the data (on the GPU under NCCL)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    sent = torch.tensor([len(a) for a in send], dtype=torch.int64, device=device)
    sizes = torch.empty_like(sent)
    dist.all_to_all_single(sizes, sent)
    data = torch.from_numpy(np.concatenate(send).astype(np.int64, copy=False)).to(device)
    got = torch.empty(int(sizes.sum()), dtype=torch.int64, device=device)
    dist.all_to_all_single(got, data, sizes.tolist(), sent.tolist())
    return np.split(got.cpu().numpy(), np.cumsum(sizes.cpu().numpy())[:-1])


def collective_failure(error: BaseException) -> str | None:
    """One line for an error raised by a collective whose peer died or hangs, or
    None when ``error`` is something else (a bug keeps its traceback).

        rank 0: a collective timed out after 5s (train.timeout_s): a peer died or hangs
        rank 0: a collective lost its connection to a peer: a peer died (see its log)
        rank 0: the other ranks did not all join (Timed out after 6 seconds waiting for clients. 1/2 clients joined.)
    """
    if not (dist.is_available() and isinstance(error, RuntimeError)):  # DistError is one too
        return None
    text = str(error)
    if isinstance(error, dist.DistStoreError) and "waiting for clients" in text:  # rendezvous
        first = text.strip().splitlines()[0]
        return f"rank {os.environ.get('RANK', '?')}: the other ranks did not all join ({first})"
    if not dist.is_initialized():
        return None
    rank = dist.get_rank()
    timed_out = _TIMED_OUT.search(text)
    if timed_out:
        after = f" after {int(timed_out.group(1)) / 1000:g}s" if timed_out.group(1) else ""
        return f"rank {rank}: a collective timed out{after} (train.timeout_s): a peer died or hangs"
    if _LOST_PEER.search(text):
        return f"rank {rank}: a collective lost its connection to a peer: a peer died (see its log)"
    return None
