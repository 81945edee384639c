"""A run whose loss turns NaN or infinite stops before it saves or evaluates from it.

Before, a diverged run (learning rates too high, a dense column of values near 1e30)
trained on to its end, saved the NaN weights as its newest checkpoint (so a resume
took them) and died in the final eval with a traceback (``scores: contains NaN or
infinite values``).

Where the run looks (each a point where the host waits for the device anyway, so
the step itself gains no sync)::

    log line  (train.log_every)   the window's mean loss, all-reduced
    eval      (train.eval_every)  the loss since the last log line, and the dense weights
    save      (checkpoints, end)  the same

A NaN loss is the same on every rank (all-reduced) and the dense weights are
replicated (DDP), so every rank stops at the same step with the same line, exit 2,
and the newest checkpoint stays the last one saved before the loss went bad.
Tables are not scanned (a pass over every row); a table that went bad makes the loss
bad within a step of being looked up.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from data.errors import UserError
from dlrm.config import Config


class Diverged(UserError):
    """The training loss or a dense weight is NaN or infinite."""


class DivergenceGuard:
    """Remembers the last step seen finite; ``check`` raises Diverged past it."""

    def __init__(self, cfg: Config, dense_params: Iterable[torch.Tensor], newest: str | None) -> None:
        self.cfg, self.params, self.newest = cfg, list(dense_params), newest
        self.finite_step: int | None = None

    def saved(self, checkpoint: str) -> None:
        self.newest = checkpoint

    def check(self, loss: float, step: int) -> None:
        """``loss``: the mean (or sum) of the steps since the last check, all ranks."""
        bad = None if math.isfinite(loss) else f"the training loss is {loss}"
        if bad is None and self.params and not _finite(self.params):
            bad = "a dense weight is NaN or infinite"
        if bad is None:
            self.finite_step = step
            return
        since = f" (finite at step {self.finite_step})" if self.finite_step is not None else ""
        kept = (f"the newest checkpoint, {self.newest}, is from before it" if self.newest
                else "no checkpoint was saved")
        optim = self.cfg.optim
        raise Diverged(
            f"{bad} at step {step}{since}: the run diverged and stopped without saving or "
            f"evaluating those weights; {kept}. Lower optim.dense_lr ({optim.dense_lr:g}) and "
            f"optim.sparse_lr ({optim.sparse_lr:g}), or tame extreme dense values "
            "(data.dense_transform=log1p or standardize), then train again")


def _finite(params: list[torch.Tensor]) -> bool:
    """Every element of every tensor is finite (one host wait for all of them)."""
    with torch.no_grad():
        return bool(torch.stack([p.detach().isfinite().all() for p in params]).all())
