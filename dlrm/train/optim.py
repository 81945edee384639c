"""The dense optimizer and the learning-rate schedule both sides follow."""

from __future__ import annotations

import torch

from dlrm.config import Config


def build_dense_optimizer(cfg: Config, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    lr = cfg.optim.dense_lr
    impl = implementation(cfg.optim.dense, params)
    if cfg.optim.dense == "sgd":
        return torch.optim.SGD(params, lr=lr, **impl)
    if cfg.optim.dense == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, eps=cfg.optim.eps, **impl)
    return torch.optim.Adam(params, lr=lr, eps=cfg.optim.eps, **impl)


def implementation(kind: str, params: list[torch.nn.Parameter]) -> dict[str, bool]:
    """On CUDA one fused kernel for SGD and Adam (torch's ``fused=True``), the
    multi-tensor path for Adagrad (its fused kernel is CPU-only): a few launches for
    all the MLPs' parameters instead of several per tensor. On the CPU torch's own
    default, which the CPU results were checked with."""
    if not params or not all(p.is_cuda for p in params):
        return {}
    return {"foreach": True} if kind == "adagrad" else {"fused": True}


def lr_factor(cfg: Config, step: int) -> float:
    """Linear warm-up over ``warmup_steps``, then linear decay to 0 over ``decay_steps``."""
    o = cfg.optim
    factor = 1.0
    if o.warmup_steps > 0 and step < o.warmup_steps:
        factor = (step + 1) / o.warmup_steps
    if o.decay_steps > 0 and step >= o.decay_start:
        factor *= max(0.0, 1.0 - (step - o.decay_start) / o.decay_steps)
    return factor
