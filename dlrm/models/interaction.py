"""Feature interactions between the bottom MLP output and the pooled embeddings.

Dot (DLRM):   stack [dense | e_1 | .. | e_F] as X [B, F+1, D]; Z = X X^T [B, F+1, F+1];
              output = [dense | Z's strict upper triangle]   [B, D + (F+1)F/2]
DCNv2 cross:  x0 = [dense | e_1 | .. | e_F] flattened [B, (F+1)D];
              x_{l+1} = x0 * (W_l x_l + b_l) + x_l   (W_l = U_l V_l when low-rank)
              output = x_L                             [B, (F+1)D]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DotInteraction(nn.Module):
    def __init__(self, num_sparse: int, dim: int) -> None:
        super().__init__()
        rows, cols = torch.triu_indices(num_sparse, num_sparse, offset=1)
        # Flat positions of the strict upper triangle of P P^T viewed as [B, F*F]:
        # one index_select instead of a two-index gather.
        self.register_buffer("pairs", rows * num_sparse + cols, persistent=False)
        # For each cell (i, j) of the F x F grid: 1 + the pair (i, j) or (j, i) it
        # belongs to, 0 on the diagonal. The backward builds the symmetric gradient
        # of P P^T with one gather from [0 | pair gradients].
        cell_pair = torch.zeros(num_sparse * num_sparse, dtype=torch.int64)
        numbers = torch.arange(1, rows.numel() + 1)
        cell_pair[rows * num_sparse + cols] = numbers
        cell_pair[cols * num_sparse + rows] = numbers
        self.register_buffer("cell_pair", cell_pair, persistent=False)
        self.num_sparse = num_sparse
        self.dim = dim
        n = num_sparse + 1
        self.out_features = dim + n * (n - 1) // 2

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """dense [B, D], pooled [B, F*D] → [B, D + (F+1)F/2]."""
        pooled = pooled.view(dense.shape[0], self.num_sparse, self.dim)
        return _PairDots.apply(dense, pooled, self.pairs, self.cell_pair)


class _PairDots(torch.autograd.Function):
    """[dense | upper-triangle dots of X X^T] for X = [dense | e_1 | .. | e_F],
    without stacking X (a [B, F+1, D] copy each way):

        X X^T = | d·d   d·P^T |     the triangle: row 0 → d P^T     [B, F]
                | P d   P P^T |                   rows 1.. → P P^T's triangle

    Backward, with S the symmetric gradient of P P^T (the triangle's gradient
    at both (i, j) and (j, i), one gather) and g the one of d P^T:
        dP = S P + g d^T   (one bmm, then the outer product added in place)
        dd = g P
    Each step builds no [B, F, D] temporary besides dP itself: a freshly
    allocated 13 MB buffer costs as much in page faults as the product.
    """

    @staticmethod
    def forward(ctx, dense, pooled, pairs, cell_pair):  # type: ignore[override]
        ctx.save_for_backward(dense, pooled, pairs, cell_pair)
        batch, num_sparse, _ = pooled.shape
        # [B, 1, D] x [B, D, F]: a row times a matrix runs faster than P d.
        with_dense = torch.bmm(dense.unsqueeze(1), pooled.transpose(1, 2)).view(batch, num_sparse)
        among = torch.bmm(pooled, pooled.transpose(1, 2)).view(batch, num_sparse * num_sparse)
        return torch.cat([dense, with_dense, among.index_select(1, pairs)], dim=1)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        dense, pooled, pairs, cell_pair = ctx.saved_tensors
        batch, num_sparse, dim = pooled.shape
        # Under autocast the forward's products ran in the gradient's (lower) precision.
        p, d = pooled.to(grad.dtype), dense.to(grad.dtype)
        g_dense, g_with, g_among = grad.split([dim, num_sparse, pairs.numel()], dim=1)
        sym = F.pad(g_among, (1, 0)).index_select(1, cell_pair)  # [B, F*F]
        grad_pooled = torch.bmm(sym.view(batch, num_sparse, num_sparse), p)
        grad_pooled.addcmul_(g_with.unsqueeze(2), d.unsqueeze(1))
        grad_dense = torch.bmm(g_with.unsqueeze(1), p).view(batch, dim).add_(g_dense)
        return grad_dense.to(dense.dtype), grad_pooled.to(pooled.dtype), None, None


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
