"""Pooled vectors between the owners' layout and the samples' layout: one copy
each way, forward and backward.

On a shard owner, a store's lookup gives [k, T, w]: its k slots (feature pieces),
the bags of every source rank one after another (T = B_0 + B_1 + ..). The output
all-to-all wants, per source s, that source's bags of every store:

    store 0 [k0, B_0 | B_1, w0]   store 1 [k1, B_0 | B_1, w1]
                  │ pack_by_source
                  ▼
    send [ s=0: store 0 [k0, B_0, w0], store 1 [k1, B_0, w1] | s=1: .. B_1 .. ]

On the sample's side, each received block is one slot's [B, cols]; a feature's
pieces sit side by side (column-wise) or are added (row-wise):

    recv [ from owner 0: slot [B, c] slot [B, c] .. | from owner 1: .. ]
    replicated [n, B, D]                    (looked up here)
                  │ unpack_pooled
                  ▼
    out [B, F*D]     feature f in columns f*D .. (f+1)*D

The backward of each is the same copy the other way. Built from split, reshape,
view and cat instead, autograd copied at nearly every link (three copies of
[B, F*D] per direction at 2 ranks, plus a node per block).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch


def pack_by_source(stores: list[torch.Tensor], src_batch: list[int]) -> torch.Tensor:
    """Stores' pooled [k, T, w] → flat send buffer, source-major (see above)."""
    return _PackBySource.apply(src_batch, *stores)


class _PackBySource(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, src_batch: list[int], *stores: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.src_batch = src_batch
        ctx.shapes = [s.shape for s in stores]
        out = stores[0].new_empty(sum(s.numel() for s in stores))
        for block, part in _blocks(out, ctx.shapes, src_batch, stores):
            block.copy_(part)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        grads = [grad.new_empty(shape) for shape in ctx.shapes]
        for block, part in _blocks(grad, ctx.shapes, ctx.src_batch, grads):
            part.copy_(block)
        return (None, *grads)


def _blocks(flat: torch.Tensor, shapes: list[torch.Size], src_batch: list[int],
            stores: list[torch.Tensor] | tuple[torch.Tensor, ...]):
    """(view of ``flat``, view of a store) pairs: source s's bags of each store."""
    offset, start = 0, 0
    for batch in src_batch:
        for shape, store in zip(shapes, stores):
            k, _, w = shape
            n = k * batch * w
            yield flat[offset : offset + n].view(k, batch, w), store[:, start : start + batch]
            offset += n
        start += batch


@dataclass(frozen=True)
class Placement:
    """One [B, cols] block of a source buffer and where it goes in [B, F*D]."""

    source: int  # index into the sources
    offset: int  # first element of the block in its (flat) source
    column: int  # first column in the output
    cols: int
    add: bool  # added to what is there (a row-wise piece after the first)


def unpack_pooled(
    sources: list[torch.Tensor],
    placements: list[Placement],
    batch: int,
    width: int,
    divisors: list[tuple[int, int, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Blocks of ``sources`` into [batch, width], in placement order, then each
    (column, cols, lengths [B]) of ``divisors`` divided by its lengths (mean
    pooling; a placement lies within one divisor's columns or none). Every output
    column must be covered by a non-adding placement."""
    covered = [0] * len(sources)
    for p in placements:
        covered[p.source] += batch * p.cols
    if covered != [s.numel() for s in sources]:
        raise ValueError(f"placements cover {covered} elements of sources of "
                         f"{[s.numel() for s in sources]}")
    return _Unpack.apply(placements, batch, width, divisors or [], *sources)


class _Unpack(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, placements: list[Placement], batch: int, width: int,  # type: ignore[override]
                divisors: list[tuple[int, int, torch.Tensor]], *sources: torch.Tensor) -> torch.Tensor:
        ctx.placements, ctx.divisors = placements, divisors
        ctx.shapes = [s.shape for s in sources]
        flat = [s.reshape(-1) for s in sources]  # views: sources are contiguous
        out = flat[0].new_empty(batch, width)
        for p in placements:
            block = flat[p.source][p.offset : p.offset + batch * p.cols].view(batch, p.cols)
            target = out[:, p.column : p.column + p.cols]
            if p.add:
                target.add_(block)
            else:
                target.copy_(block)
        for column, cols, lengths in divisors:
            out[:, column : column + cols].div_(lengths.unsqueeze(1).to(out.dtype))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        batch = grad.shape[0]
        # d(out / n) = grad / n: divided on its way into each block, no extra pass.
        divisors = sorted(ctx.divisors, key=lambda d: d[0])
        starts = [column for column, _, _ in divisors]
        # Each source element lies in exactly one block (checked in unpack_pooled).
        grads = [grad.new_empty(shape) for shape in ctx.shapes]
        flat = [g.view(-1) for g in grads]
        for p in ctx.placements:
            block = flat[p.source][p.offset : p.offset + batch * p.cols].view(batch, p.cols)
            part = grad[:, p.column : p.column + p.cols]
            i = bisect.bisect_right(starts, p.column) - 1
            if i >= 0 and p.column < starts[i] + divisors[i][1]:
                torch.div(part, divisors[i][2].unsqueeze(1).to(grad.dtype), out=block)
            else:
                block.copy_(part)
        return (None, None, None, None, *grads)
