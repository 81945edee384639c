"""The all-to-all exchanges between the data-parallel and the model-parallel side.

Every rank sends one slice to every rank (itself included); slices may differ in
size. With W = 3, rank 1's view of one exchange:

    send buffer (rank 1)   [ to r0 | to r1 | to r2 ]   send_splits = [a, b, c]
    recv buffer (rank 1)   [from r0|from r1|from r2]   recv_splits = [x, y, z]

Ids travel with ``alltoall_ids`` (no gradient); pooled vectors travel with
``alltoall_pooled``, whose backward sends the gradients back along the same
path (the reverse all-to-all). With one rank, both are the identity and need no
process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from embeddings.timing import section


def world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(rank, world size) of ``group``; (0, 1) when no process group exists."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where ``group``'s collectives take their tensors: this rank's GPU for NCCL,
    which accepts nothing else; the host for gloo (bookkeeping such as counts is
    built there)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def alltoall_counts(send: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """send [W, k] int64 (row d goes to rank d) → recv [W, k] (row s came from rank s),
    on ``send``'s device."""
    _, size = world(group)
    if size == 1:
        return send.clone()
    device = comm_device(group)
    recv = torch.empty_like(send, device=device)
    dist.all_to_all_single(recv, send.to(device).contiguous(), group=group)
    return recv.to(send.device)


class Pending:
    """An all-to-all in flight: ``wait()`` gives the received buffer."""

    def __init__(self, recv: torch.Tensor, work: dist.Work | None) -> None:
        self.recv, self.work = recv, work

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            with section("input_alltoall"):
                self.work.wait()
        return self.recv


def alltoall_ids(
    send: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group: dist.ProcessGroup | None = None,
) -> Pending:
    """Uneven all-to-all of a 1-D id/length buffer (no autograd), started
    asynchronously so the caller can compute meanwhile."""
    _, size = world(group)
    if size == 1:
        return Pending(send, None)
    recv = send.new_empty(sum(recv_splits))
    work = dist.all_to_all_single(
        recv, send.contiguous(), recv_splits, send_splits, group=group, async_op=True
    )
    return Pending(recv, work)


class _AllToAllPooled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send, send_splits, recv_splits, group):  # type: ignore[override]
        ctx.splits = (send_splits, recv_splits)
        ctx.group = group
        recv = send.new_empty(sum(recv_splits))
        with section("output_alltoall"):
            dist.all_to_all_single(recv, send.contiguous(), recv_splits, send_splits, group=group)
        return recv

    @staticmethod
    def backward(ctx, grad_recv):  # type: ignore[override]
        send_splits, recv_splits = ctx.splits
        grad_send = grad_recv.new_empty(sum(send_splits))
        with section("output_alltoall"):
            dist.all_to_all_single(
                grad_send, grad_recv.contiguous(), send_splits, recv_splits, group=ctx.group
            )
        return grad_send, None, None, None


def alltoall_pooled(
    send: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Uneven all-to-all of a flat float buffer; gradients retrace the path."""
    _, size = world(group)
    if size == 1:
        return send
    return _AllToAllPooled.apply(send, send_splits, recv_splits, group)
