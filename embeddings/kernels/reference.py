"""The kernels' computations in plain torch: what the Triton tests compare with.

Same arguments as ``pooled.pooled_forward`` and ``sparse_update.backward_kv``; built
from ``torch.nn.functional.embedding_bag`` and ``KVGradient.from_lookups``, which the
CPU path of the collections uses, so kernel and torch paths answer alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embeddings.kv import KVGradient


def linear_ids(values: torch.Tensor, offsets: torch.Tensor, row_base: torch.Tensor,
               batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(stacked ids [N], bag of each lookup [N]) of feature-major bags."""
    lengths = offsets[1:] - offsets[:-1]
    bag_of = torch.repeat_interleave(torch.arange(lengths.numel(), device=values.device), lengths,
                                     output_size=values.numel())
    return values.long() + row_base[bag_of // batch], bag_of


def _per_lookup_scale(offsets: torch.Tensor, bag_of: torch.Tensor) -> torch.Tensor:
    lengths = (offsets[1:] - offsets[:-1]).clamp(min=1).float()
    return (1.0 / lengths)[bag_of]


def pooled_reference(weight, values, offsets, row_base, batch, mean, feature_major=False):
    ids, bag_of = linear_ids(values, offsets, row_base, batch)
    scale = _per_lookup_scale(offsets, bag_of) if mean else None
    pooled = F.embedding_bag(ids, weight.float(), offsets, mode="sum", include_last_offset=True,
                             per_sample_weights=scale)  # [F*B, D], bag f*B + b
    num_features, dim = row_base.numel(), weight.shape[1]
    pooled = pooled.view(num_features, batch, dim)
    return pooled if feature_major else pooled.transpose(0, 1).reshape(batch, num_features * dim)


def backward_kv_reference(grad_pooled, values, offsets, row_base, batch, mean, feature_major):
    ids, bag_of = linear_ids(values, offsets, row_base, batch)
    num_features = row_base.numel()
    if feature_major:
        per_bag = grad_pooled.reshape(num_features * batch, -1)
    else:
        per_bag = grad_pooled.view(batch, num_features, -1).transpose(0, 1).reshape(num_features * batch, -1)
    weights = _per_lookup_scale(offsets, bag_of) if mean else None
    return KVGradient.from_lookups(ids, per_bag, index=bag_of, weights=weights)


def two_tier_reference(hot_weight, cold_rows, is_hot, slot, cold_local, offsets, features, batch, mean):
    """``two_tier.two_tier_forward``: both tiers as one table, [hot rows; cold rows],
    each lookup's row its slot, or the hot rows' count + its cold row."""
    table = torch.cat([hot_weight.float(), cold_rows.float()])
    ids = torch.where(is_hot, slot, hot_weight.shape[0] + cold_local)
    return pooled_reference(table, ids, offsets, torch.zeros(features, dtype=torch.int64, device=ids.device),
                            batch, mean)
