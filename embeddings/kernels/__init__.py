"""Triton kernels for the embedding path on CUDA (one module per kernel family).

    pooled.py         forward: every (feature, sample) bag of a batch in one launch
    sparse_update.py  backward: one sort of the stacked ids, then one program per run
                      of equal ids that sums its gradient rows and applies the
                      sparse optimizer in place (or writes the KV gradient)
    lookup.py         the autograd glue the collections call
    reference.py      the same computations in plain torch, for the tests

``embeddings.kernels`` chooses the path: ``auto`` (Triton on CUDA tensors when triton
imports, torch elsewhere), ``triton`` (Triton everywhere: on CPU tensors it needs
``TRITON_INTERPRET=1``, which is how CI runs these kernels), ``torch``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from enum import Enum

import torch

from data.errors import UserError


class KernelChoice(str, Enum):
    AUTO = "auto"
    TRITON = "triton"
    TORCH = "torch"


@functools.cache
def triton_available() -> bool:
    """Whether ``triton`` can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_driver_active() -> bool:
    """Whether triton has a driver to launch on (none on a machine without a GPU, unless
    one was set, as tests/compile_only.py sets its compile-only driver)."""
    from triton.runtime import driver

    try:
        driver.active  # noqa: B018  (the property creates the default driver or raises)
    except RuntimeError:
        return False
    return True


def why_not_triton(choice: str | KernelChoice, device: torch.device | str) -> str | None:
    """Why ``choice`` cannot run its kernels on ``device``, in one line, or None. A
    forced ``triton`` without CUDA runs only interpreted: without ``TRITON_INTERPRET=1``
    the first launch died in triton's ``0 active drivers`` traceback. A GPU's driver
    does not take CPU tensors either (``--device cpu`` on a GPU machine); only the
    compile-only driver of tests/compile_only.py, on a machine without CUDA, does."""
    if KernelChoice(choice) is not KernelChoice.TRITON:
        return None
    if not triton_available():
        return "embeddings.kernels=triton needs the triton package; use embeddings.kernels=auto"
    if (torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and (torch.cuda.is_available() or not triton_driver_active())):
        return (f"embeddings.kernels=triton: no CUDA device ({torch.device(device)}); off a GPU the "
                f"Triton kernels run only interpreted, under TRITON_INTERPRET=1 (slow: the tests' "
                f"way); use embeddings.kernels=auto")
    return None


def use_triton(choice: str | KernelChoice, device: torch.device) -> bool:
    """Whether tables on ``device`` take the Triton path under ``choice``."""
    choice = KernelChoice(choice)
    if choice is KernelChoice.TORCH:
        return False
    if choice is KernelChoice.TRITON:
        why = why_not_triton(choice, device)
        if why is not None:
            raise UserError(why)
        return True
    return torch.device(device).type == "cuda" and triton_available()
