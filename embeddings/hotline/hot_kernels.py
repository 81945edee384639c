"""The hot tier on the Triton kernels (embeddings/kernels): what it adds to them.

    forward   each micro-batch's hot lookups: one ``pooled_forward`` launch over its bags
              (slots into the hot weight, every feature's row base 0), summed; mean
              pooling divides each bag by its WHOLE length (hot + cold lookups) after
    backward  kept: the pooled gradient [F, b, D] and the bags are held, no work
    step      the held micro-batches (popular, non-popular) joined into one batch,
              feature-major over their samples (``join``), then ONE sort and ONE
              fused backward + update launch for every hot row of the mini-batch

Nothing here sizes a tensor by the data: the join is a stable sort of static size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from embeddings.jagged import bag_offsets

if TYPE_CHECKING:
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
