"""Dense Adagrad whose step a CUDA graph can hold, for a torch without a fused CUDA Adagrad.

Adagrad is the default dense optimizer (``optim.dense``). torch fuses it on the CPU,
and on CUDA only since pytorch#153038 (2025). Without that kernel, torch's multi-tensor
Adagrad reads each step count on the host (``.item()``) to decay the lr. A capture
refuses that, so every step ran eager: 813,595 samples/s against 2,745,818 graphed
with fused SGD (one H200, configs/bench_gpu.yaml, 2026-11-27, 510732f).

This is torch's multi-tensor arithmetic with ``lr_decay=0`` (the only value we build
torch's Adagrad with), so nothing is read on the host:

    sum   += g * g
    param -= (lr * g) / (sqrt(sum) + eps)

The lr is a number or a one-element tensor on the parameters' device (what a replay
reads, dlrm/train/graphs.py ``tensor_lrs``). Each parameter's state is torch's Adagrad
state (``step``, ``sum``; the step on the device), so a checkpoint written by either
resumes on the other.
"""

from __future__ import annotations

from typing import Any

import torch


class DeviceAdagrad(torch.optim.Optimizer):
    """Adagrad in a few multi-tensor launches, nothing read on the host."""

    def __init__(self, params: Any, lr: float | torch.Tensor = 1e-2, eps: float = 1e-10) -> None:
        # the keys of torch's Adagrad groups: a saved state loads into either class
        defaults = {"lr": lr, "lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator_value": 0.0, "eps": eps,
                    "foreach": True, "maximize": False, "differentiable": False, "fused": None}
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                 "sum": torch.zeros_like(p, memory_format=torch.preserve_format)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then each step count onto its parameter's device (torch leaves
        a non-capturable group's on the CPU, where a replay could not count it)."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            if group["lr_decay"] != 0.0 or group["weight_decay"] != 0.0:
                raise ValueError("a saved Adagrad state with lr_decay or weight_decay: this Adagrad has neither")
            for p in group["params"]:
                state = self.state[p]
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        assert closure is None, "DeviceAdagrad takes no closure"
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            if any(g.is_sparse for g in grads):
                raise RuntimeError("DeviceAdagrad: sparse gradients (the embeddings' are the sparse optimizer's)")
            sums = [self.state[p]["sum"] for p in params]
            torch._foreach_add_([self.state[p]["step"] for p in params], 1.0)
            torch._foreach_addcmul_(sums, grads, grads, value=1.0)
            std = torch._foreach_sqrt(sums)
            torch._foreach_add_(std, group["eps"])
            lr = group["lr"]
            # torch's (-lr * g) / std, negated: the same bits, the sign on the add
            numerator = torch._foreach_mul(grads, lr)
            torch._foreach_addcdiv_(params, numerator, std, value=-1.0)
