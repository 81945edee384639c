"""Hot rows in and out of a sharded host tier (Hotline on several ranks).

Every rank keeps the same hot rows on its device; during training those copies
are authoritative and the host tier's copies of the same rows (on whichever ranks
the plan gives them to) go stale until written back.

    read  (collective)   every rank copies the hot elements it owns into a zero
                         buffer [H, D] (+ per-row optimizer state), then one
                         all-reduce SUM gives every rank every hot row.
                         Each element has exactly one contributor, so the sum
                         is a copy, bit for bit.
    write (local)        every rank copies the hot elements it owns back into
                         its shards; replicated tables: every rank its own copy.

Who owns element (row r, column c) of a table (the strategies' ``first_copy``):

    table_wise / row_wise    the shard whose rows hold r
    column_wise              the shard whose rows hold r and columns hold c;
                             a per-row state value (row-wise Adagrad's mean g²)
                             is kept by every column shard: read from the first
    data_parallel            read from the first copy, written to every copy

Stacked ids number the rows of all tables in table order (the hot tier's ids).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from embeddings.plan.types import Shard
from embeddings.rounding import weight_dtype
from embeddings.sharding.registry import strategy

if TYPE_CHECKING:
    from embeddings.sharded import ShardedEmbeddingCollection


def _owned(
    host: ShardedEmbeddingCollection, offsets: dict[str, int], stacked_ids: torch.Tensor
) -> Iterator[tuple[Shard, bool, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]]:
    """(shard, first copy?, its tensors (views), positions in ``stacked_ids`` [k], rows
    in the shard [k]) for every shard on this rank; ``stacked_ids`` sorted."""
    for shard, tensors in host.local_shards():
        table_plan = host.plan.tables[shard.table]
        first = strategy(table_plan.sharding).first_copy(shard, table_plan)
        base = offsets[shard.table] + shard.row_start
        lo = int(torch.searchsorted(stacked_ids, base))
        hi = int(torch.searchsorted(stacked_ids, base + shard.rows))
        positions = torch.arange(lo, hi, device=stacked_ids.device)
        yield shard, first, tensors, positions, stacked_ids[lo:hi] - base


@torch.no_grad()
def read_rows(
    host: ShardedEmbeddingCollection,
    offsets: dict[str, int],
    stacked_ids: torch.Tensor,
    state: dict[str, torch.Tensor],
    row_state: list[str],
) -> torch.Tensor:
    """Hot rows [H, D] of every rank's shards, on every rank (collective).

    ``state``: freshly initialised optimizer state for H rows; the entries named in
    ``row_state`` (one value or vector per row) are filled with the owners' values,
    the others (Adam's step, the same in every shard) from a shard (this rank's, else
    the holders': a collective too)."""
    ids = stacked_ids.cpu()
    # Gathered in fp32 whatever the tables' type (half values are exact in fp32, a sum
    # with zeros too; gloo's all-reduce knows fp32 best), cast back at the end (exact).
    weight = torch.zeros(ids.numel(), host.dim)
    rows_state = {k: torch.zeros(v.shape, dtype=torch.float32 if v.is_floating_point() else v.dtype)
                  for k, v in state.items() if k in row_state}
    scalars: dict[str, torch.Tensor] = {}
    for shard, first, tensors, pos, rows in _owned(host, offsets, ids):
        cols = slice(shard.col_start, shard.col_end)
        for name in state:
            if name not in row_state:
                scalars.setdefault(name, tensors[name])
        if not first:
            continue
        weight[pos, cols] = tensors["weight"].index_select(0, rows).cpu().float()
        for name, buffer in rows_state.items():
            src = tensors[name].index_select(0, rows).cpu().to(buffer.dtype)
            if buffer.dim() == 2:
                buffer[pos, cols] = src
            elif shard.col_start == 0:  # per-row value: every column shard has it
                buffer[pos] = src
    # Scalar state (Adam's step, the rounding step) from any shard; a rank that holds
    # no shard of these tables (a table-wise table on another rank) takes the owners'
    # value by an all-reduce MAX (counts: the holders agree, the others add 0).
    for name, fresh in state.items():
        if name not in row_state:
            scalars[name] = scalars.get(name, fresh).cpu().clone()
    if host.world_size > 1:
        for tensor in [weight, *rows_state.values()]:
            dist.all_reduce(tensor, group=host.group)
        for tensor in scalars.values():
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=host.group)
    for name, tensor in state.items():
        tensor.copy_(rows_state[name] if name in rows_state else scalars[name])
    return weight.to(weight_dtype(host.tables[0].dtype))  # Hotline: one dtype for all tables


@torch.no_grad()
def write_rows(
    host: ShardedEmbeddingCollection,
    offsets: dict[str, int],
    stacked_ids: torch.Tensor,
    weight: torch.Tensor,
    state: dict[str, torch.Tensor],
    row_state: list[str],
) -> None:
    """Copy hot rows ``weight`` [H, D] and their optimizer state (per row: the
    entries named in ``row_state``) into this rank's shards (no communication:
    every rank holds all hot rows)."""
    ids = stacked_ids.cpu()
    weight = weight.cpu()
    state = {k: v.cpu() for k, v in state.items()}
    for shard, _, tensors, pos, rows in _owned(host, offsets, ids):
        cols = slice(shard.col_start, shard.col_end)
        rows = rows.to(tensors["weight"].device)
        tensors["weight"].index_copy_(0, rows, weight[pos, cols].to(tensors["weight"].device))
        for name, src in state.items():
            dst = tensors[name]
            if name not in row_state:
                dst.copy_(src)
            elif src.dim() == 2:
                dst.index_copy_(0, rows, src[pos, cols].to(dst.device))
            else:
                dst.index_copy_(0, rows, src[pos].to(dst.device))
