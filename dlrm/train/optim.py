"""The dense optimizer and the learning-rate schedule both sides follow."""

from __future__ import annotations

import torch

from dlrm.config import Config


def build_dense_optimizer(cfg: Config, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    lr = cfg.optim.dense_lr
    if cfg.optim.dense == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if cfg.optim.dense == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, eps=cfg.optim.eps)
    return torch.optim.Adam(params, lr=lr, eps=cfg.optim.eps)


def lr_factor(cfg: Config, step: int) -> float:
    """Linear warm-up over ``warmup_steps``, then linear decay to 0 over ``decay_steps``."""
    o = cfg.optim
    factor = 1.0
    if o.warmup_steps > 0 and step < o.warmup_steps:
        factor = (step + 1) / o.warmup_steps
    if o.decay_steps > 0 and step >= o.decay_start:
        factor *= max(0.0, 1.0 - (step - o.decay_start) / o.decay_steps)
    return factor
