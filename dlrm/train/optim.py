"""The dense optimizer and the learning-rate schedule both sides follow."""

from __future__ import annotations

import functools

import torch

from dlrm.config import Config
from dlrm.train.adagrad import DeviceAdagrad


def build_dense_optimizer(cfg: Config, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    lr = cfg.optim.dense_lr
    if cfg.optim.dense == "adagrad" and params and all(p.is_cuda for p in params) \
            and not fused_adagrad_runs(params[0].device):
        return DeviceAdagrad(params, lr=lr, eps=cfg.optim.eps)  # capturable: dlrm/train/adagrad.py
    impl = implementation(cfg.optim.dense, params)
    if cfg.optim.dense == "sgd":
        return torch.optim.SGD(params, lr=lr, **impl)
    if cfg.optim.dense == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, eps=cfg.optim.eps, **impl)
    return torch.optim.Adam(params, lr=lr, eps=cfg.optim.eps, **impl)


def implementation(kind: str, params: list[torch.nn.Parameter]) -> dict[str, bool]:
    """torch's fused kernel (``fused=True``: one pass over each parameter, all the MLPs'
    parameters in a few launches) wherever it pays and exists:

        CUDA   SGD, Adam, and Adagrad (asked for only where this torch has Adagrad's
               CUDA kernel, ``fused_adagrad_runs``; else dlrm/train/adagrad.py is built)
        CPU    Adam and Adagrad; SGD keeps torch's default (no faster fused)

    On this 2-core CPU, bench.yaml's MLPs (2.29M parameters), one step: Adam 6.90 ms
    by torch's default loop, 0.90 fused; Adagrad 1.80 and 0.73; SGD 0.46 either way."""
    if not params:
        return {}
    if all(p.is_cuda for p in params):
        return {"fused": True}
    if all(p.device.type == "cpu" for p in params) and kind in ("adam", "adagrad"):
        return {"fused": True}
    return {}


@functools.cache
def fused_adagrad_runs(device: torch.device) -> bool:
    """Whether torch's fused Adagrad runs on ``device`` with a tensor lr, as a captured
    step calls it: one step of a one-element parameter. torch's CPU kernel is old; its
    CUDA one came in 2025 (pytorch#153038), so an older torch raises here."""
    try:  # a torch without the kernel: NotImplementedError; without CUDA: AssertionError
        param = torch.nn.Parameter(torch.zeros(1, device=device))
        param.grad = torch.ones(1, device=device)
        torch.optim.Adagrad([param], lr=torch.tensor(0.1, device=device), fused=True).step()
    except (RuntimeError, NotImplementedError, AssertionError):
        return False
    return True


# A group's implementation of its step: this process's choice, not the checkpoint's.
IMPLEMENTATION = ("fused", "foreach", "capturable", "lr")


def load_dense_state(opt: torch.optim.Optimizer, saved: dict) -> None:
    """``opt.load_state_dict(saved)`` keeping ``opt``'s implementation: torch takes a
    group's ``fused``, ``foreach``, ``capturable`` and lr from the saved one, so a CPU
    run's checkpoint resumed on CUDA stepped SGD by torch's loop (which reads a tensor
    lr on the host: no capture holds it) and a CUDA run's ran CUDA's fused path on the
    CPU. The lr is set by the step from the schedule; its type (a tensor where a graph
    reads it) stays this process's. The step counts move where this implementation
    keeps them (torch's load puts a fused or capturable group's on the device)."""
    groups = saved["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"{len(groups)} dense parameter groups saved, {len(opt.param_groups)} here")
    kept = [{k: mine[k] for k in IMPLEMENTATION if k in mine} for mine in opt.param_groups]
    opt.load_state_dict({**saved, "param_groups": [{**g, **k} for g, k in zip(groups, kept)]})


def lr_factor(cfg: Config, step: int) -> float:
    """Linear warm-up over ``warmup_steps``, then linear decay to 0 over ``decay_steps``."""
    o = cfg.optim
    factor = 1.0
    if o.warmup_steps > 0 and step < o.warmup_steps:
        factor = (step + 1) / o.warmup_steps
    if o.decay_steps > 0 and step >= o.decay_start:
        factor *= max(0.0, 1.0 - (step - o.decay_start) / o.decay_steps)
    return factor
