"""Jagged ids: a batch's bags in the collection's feature order, shifted into stacked rows.

A sparse batch (``data.jagged.JaggedFeatures``, or TorchRec's KJT: anything
``KeyedJagged``) holds its bags feature-major, in its own key order; a collection reads
them in its feature order, and a stacked weight holds its tables one after another:

    keys [b, a], B = 2          lengths [1 0 | 2 0]   values [x | y z]
        │ in_feature_order(features=[a, b])   (one permute_bags)
        ▼
    lengths [2 0 | 1 0]   values [y z | x]        bag f*B + b = (feature f, sample b)
        │ stacked_ids(feature_offsets=[0, 50])  (table of a at row 0, of b at row 50)
        ▼
    ids [y z | x+50]                              rows of the stacked weight
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from data.jagged import KeyedJagged


def in_feature_order(
    sparse: KeyedJagged, features: list[str]
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(values [N], lengths [F*B], B) of ``sparse``'s ``features``, in that order."""
    batch = sparse.stride()
    lengths, values = sparse.lengths(), sparse.values()
    keys = sparse.keys()
    if keys != features:
        order = torch.tensor([keys.index(f) for f in features], dtype=torch.int64)
        bag_order = (order.unsqueeze(1) * batch + torch.arange(batch)).flatten()
        lengths, values = permute_bags(lengths, values, bag_order.to(lengths.device))
    return values, lengths, batch


def stacked_ids(
    values: torch.Tensor, lengths: torch.Tensor, feature_offsets: torch.Tensor, batch: int
) -> torch.Tensor:
    """Feature-major ids [N] shifted by their feature's table offset (``feature_offsets``
    [F], one per feature) into the rows of a stacked weight."""
    per_feature = lengths.view(feature_offsets.numel(), batch).sum(dim=1)
    return values + torch.repeat_interleave(
        feature_offsets.to(values.device), per_feature, output_size=values.numel()
    )


def permute_bags(
    lengths: torch.Tensor, values: torch.Tensor, order: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorder jagged bags: bag i of the result is bag ``order[i]`` of the input.

        lengths [2, 0, 1], values [a b | | c], order [2, 0, 1]
        → lengths [1, 2, 0], values [c | a b |]
    """
    if _fbgemm_ops():
        new_lengths, new_values, _ = torch.ops.fbgemm.permute_1D_sparse_data(
            order.to(torch.int32), lengths, values, None, None
        )
        return new_lengths, new_values
    new_lengths = lengths.index_select(0, order)
    if _one_id_per_bag(lengths, values):  # single-hot features: ids move as their bags do
        return new_lengths, values.index_select(0, order)
    total = int(values.numel())
    shift = torch.repeat_interleave(
        bag_starts(lengths).index_select(0, order) - bag_starts(new_lengths),
        new_lengths,
        output_size=total,
    )
    index = torch.arange(total, device=values.device) + shift
    return new_lengths, values.index_select(0, index)


def _one_id_per_bag(lengths: torch.Tensor, values: torch.Tensor) -> bool:
    """Every bag holds one id (single-hot features): then one gather of the ids does,
    as fast as fbgemm's op. Looked at on the CPU only, where reading the lengths costs
    no device sync."""
    return (values.device.type == "cpu" and values.numel() == lengths.numel()
            and bool((lengths == 1).all()))


def bag_starts(lengths: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sum: where each bag starts in the values."""
    starts = torch.zeros_like(lengths)
    if lengths.numel() > 1:
        torch.cumsum(lengths[:-1], 0, out=starts[1:])
    return starts


def bag_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """Inclusive offsets [S + 1] of bags ``lengths`` [S] (``embedding_bag``'s form)."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    return offsets


def _fbgemm_ops() -> bool:
    """Whether fbgemm's sparse ops are loaded: only where something else imported
    ``fbgemm_gpu`` (torchrec does). We never import it ourselves: the native engine
    runs on plain torch, and the torch fallback gives the same result."""
    return "fbgemm_gpu" in sys.modules and hasattr(torch.ops.fbgemm, "permute_1D_sparse_data")


def split_features(sparse: KeyedJagged, groups: list[list[str]]) -> list[KeyedJagged]:
    """``sparse``'s bags split by feature groups (tables of several stacks): one
    permutation into group order, then contiguous slices, their value counts read on
    the host (a sync on CUDA: for the paths that read their batch on the host anyway)."""
    from data.jagged import JaggedFeatures

    values, lengths, batch = in_feature_order(sparse, [f for g in groups for f in g])
    bags = [len(g) * batch for g in groups]
    parts = lengths.split(bags)
    counts = [int(n) for n in torch.stack([p.sum() for p in parts]).tolist()] if parts else []
    return [JaggedFeatures(g, v, n, batch) for g, v, n in zip(groups, values.split(counts), parts, strict=True)]

