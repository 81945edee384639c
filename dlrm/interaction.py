"""Feature interactions between the bottom MLP output and the pooled embeddings.

Dot (DLRM):   stack [dense | e_1 | .. | e_F] as X [B, F+1, D]; Z = X X^T [B, F+1, F+1];
              output = [dense | Z's strict upper triangle]   [B, D + (F+1)F/2]
DCNv2 cross:  x0 = [dense | e_1 | .. | e_F] flattened [B, (F+1)D];
              x_{l+1} = x0 * (W_l x_l + b_l) + x_l   (W_l = U_l V_l when low-rank)
              output = x_L                             [B, (F+1)D]
"""

from __future__ import annotations

import torch
from torch import nn


class DotInteraction(nn.Module):
    def __init__(self, num_sparse: int, dim: int) -> None:
        super().__init__()
        n = num_sparse + 1
        rows, cols = torch.triu_indices(n, n, offset=1)
        # Flat positions of the strict upper triangle in Z viewed as [B, n*n]:
        # one index_select instead of a two-index gather.
        self.register_buffer("pairs", rows * n + cols, persistent=False)
        self.num_vectors = n
        self.dim = dim
        self.out_features = dim + n * (n - 1) // 2

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """dense [B, D], pooled [B, F*D] → [B, D + (F+1)F/2]."""
        batch = dense.shape[0]
        stacked = torch.cat([dense, pooled], dim=1).view(batch, self.num_vectors, self.dim)
        return torch.cat([dense, _PairDots.apply(stacked, self.pairs)], dim=1)


class _PairDots(torch.autograd.Function):
    """Upper-triangle dots of X X^T with a one-bmm backward.

    Z = X X^T is symmetric, so with G the scattered output gradient,
    dX = (G + G^T) X: one bmm where autograd's bmm backward runs two.
    """

    @staticmethod
    def forward(ctx, stacked, pairs):  # type: ignore[override]
        ctx.save_for_backward(stacked, pairs)
        batch, n, _ = stacked.shape
        z = torch.bmm(stacked, stacked.transpose(1, 2)).view(batch, n * n)
        return z.index_select(1, pairs)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        stacked, pairs = ctx.saved_tensors
        batch, n, _ = stacked.shape
        g = grad.new_zeros(batch, n * n).index_copy_(1, pairs, grad).view(batch, n, n)
        # Under autocast the forward bmm ran in the gradient's (lower) precision.
        grad_stacked = torch.bmm(g + g.transpose(1, 2), stacked.to(g.dtype))
        return grad_stacked.to(stacked.dtype), None


class CrossInteraction(nn.Module):
    """DCNv2 cross network over the concatenated vectors (Wang et al., 2021)."""

    def __init__(self, num_sparse: int, dim: int, layers: int, rank: int = 0) -> None:
        super().__init__()
        width = (num_sparse + 1) * dim
        self.out_features = width
        if rank > 0:
            self.down = nn.ModuleList(nn.Linear(width, rank, bias=False) for _ in range(layers))
            self.up = nn.ModuleList(nn.Linear(rank, width) for _ in range(layers))
        else:
            self.down = nn.ModuleList(nn.Identity() for _ in range(layers))
            self.up = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        x0 = torch.cat([dense, pooled], dim=1)
        x = x0
        for down, up in zip(self.down, self.up):
            x = x0 * up(down(x)) + x
        return x
