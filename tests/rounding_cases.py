"""Inputs for the stochastic rounding tests (CPU kernels and Triton kernels alike)."""

from __future__ import annotations

import torch


def values(rows: int, dim: int, seed: int) -> torch.Tensor:
    """Normal values over 30 decades, plus the edges: infinities, zeros of both signs,
    fp32 subnormals, fp16's subnormals and its overflow boundary."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=g) * torch.logspace(-12, 6, rows).unsqueeze(1)
    edges = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-45, 6e-8, -3e-5,
                          65504.0, -65519.0, 65520.0, 2.0**-14, -(2.0**-15), 1.0, -1.0])
    x.view(-1)[: edges.numel()] = edges
    return x


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, except that a NaN need only be a NaN (its sign bit is the FPU's choice)."""
    nan = torch.isnan(a.float())
    return torch.equal(nan, torch.isnan(b.float())) and torch.equal(
        a.view(torch.int16)[~nan], b.view(torch.int16)[~nan])


def coordinates(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2**32, (rows,), generator=g), torch.randint(0, 2**40, (rows,), generator=g),
            torch.randint(0, 2**33, (rows,), generator=g))
