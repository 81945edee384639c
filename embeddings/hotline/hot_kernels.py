"""The hot tier on the Triton kernels (embeddings/kernels): what it adds to them.

    forward   each micro-batch's hot lookups: one ``pooled_forward`` launch over its bags
              (slots into the hot weight, every feature's row base 0), summed; mean
              pooling divides each bag by its WHOLE length (hot + cold lookups) after
    backward  kept: the pooled gradient [F, b, D] and the bags are held, no work
    step      the held micro-batches (popular, non-popular) joined into one batch,
              feature-major over their samples (``join``), then ONE sort and ONE
              fused backward + update launch for every hot row of the mini-batch

Nothing here sizes a tensor by the data: the join is a stable sort of static size.
Two micro-batches of one split (popular, then the rest; the trainer runs one pass
since hotline.dense_pass was removed) skip it (``in_split_order``): the split
has its hot lookups in the mini-batch's own order, so the join is the gradients' rows
put back in that order, 2 ops where ``join`` issues some 20.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from embeddings.jagged import bag_offsets

if TYPE_CHECKING:
    import torch.distributed as dist

    from embeddings.hotline.split import DeviceSplit
    from embeddings.kernels.lookup import Bags  # imports triton


def join(parts: list[tuple[torch.Tensor, Bags]], features: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Micro-batches' (pooled gradient [F, b_i, D], bags) as one batch of sum(b_i)
    samples, micro-batch after micro-batch: (gradient [F, B, D], slots [N] feature-major
    over the joined samples, offsets [F*B + 1], B)."""
    if len(parts) == 1:
        grad, bags = parts[0]
        return grad, bags.values, bags.offsets, bags.batch
    lengths = [(bags.offsets[1:] - bags.offsets[:-1]).view(features, bags.batch) for _, bags in parts]
    feature_of = []
    for (_, bags), part_lengths in zip(parts, lengths):
        per_feature = part_lengths.sum(dim=1)
        feature_of.append(torch.repeat_interleave(
            torch.arange(features, device=per_feature.device), per_feature, output_size=bags.values.numel()))
    part_of = torch.cat([torch.full_like(f, i) for i, f in enumerate(feature_of)])
    # Stable: within a (feature, micro-batch) the bags keep their order.
    order = torch.sort(torch.cat(feature_of) * len(parts) + part_of, stable=True).indices
    slots = torch.cat([bags.values for _, bags in parts]).index_select(0, order)
    grad = torch.cat([g.view(features, bags.batch, -1) for g, bags in parts], dim=1)
    batch = sum(bags.batch for _, bags in parts)
    return grad, slots, bag_offsets(torch.cat(lengths, dim=1).reshape(-1)), batch


def in_split_order(parts: list[tuple[torch.Tensor, Bags]], sources: list[tuple[DeviceSplit, int] | None]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
    """``join``'s result for the two micro-batches (popular, then the rest) of one split,
    in the mini-batch's own sample order: the pooled gradients' samples put back where
    the split took them from (one ``index_copy_``), the slots and offsets the split's
    (``DeviceSplit.hot_in_batch_order``). None for any other set of parts."""
    if len(parts) != 2 or len(sources) != 2 or sources[0] is None or sources[1] is None:
        return None
    (split, first), (other, second) = sources
    if split is not other or (first, second) != (0, 1):
        return None
    features, batch = parts[0][1].row_base.numel(), split.lookups.batch
    grads = [g.view(features, bags.batch, -1) for g, bags in parts]
    grad = torch.cat(grads, dim=1)
    out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
    grad = out.index_copy_(1, split.sample_order, grad)
    slots, offsets = split.hot_in_batch_order()
    hot = sum(bags.values.numel() for _, bags in parts)
    return grad, slots[:hot], offsets, batch


def gather_ranks(joined: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int], row_base: torch.Tensor,
                 group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Several ranks (the hot tier replicated): every rank's joined hot gradient
    (``join``'s result: gradient [F, B_r, D], slots [H_r], offsets [F*B_r + 1], B_r)
    joined in rank order, the same on every rank, so each replica's ONE fused update
    applies the same sum. Sizes first (a [2] all-gather; on NCCL the host reads it),
    then the gradients, slots and offsets padded to the longest rank's and all-gathered.

        rank 0  [F, B_0, D] | slots H_0        all ranks ──► join over W parts:
        rank 1  [F, B_1, D] | slots H_1                      feature-major over B_0 + B_1 + ..
    """
    import torch.distributed as dist

    from embeddings.alltoall import comm_device
    from embeddings.kernels.lookup import Bags  # imports triton

    grad, slots, offsets, batch = joined
    features, dim = row_base.numel(), grad.shape[-1]
    size = dist.get_world_size(group)
    device = comm_device(group)  # NCCL takes GPU tensors only
    mine = torch.tensor([slots.numel(), batch], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    sizes = [tuple(int(v) for v in t.tolist()) for t in every]
    most_slots, most_batch = max(h for h, _ in sizes), max(b for _, b in sizes)
    home = grad.device
    padded = [
        _padded(grad.reshape(features, batch, dim), (features, most_batch, dim), device),
        _padded(slots, (most_slots,), device),
        _padded(offsets, (features * most_batch + 1,), device),
    ]
    gathered = []
    for t in padded:
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t, group=group)
        gathered.append(parts)
    parts = [(g[:, :b].to(home), Bags(s[:h].to(home), o[:features * b + 1].to(home), row_base, b, False, True))
             for (h, b), g, s, o in zip(sizes, *gathered, strict=True)]
    return join(parts, features)


def _padded(t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``t`` in the corner of zeros of ``shape`` on ``device``."""
    out = torch.zeros(shape, dtype=t.dtype, device=device)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out
